"""ZeRO++: the collectives of FSDP / ZeRO-3 in int8.

With weights split over the data-parallel axes, each step all-gathers every weight for
the forward and backward passes and reduce-scatters every gradient. ZeRO++ sends both in
8 bits:

qwZ (:func:`gather_int8`, ``plan.quantize_gather=int8``): each device quantizes its own
block of a weight, ``q = round(w / s)`` with ``s = max|w| / 127`` per row of the block,
and the int8 blocks and their scales are all-gathered and dequantized where they arrive.
The gradient passes straight through to the stored weight.

qgZ (:func:`reduce_int8`, ``plan.quantize_reduce=int8``): the gradient reduction is done
by hand. The step runs in a ``shard_map`` manual over the data-parallel axes: each device
gathers the weights (in int8 under qwZ too), computes the gradient of its share of the
batch with respect to the whole weights, and reduces it to its own block by an all-to-all
of int8 chunks: the gradient is cut into as many chunks as devices on the axis, each
chunk quantized (one scale per row), chunk ``j`` sent to device ``j``, and the chunks
received are dequantized and summed in float32. For a dimension split over several axes,
or several dimensions split over different axes, the reduction goes one axis at a time
from the innermost mesh axis (inside a slice) to the outermost (across slices),
re-quantizing the partial sums between hops, so the slow links carry the already reduced,
smaller chunks. Over data-parallel axes that do not split a gradient (plain data
parallelism) the block is then all-reduced in int8 too: an all-to-all of quantized
chunks, each device summing one, and an all-gather of the quantized sums. Where GSPMD
moves ``(n - 1) / n`` of a gradient in its compute
dtype per device, qgZ moves the same fraction in one byte an element plus a scale a row.

Both gather each weight once per step, outside the layer loop, so a device holds the
whole weights (and, under qgZ, their whole gradients) during the step, as ZeRO-2 would;
the planner's memory counts them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.errors import JaxparError
from jaxpar.sharding.rules import entry_axes

MODES: tuple[str, ...] = ("none", "int8")


def _entries(spec: PartitionSpec, ndim: int) -> list[Any]:
    return list(spec) + [None] * (ndim - len(spec))


def quantize_int8(x: jax.Array, axis: int | tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """``x`` as int8 and float32 scales (absolute maximum over ``axis`` / 127)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


