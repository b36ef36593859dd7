"""ZeRO stages as shardings: which model state is split across the data-parallel devices.

ZeRO partitions, across the N_d devices that hold different data, first the optimizer state
(stage 1), then also the gradients (stage 2), then also the parameters (stage 3, which is
FSDP). In SPMD terms each stage only changes a sharding: the state keeps the layout its
logical rules give (tensor parallelism composes unchanged) and additionally has one
dimension split over the data-parallel mesh axes that the layout does not use yet. XLA then
inserts the reduce-scatters and all-gathers that ZeRO describes.

With mixed-precision Adam (2 bytes of half-precision parameters, 2 of gradients, 12 of f32
master weights and moments per parameter) per-device model-state bytes are
``16 psi``, ``4 psi + 12 psi / N_d``, ``2 psi + 14 psi / N_d`` and ``16 psi / N_d`` for
stages 0 to 3 (:func:`formula_bytes`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.sharding.rules import entry_axes

STAGES = (0, 1, 2, 3)


STACK_NAMES = frozenset({"layers", "repeat", "stage"})
"""Logical names of the dimensions a model stacks its layers along (scanned or pipelined)."""


def stacked_dims(names: tuple[str | None, ...] | None) -> int:
    """How many leading dimensions of a weight named ``names`` stack layers."""
    count = 0
    for name in names or ():
        if name not in STACK_NAMES:
            break
        count += 1
    return count


def zero_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh,
              dp_axes: tuple[str, ...], stacked: int = 0) -> tuple[PartitionSpec, bool]:
    """Add the unused data-parallel axes to the largest unsharded dimension they divide.

    The first ``stacked`` dimensions (a layer stack, see :func:`stacked_dims`) are never
    split: a layer loop slices one layer out of them, and a stack split along that
    dimension is gathered whole at every layer. When no other dimension is free, the axes
    join a dimension already split over a data-parallel axis (FSDP's), so that one gather
    over all of them brings a layer's weights.

    Returns the new spec and whether the array could be split (False: it stays as it was,
    because no dimension is divisible by the data-parallel size).
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in entry_axes(e)}
    free = tuple(a for a in dp_axes if a not in used and mesh.shape[a] > 1)
    if not free:
        return PartitionSpec(*entries), True
    size = math.prod(mesh.shape[a] for a in free)
    candidates = [d for d, e in enumerate(entries)
                  if d >= stacked and e is None and shape[d] % size == 0]
    if candidates:
        dim = max(candidates, key=lambda d: shape[d])
        entries[dim] = free[0] if len(free) == 1 else free
        return PartitionSpec(*entries), True

    def split(d: int) -> int:
        return size * math.prod(mesh.shape[a] for a in entry_axes(entries[d]))

    joined = [d for d, e in enumerate(entries)
              if d >= stacked and set(entry_axes(e)) & set(dp_axes) and shape[d] % split(d) == 0]
    if not joined:
        return PartitionSpec(*entries), False
    dim = max(joined, key=lambda d: shape[d])
    axes = set(free) | set(entry_axes(entries[dim]))
    entries[dim] = (tuple(a for a in dp_axes if a in axes)
                    + tuple(a for a in entry_axes(entries[dim]) if a not in dp_axes))
    return PartitionSpec(*entries), True


def zero_shardings(shardings: Any, shapes: Any, mesh: Mesh, dp_axes: tuple[str, ...],
                   stacked: Any = None) -> tuple[Any, list[str]]:
    """Apply :func:`zero_spec` to every leaf; also returns the paths left whole.

    ``stacked``, a tree like ``shardings`` of ints, counts each leaf's layer-stack
    dimensions (default: none)."""
    left_whole: list[str] = []
    if stacked is None:
        stacked = jax.tree.map(lambda _: 0, shardings)

    def one(path, sharding: NamedSharding, shape_like, lead: int) -> NamedSharding:
        shape = tuple(getattr(shape_like, "shape", ()))
        if not shape:
            return sharding
        spec, split = zero_spec(sharding.spec, shape, mesh, dp_axes, lead)
        if not split:
            left_whole.append(jax.tree_util.keystr(path))
        return NamedSharding(mesh, spec)

    out = jax.tree_util.tree_map_with_path(one, shardings, shapes, stacked)
    return out, left_whole


def formula_bytes(stage: int, n_params: int, dp: int, model_parallel: int = 1) -> float:
    """ZeRO paper per-device model-state bytes for mixed-precision Adam (K = 12).

    ``model_parallel`` divides everything (tensor parallelism splits all state alike).
    """
    psi = n_params / model_parallel
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / dp, 2: 2 * psi + 14 * psi / dp,
            3: 16 * psi / dp}[stage]


def per_device_bytes(tree: Any) -> int:
    """Bytes one device (the first) holds of all arrays in ``tree``."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            shard = x.addressable_shards[0].data
            total += shard.size * shard.dtype.itemsize
    return total
