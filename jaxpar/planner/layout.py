"""Where each parameter lives for a candidate layout, computed without devices.

The planner resolves shardings with the very code the Trainer uses
(:func:`jaxpar.sharding.rules.preset`, :meth:`Rules.spec`,
:func:`jaxpar.parallel.zero.zero_spec`), against a stand-in mesh that has only axis
sizes, so its per-device sizes are the Trainer's exactly.

For every tensor it records the elements one device holds in four layouts:

* ``base``: the parameter rules' layout (what optimizer state uses at ZeRO 0);
* ``zero``: with the free data-parallel axes added (ZeRO 1-3 state, ZeRO 2-3 gradients);
* ``compute``: what a matmul needs, the stored layout without data-parallel axes (weights
  sharded over ``fsdp`` or by ZeRO-3 are all-gathered to it, just in time);
* and which data-parallel axes the stored gradient is split over.

Expert weights are the exception to "data-parallel axes are gathered": the ``expert`` mesh
axis splits the batch (it is a data-parallel axis) and also the experts' leading
dimension, and a device computes only with the experts it holds, the tokens coming to it
by all-to-all (see :mod:`jaxpar.models.moe`). So an axis that splits a tensor's ``expert``
dimension stays in its compute layout, is never gathered, and its gradient is not reduced
over it (:attr:`Placed.owned_axes`). The same holds for a vocabulary split over a
data-parallel axis (``plan.vocab_over_fsdp``): the embedding table and the output head
are used where they lie, the tokens' activations move instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from functools import lru_cache
from types import SimpleNamespace

from jax.sharding import PartitionSpec

from jaxpar.errors import JaxparError
from jaxpar.parallel.zero import stacked_dims, zero_spec
from jaxpar.planner.model import IdentityMemo, ModelSpec, Tensor
from jaxpar.sharding import rules as rules_lib
from jaxpar.sharding.mesh import MESH_AXES
from jaxpar.sharding.rules import entry_axes

OWNING_NAMES = ("expert", "vocab")
"""Logical names whose data-parallel split stays in the compute layout (see the module
docstring)."""


def local_elems(shape: tuple[int, ...], spec: PartitionSpec, sizes: Mapping[str, int]) -> int:
    """Elements one device holds of an array of ``shape`` laid out as ``spec``."""
    n = 1
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for dim, entry in zip(shape, entries, strict=True):
        n *= dim // math.prod(sizes[a] for a in entry_axes(entry))
    return n


def _drop(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
    out = []
    for entry in spec:
        kept = tuple(a for a in entry_axes(entry) if a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


@dataclasses.dataclass(frozen=True)
class Placed:
    """One tensor's per-device elements in each layout (see the module docstring)."""

    tensor: Tensor
    base: int
    zero: int
    compute: int
    store_dp_axes: tuple[str, ...]  # data-parallel axes the stored parameter is split over
    zero_axes: tuple[str, ...]  # axes ZeRO adds to optimizer state / gradients
    base_dp_axes: tuple[str, ...]  # data-parallel axes already in the base layout (FSDP)
    owned_axes: tuple[str, ...] = ()  # axes splitting the expert dimension (never gathered)


@dataclasses.dataclass(frozen=True)
class Layout:
    """All tensors of a model placed on a mesh under a rules preset and ZeRO stage."""

    sizes: dict[str, int]
    dp_axes: tuple[str, ...]
    dp: int
    tp_axes: tuple[str, ...]
    placed: tuple[Placed, ...]
    zero_stage: int
    cp_axes: tuple[str, ...] = ()  # axes the sequence is split over (context parallelism)
    _totals: dict[str, int] = dataclasses.field(default_factory=dict, compare=False,
                                                repr=False)

    def total(self, which: str) -> int:
        """Sum over tensors of one layout's per-device elements."""
        if which not in self._totals:
            self._totals[which] = sum(getattr(p, which) for p in self.placed)
        return self._totals[which]


