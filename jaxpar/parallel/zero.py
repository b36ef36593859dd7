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

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

STAGES = (0, 1, 2, 3)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def zero_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh,
              dp_axes: tuple[str, ...]) -> tuple[PartitionSpec, bool]:
    """Add the unused data-parallel axes to the largest unsharded dimension they divide.

    Returns the new spec and whether the array could be split (False: it stays as it was,
    because no free dimension is divisible by the data-parallel size).
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in _axes(e)}
    free = tuple(a for a in dp_axes if a not in used and mesh.shape[a] > 1)
    if not free:
        return PartitionSpec(*entries), True
    size = math.prod(mesh.shape[a] for a in free)
    candidates = [d for d, e in enumerate(entries) if e is None and shape[d] % size == 0]
    if not candidates:
        return PartitionSpec(*entries), False
    dim = max(candidates, key=lambda d: shape[d])
    entries[dim] = free[0] if len(free) == 1 else free
    return PartitionSpec(*entries), True


def zero_shardings(shardings: Any, shapes: Any, mesh: Mesh, dp_axes: tuple[str, ...]
                   ) -> tuple[Any, list[str]]:
    """Apply :func:`zero_spec` to every leaf; also returns the paths left whole."""
    left_whole: list[str] = []

    def one(path, sharding: NamedSharding, shape_like) -> NamedSharding:
        shape = tuple(getattr(shape_like, "shape", ()))
        if not shape:
            return sharding
        spec, split = zero_spec(sharding.spec, shape, mesh, dp_axes)
        if not split:
            left_whole.append(jax.tree_util.keystr(path))
        return NamedSharding(mesh, spec)

    out = jax.tree_util.tree_map_with_path(one, shardings, shapes)
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


# --- ZeRO++ qwZ: weights gathered in int8 ----------------------------------------------
def _reduced_axes(spec: PartitionSpec, ndim: int, dp_axes: tuple[str, ...]) -> tuple[int, ...]:
    """The dimensions a weight's int8 scale is taken over: every one not split over the
    data-parallel axes, but the leading stack of layers (one scale per layer and row)."""
    entries = list(spec) + [None] * (ndim - len(spec))
    split = {d for d, e in enumerate(entries) if set(_axes(e)) & set(dp_axes)}
    lead = {0} if ndim >= 3 else set()
    return tuple(d for d in range(ndim) if d not in split | lead)


def _quantized_all_gather(w: jax.Array, mesh: Mesh, spec: PartitionSpec,
                          dp_axes: tuple[str, ...], reduced: tuple[int, ...]) -> jax.Array:
    """``w`` (stored as ``spec``) quantized where it lies, block by block (one scale per
    row of each device's block), all-gathered over the data-parallel axes in int8 with
    its scales and dequantized: explicit collectives in a ``shard_map``, so XLA can
    neither move the gather before the quantization nor gather anything else."""
    entries = list(spec) + [None] * (w.ndim - len(spec))
    rest = PartitionSpec(*(tuple(a for a in _axes(e) if a not in dp_axes) or None
                           for e in entries))

    def body(shard: jax.Array) -> jax.Array:
        x = shard.astype(jnp.float32)
        scale = jnp.max(jnp.abs(x), axis=reduced, keepdims=True) / 127.0
        scale = jnp.where(scale > 0, scale, 1.0)
        q = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
        for dim, entry in enumerate(entries):
            names = tuple(a for a in _axes(entry) if a in dp_axes)
            if names:
                names = names if len(names) > 1 else names[0]
                q = jax.lax.all_gather(q, names, axis=dim, tiled=True)
                scale = jax.lax.all_gather(scale, names, axis=dim, tiled=True)
        return (q.astype(jnp.float32) * scale).astype(shard.dtype)

    # Every device ends with its weight whole over the data-parallel axes (the type
    # check cannot see through the gathered scales).
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=rest,
                         check_vma=False)(w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _int8_gather(w, mesh, spec, dp_axes, reduced):
    return _quantized_all_gather(w, mesh, spec, dp_axes, reduced)


def _int8_gather_fwd(w, mesh, spec, dp_axes, reduced):
    return _quantized_all_gather(w, mesh, spec, dp_axes, reduced), None


def _int8_gather_bwd(mesh, spec, dp_axes, reduced, _, g):
    return (g,)  # straight through: the gradient is the dequantized weight's


_int8_gather.defvjp(_int8_gather_fwd, _int8_gather_bwd)


def gather_int8(tree: Any, shardings: Any, mesh: Mesh, dp_axes: tuple[str, ...]) -> Any:
    """ZeRO++'s quantized weight all-gather (qwZ): every floating weight of ``tree``
    (matrices and up) stored split over the data-parallel axes (``shardings``: how it is
    stored) is quantized where it lies, in int8 with one f32 scale per row (absolute
    maximum over the dimensions not split; per layer for stacked layers), gathered in that
    form to its compute layout (the same sharding without the data-parallel axes) and
    dequantized there: the all-gathers move a byte an element (plus the scales) instead
    of two or four. The gradient passes straight through to the stored weight, whose
    reduce-scatter is unchanged."""
    def one(w, sharding):
        if (not isinstance(sharding, NamedSharding) or w.ndim < 2
                or not jnp.issubdtype(w.dtype, jnp.floating)):
            return w
        spec = sharding.spec
        if not any(set(_axes(e)) & set(dp_axes) for e in spec):
            return w
        if any(set(_axes(e)) & set(dp_axes) and set(_axes(e)) - set(dp_axes) for e in spec):
            return w  # a dimension split over data-parallel and other axes at once
        return _int8_gather(w, mesh, spec, tuple(dp_axes),
                            _reduced_axes(spec, w.ndim, dp_axes))

    return jax.tree.map(one, tree, shardings)