def _gather_block(shard: jax.Array, spec: PartitionSpec, dp_axes: tuple[str, ...],
                  int8: bool) -> jax.Array:
    """Inside a ``shard_map`` manual over ``dp_axes``: the device's block of a weight
    stored as ``spec`` all-gathered over those axes, in int8 with scales if ``int8``."""
    entries = _entries(spec, shard.ndim)
    split = [(d, tuple(a for a in entry_axes(e) if a in dp_axes)) for d, e in enumerate(entries)]
    split = [(d, names if len(names) > 1 else names[0]) for d, names in split if names]
    if not int8:
        for dim, names in split:
            shard = jax.lax.all_gather(shard, names, axis=dim, tiled=True)
        return shard
    q, scale = quantize_int8(shard, _reduced_axes(spec, shard.ndim, dp_axes, shard.shape))
    for dim, names in split:
        q = jax.lax.all_gather(q, names, axis=dim, tiled=True)
        scale = jax.lax.all_gather(scale, names, axis=dim, tiled=True)
        if scale.shape[dim] != q.shape[dim]:  # one scale a device's block of this dimension
            scale = jnp.repeat(scale, q.shape[dim] // scale.shape[dim], axis=dim)
    return (q.astype(jnp.float32) * scale).astype(shard.dtype)


# --- qwZ: weights gathered in int8 ---------------------------------------------------------
def _reduced_axes(spec: PartitionSpec, ndim: int, dp_axes: tuple[str, ...],
                  shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dimensions a weight's int8 scale is taken over: all but the leading stack of
    layers (one scale per layer) and the largest dimension split over the data-parallel
    axes (one scale per row of it). Another dimension split over them (``data`` and
    ``fsdp`` on two dimensions) gets a scale per device's block: a scale per row of it
    too would be as many scales as the weight has elements over a few heads."""
    entries = _entries(spec, ndim)
    split = [d for d, e in enumerate(entries) if set(entry_axes(e)) & set(dp_axes)]
    lead = {0} if ndim >= 3 else set()
    rows = {max(split, key=lambda d: shape[d])} if split else set()
    return tuple(d for d in range(ndim) if d not in rows | lead)


def _without(spec: PartitionSpec, ndim: int, axes: tuple[str, ...]) -> PartitionSpec:
    """``spec`` with ``axes`` removed from every entry."""
    return PartitionSpec(*(tuple(a for a in entry_axes(e) if a not in axes) or None
                           for e in _entries(spec, ndim)))


def _only(spec: PartitionSpec, ndim: int, axes: tuple[str, ...]) -> PartitionSpec:
    """``spec`` keeping only ``axes`` (what a ``shard_map`` manual over them names)."""
    return PartitionSpec(*(tuple(a for a in entry_axes(e) if a in axes) or None
                           for e in _entries(spec, ndim)))


def _quantized_all_gather(w: jax.Array, mesh: Mesh, spec: PartitionSpec,
                          dp_axes: tuple[str, ...]) -> jax.Array:
    """``w`` (stored as ``spec``) gathered over ``dp_axes`` in int8: explicit collectives
    in a ``shard_map``, so XLA can neither move the gather before the quantization nor
    gather anything else. Every device ends with its weight whole over those axes (the
    type check cannot see through the gathered scales)."""
    return jax.shard_map(lambda s: _gather_block(s, spec, dp_axes, int8=True), mesh=mesh,
                         in_specs=spec, out_specs=_without(spec, w.ndim, dp_axes),
                         check_vma=False)(w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _int8_gather(w, mesh, spec, dp_axes):
    return _quantized_all_gather(w, mesh, spec, dp_axes)


def _int8_gather_fwd(w, mesh, spec, dp_axes):
    return _quantized_all_gather(w, mesh, spec, dp_axes), None


def _int8_gather_bwd(mesh, spec, dp_axes, _, g):
    return (g,)  # straight through: the gradient is the dequantized weight's


_int8_gather.defvjp(_int8_gather_fwd, _int8_gather_bwd)


def _gathered(w: Any, sharding: Any, dp_axes: tuple[str, ...]) -> bool:
    """Whether qwZ gathers ``w``: a floating matrix (or more) split over the data-parallel
    axes, and no dimension split over data-parallel and other axes at once."""
    if (not isinstance(sharding, NamedSharding) or w.ndim < 2
            or not jnp.issubdtype(w.dtype, jnp.floating)):
        return False
    entries = [set(entry_axes(e)) for e in sharding.spec]
    return (any(e & set(dp_axes) for e in entries)
            and not any(e & set(dp_axes) and e - set(dp_axes) for e in entries))


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
        if not _gathered(w, sharding, dp_axes):
            return w
        return _int8_gather(w, mesh, sharding.spec, tuple(dp_axes))

    return jax.tree.map(one, tree, shardings)


# --- qgZ: gradients reduce-scattered in int8 ------------------------------------------------
def _reduce_scatter_block(g: jax.Array, spec: PartitionSpec, mesh: Mesh,
                          dp_axes: tuple[str, ...]) -> jax.Array:
    """Inside a ``shard_map`` manual over ``dp_axes``: this device's block (as ``spec``
    splits it) of the sum over those axes of every device's ``g``, reduced by int8
    all-to-alls one axis at a time, innermost mesh axis first."""
    entries = _entries(spec, g.ndim)
    shape, hops = [], []  # the block-split shape, and (axis, its chunk dimension) pairs
    for d, e in enumerate(entries):
        names = [a for a in entry_axes(e) if a in dp_axes]
        n = math.prod(mesh.shape[a] for a in names)
        for a in names:
            hops.append((a, len(shape)))
            shape.append(mesh.shape[a])
        shape.append(g.shape[d] // n)
    order = list(mesh.axis_names)
    hops.sort(key=lambda hop: -order.index(hop[0]))  # inside a slice first
    x = g.astype(jnp.float32).reshape(shape)
    for axis, dim in hops:
        q, scale = quantize_int8(x, x.ndim - 1)
        q = jax.lax.all_to_all(q, axis, dim, dim, tiled=True)
        scale = jax.lax.all_to_all(scale, axis, dim, dim, tiled=True)
        x = jnp.sum(q.astype(jnp.float32) * scale, axis=dim, keepdims=True)
    block = tuple(s // math.prod(mesh.shape[a] for a in entry_axes(e) if a in dp_axes)
                  for s, e in zip(g.shape, entries, strict=True))
    x = x.reshape(block)
    used = {a for e in entries for a in entry_axes(e)}
    for axis in sorted((a for a in dp_axes if a not in used), key=lambda a: -order.index(a)):
        x = _all_reduce_int8(x, axis, mesh.shape[axis])
    return x.astype(g.dtype)


_ROW = 256
"""Elements per int8 scale when an all-reduce is done in int8."""


def _all_reduce_int8(x: jax.Array, axis: str, n: int) -> jax.Array:
    """The sum of ``x`` over ``axis`` (``n`` devices), by an int8 all-to-all (each device
    sums one ``n``-th) and an int8 all-gather of the sums, rows of :data:`_ROW` elements
    with one scale each: for the data-parallel axes a gradient is not split over."""
    flat = x.reshape(-1)
    pad = -flat.size % (n * _ROW)
    rows = jnp.pad(flat, (0, pad)).reshape(n, -1, _ROW)
    q, scale = quantize_int8(rows, 2)
    q = jax.lax.all_to_all(q, axis, 0, 0, tiled=True)
    scale = jax.lax.all_to_all(scale, axis, 0, 0, tiled=True)
    q, scale = quantize_int8(jnp.sum(q.astype(jnp.float32) * scale, axis=0, keepdims=True), 2)
    whole = (jax.lax.all_gather(q, axis, axis=0, tiled=True).astype(jnp.float32)
             * jax.lax.all_gather(scale, axis, axis=0, tiled=True))
    return whole.reshape(-1)[:flat.size].reshape(x.shape)


def _per_block(fn: Callable[[jax.Array], jax.Array], x: jax.Array, spec: PartitionSpec,
               dp_axes: tuple[str, ...]) -> jax.Array:
    """``fn`` on each device's block of ``x`` also over the other axes ``spec`` splits
    (tensor, ...), in a nested ``shard_map`` manual over them: left to GSPMD, XLA
    replicates those dimensions before an all-to-all over the data-parallel axes."""
    rest = _without(spec, x.ndim, dp_axes)
    names = {a for e in rest for a in entry_axes(e)}
    if not names:
        return fn(x)
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=rest,
                         out_specs=rest, axis_names=names, check_vma=False)(x)


def _local_block(x: jax.Array, spec: PartitionSpec, dp_axes: tuple[str, ...]) -> jax.Array:
    """Inside a ``shard_map`` manual over ``dp_axes``: this device's block of a whole
    array ``x`` stored as ``spec`` (the inverse of a gather, without communication)."""
    for d, e in enumerate(_entries(spec, x.ndim)):
        names = tuple(a for a in entry_axes(e) if a in dp_axes)
        if names:
            size = x.shape[d] // math.prod(jax.lax.axis_size(a) for a in names)
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(names) * size, size, d)
    return x


def check(plan: Any, grad_shardings: Any) -> None:
    """Refuse plans qgZ cannot run, in one line: it reduces gradients split over the
    data-parallel axes (FSDP, ZeRO-2/3) on one layer loop."""
    if plan.mesh.shape.get("stage", 1) > 1:
        raise JaxparError("plan.quantize_reduce runs the step manual over the data-parallel "
                          "axes; it does not combine with pipeline stages (mesh.stage > 1)")
    dp = set(plan.data_parallel_axes)
    leaves = jax.tree_util.tree_leaves_with_path(
        grad_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for path, sh in leaves:
        for entry in sh.spec:
            if set(entry_axes(entry)) & dp and set(entry_axes(entry)) - dp:
                raise JaxparError(
                    f"plan.quantize_reduce: {jax.tree_util.keystr(path)} has a dimension "
                    f"split over data-parallel and other axes at once ({entry}); put them "
                    "on different dimensions")
    if not any(set(entry_axes(e)) & dp for _, sh in leaves for e in sh.spec):
        raise JaxparError("plan.quantize_reduce quantizes the reduce-scatter of gradients "
                          "split over the data-parallel axes; this plan splits none (use "
                          "an fsdp axis or plan.zero_stage >= 2)")


def reduce_int8(gradients: Callable[..., tuple], plan: Any, shardings: dict[str, Any],
                grad_shardings: Any) -> Callable[..., tuple]:
    """``gradients(view, batch) -> (loss, grads, frozen, extra)`` run in a ``shard_map``
    manual over the data-parallel axes: the weights (``view["params"]``,
    ``view["frozen"]``, stored as ``shardings`` says) gathered first (int8 under
    ``plan.quantize_gather``), the gradients reduced to ``grad_shardings`` by int8
    all-to-alls (qgZ) and averaged. Returns a function of ``(view, batch)`` with the
    same results, the gradients and frozen state in their stored layouts."""
    mesh, axes = plan.mesh, tuple(a for a in plan.data_parallel_axes if plan.mesh.shape[a] > 1)
    int8 = plan.quantize_gather == "int8"
    is_sh = lambda x: isinstance(x, NamedSharding)  # noqa: E731
    size = math.prod(mesh.shape[a] for a in axes)

    def specs(tree: Any) -> Any:
        return jax.tree.map(lambda sh: _only(sh.spec, len(sh.spec), axes), tree, is_leaf=is_sh)

    def gather(tree: Any, sh: Any) -> Any:
        def one(w, s):
            if not any(set(entry_axes(e)) & set(axes) for e in s.spec):
                return w
            block = functools.partial(_gather_block, spec=s.spec, dp_axes=axes,
                                      int8=int8 and _gathered(w, s, axes))
            return _per_block(block, w, s.spec, axes)
        return jax.tree.map(one, tree, sh, is_leaf=is_sh)

    def local(view, batch):
        whole = dict(view, params=gather(view["params"], shardings["params"]),
                     frozen=gather(view["frozen"], shardings["frozen"]))
        loss, grads, frozen, extra = gradients(whole, batch)
        def reduce(g, s):
            block = functools.partial(_reduce_scatter_block, spec=s.spec, mesh=mesh,
                                      dp_axes=axes)
            return _per_block(block, g, s.spec, axes) / size

        grads = jax.tree.map(reduce, grads, grad_shardings, is_leaf=is_sh)
        frozen = jax.tree.map(lambda f, s: _local_block(f, s.spec, axes), frozen,
                              shardings["frozen"], is_leaf=is_sh)
        mean = lambda t: jax.tree.map(lambda v: jax.lax.pmean(v, axes), t)  # noqa: E731
        return mean(loss), grads, frozen, mean(extra)

    def run(view, batch):
        view_specs = {k: specs(shardings[k]) if k in ("params", "frozen") else PartitionSpec()
                      for k in view}
        return jax.shard_map(
            local, mesh=mesh, in_specs=(view_specs, PartitionSpec(axes)),
            out_specs=(PartitionSpec(), specs(grad_shardings), view_specs["frozen"],
                       PartitionSpec()),
            axis_names=set(axes), check_vma=False)(view, batch)

    return run


HPZ_AXIS = "data"
"""The axis hpZ gathers once a step: the one that spans the slices."""


def slice_copy(params: Any, shardings: Any, mesh: Mesh) -> Any:
    """ZeRO++ hpZ: ``params`` constrained to their stored split without :data:`HPZ_AXIS`,
    so XLA gathers each weight over it once (outside the layer loop) and the layers'
    gathers, forward and backward, run over the in-slice axes alone; the transpose
    reduce-scatters the gradients over it once. Leaves not split over it pass as they are.
    """
    def one(x, sh):
        spec = sh.spec
        if not any(HPZ_AXIS in entry_axes(e) for e in spec):
            return x
        local = _without(spec, x.ndim, (HPZ_AXIS,))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, local))

    return jax.tree.map(one, params, shardings)


def check_hpz(plan: Any, param_shardings: Any) -> None:
    """Refuse, in one line, hpZ where no weight is split over :data:`HPZ_AXIS`."""
    split = any(HPZ_AXIS in entry_axes(e) for sh in jax.tree.leaves(
        param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding)) for e in sh.spec)
    if not split:
        raise JaxparError("plan.hpz keeps an in-slice copy of weights split across slices, "
                          "but no weight is split over the data axis: use plan.zero_stage=3 "
                          "(or rules that put weights on data) with mesh data >= 2")