@lru_cache(maxsize=4096)
def _layout_cached(spec: ModelSpec, sizes_items: tuple[tuple[str, int], ...], rules: str,
                   zero_stage: int, vocab_over_fsdp: bool = False) -> Layout:
    sizes, dp_axes, dp, tp_axes, cp_axes, specs = _resolved(spec, sizes_items, rules,
                                                             vocab_over_fsdp)
    placed = []
    for t, (base_spec, zspec, owned) in zip(spec.tensors, specs, strict=True):
        store = zspec if zero_stage >= 3 else base_spec
        store_dp = tuple(a for e in store for a in entry_axes(e) if a in dp_axes and a not in owned)
        base_dp = tuple(a for e in base_spec for a in entry_axes(e)
                        if a in dp_axes and a not in owned)
        zero_axes = tuple(a for e in zspec for a in entry_axes(e)
                          if a in dp_axes and a not in base_dp and a not in owned)
        compute = _drop(store, tuple(a for a in dp_axes if a not in owned))
        placed.append(Placed(t, local_elems(t.shape, base_spec, sizes),
                             local_elems(t.shape, zspec, sizes),
                             local_elems(t.shape, compute, sizes), store_dp, zero_axes, base_dp,
                             owned))
    return Layout(dict(sizes), dp_axes, dp, tp_axes, tuple(placed), zero_stage, cp_axes)


@lru_cache(maxsize=1024)
def _resolved(spec: ModelSpec, sizes_items: tuple[tuple[str, int], ...], rules: str,
              vocab_over_fsdp: bool) -> tuple:
    """What :func:`_layout_cached` reads off the rules, the same at every ZeRO stage:
    the mesh sizes, the data-parallel axes and their size, the tensor- and
    context-parallel axes, and per tensor its base and ZeRO partition specs and the
    data-parallel axes that split its expert or vocabulary dimension."""
    sizes = dict(sizes_items)
    mesh = SimpleNamespace(shape=sizes)
    param_rules, act_rules = rules_lib.split_vocab_over_fsdp(*rules_lib.preset(rules),
                                                             vocab_over_fsdp)
    batch = act_rules.spec(("batch",), mesh)[0]
    dp_axes = entry_axes(batch)
    dp = math.prod(sizes[a] for a in dp_axes)
    tp_axes = tuple(a for a in ("tensor",) if sizes.get(a, 1) > 1 and a not in dp_axes)
    seq = act_rules.spec(("seq",), mesh)[0]
    cp_axes = tuple(a for a in entry_axes(seq) if sizes[a] > 1 and a not in dp_axes)
    specs = []
    for t in spec.tensors:
        base_spec = param_rules.spec(t.names, mesh, shape=t.shape, path=t.path)
        entries = list(base_spec) + [None] * (len(t.shape) - len(base_spec))
        owned = tuple(a for name, e in zip(t.names, entries, strict=True)
                      if name in OWNING_NAMES for a in entry_axes(e) if a in dp_axes)
        zspec, _ = zero_spec(base_spec, t.shape, mesh, dp_axes, stacked_dims(t.names))
        specs.append((base_spec, zspec, owned))
    return sizes, dp_axes, dp, tp_axes, cp_axes, tuple(specs)


def layout(spec: ModelSpec, sizes: Mapping[str, int], rules: str, zero_stage: int,
           vocab_over_fsdp: bool = False) -> Layout:
    """Place ``spec``'s tensors on a mesh of total axis ``sizes`` (ICI x DCN per axis);
    ``vocab_over_fsdp``: with :func:`jaxpar.sharding.rules.split_vocab_over_fsdp`'s rules.

    Raises:
      JaxparError: when a sharded dimension does not divide (the message names it).
    """
    # The search asks for the same few layouts tens of thousands of times: look them up
    # by the model's identity first (hashing a ModelSpec walks all its tensors).
    def place() -> Layout:
        full = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
        if any(v < 1 for v in full.values()):
            raise JaxparError(f"mesh sizes must be positive, got {full}")
        return _layout_cached(spec, tuple(full.items()), rules, zero_stage, vocab_over_fsdp)

    return _RECENT.get((spec,), (tuple(sizes.items()), rules, zero_stage, vocab_over_fsdp),
                       place)


_RECENT = IdentityMemo()
""":func:`layout`'s results by the model's identity (see there)."""
