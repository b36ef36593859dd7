"""The optimizer update of offloaded state, streamed through device memory slab by slab.

With the optimizer state in host memory (ZeRO-Offload, :mod:`jaxpar.parallel.offload`)
and the update on the device, bringing the whole state down at once would need as much
device memory as keeping it there. Instead the update runs in loops over *slabs*: one
layer (``plan.update_chunk`` layers) of every tensor stacked over ``layers`` at a time,
large tensors outside the stack cut along an unsplit dimension into pieces no bigger than
that, and the small remainder in one go. Each iteration brings its slab's master weights
and moments to the device, updates them, writes the new working weights into the device
copy and sends the state back into the host buffers it came from (in place), so the
device holds about two slabs of optimizer state at once (the one being updated and the
next one arriving) whatever the model's size.

This is exact only for an optimizer whose update treats every element on its own, given
scalars (step count, learning rate, a global gradient norm): Adam, AdamW, SGD, Lion. The
global norm that clipping needs is computed once over all gradients and handed to the
optimizer as the extra argument ``global_norm`` (jaxpar's
:func:`~jaxpar.training.optimizer.clip_by_global_norm` takes it). :func:`is_elementwise`
checks an optimizer on a tiny copy of the model's tree; one that mixes tensors (optax's
own global-norm clipping, Adafactor's factored moments) gets the whole-state update.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from jaxpar.sharding.annotations import logical_names

Update = Callable[[Any, Any, Any], tuple[Any, Any, Any]]
"""``(grads, opt_state, master) -> (new master, new opt_state, new working weights)`` on
trees of one slab (the leaves outside the slab empty)."""


@dataclasses.dataclass(frozen=True)
class Slab:
    """One loop of the streamed update: ``count`` iterations, each taking ``rows[k]``
    consecutive entries along dimension ``axes[k]`` of the master leaf ``leaves[k]`` (and of
    its moments). ``count`` 1 with whole leaves is the remainder, updated in one go."""

    leaves: tuple[int, ...]
    axes: tuple[int, ...]
    rows: tuple[int, ...]
    count: int


def plan_slabs(master: Any, shardings: Any, on_host: list[bool], layers_per_slab: int = 1
               ) -> list[Slab]:
    """The loops that update ``master`` (an ``nnx.State`` or any tree of arrays or shapes,
    sharded by the tree ``shardings``) when the leaves ``on_host`` marks live in host
    memory: one over the layer stack (``layers_per_slab`` layers an iteration), then, the
    largest first, one per tensor outside it (in pieces no larger than a layer's slab)
    until what remains is no larger than that either, the remainder last, whole."""
    variables = jax.tree.leaves(master, is_leaf=lambda x: isinstance(x, nnx.Variable))
    leaves = jax.tree.leaves(master)
    placed = _shardings(shardings)
    specs = [s.spec for s in placed]
    stacked: dict[int, list[int]] = {}
    for j, (var, x) in enumerate(zip(variables, leaves, strict=True)):
        names = logical_names(var) if isinstance(var, nnx.Variable) else None
        if on_host[j] and names and names[0] == "layers" and x.ndim and _unsplit(specs[j], 0):
            stacked.setdefault(x.shape[0], []).append(j)
    slabs, grouped = [], set()
    layer_bytes = 0.0
    for n_layers, members in stacked.items():
        per = max(d for d in range(1, min(layers_per_slab, n_layers) + 1) if n_layers % d == 0)
        slabs.append(Slab(tuple(members), (0,) * len(members), (per,) * len(members),
                          n_layers // per))
        grouped.update(members)
        layer_bytes = max(layer_bytes, sum(_local_bytes(leaves[j], placed[j]) * per / n_layers
                                           for j in members))
    loose = [j for j, x in enumerate(leaves) if j not in grouped and on_host[j] and x.ndim]
    sizes = {j: _local_bytes(leaves[j], placed[j]) for j in loose}
    target = layer_bytes or sum(sizes.values()) / 8
    left = sum(sizes.values())
    for j in sorted(loose, key=lambda j: -sizes[j]):  # the largest alone until the rest fits
        if left <= target:
            break
        x, left = leaves[j], left - sizes[j]
        axis = next((a for a in range(x.ndim) if x.shape[a] > 1 and _unsplit(specs[j], a)),
                    None)
        if axis is None:
            continue
        pieces = next((d for d in range(math.ceil(sizes[j] / target), x.shape[axis] + 1)
                       if x.shape[axis] % d == 0), x.shape[axis])
        slabs.append(Slab((j,), (axis,), (x.shape[axis] // pieces,), pieces))
        grouped.add(j)
    rest = tuple(j for j, x in enumerate(leaves) if j not in grouped)
    slabs.append(Slab(rest, tuple(0 for _ in rest),
                      tuple(x.shape[0] if x.ndim else 0 for x in (leaves[j] for j in rest)), 1))
    return slabs


def slab_bytes(slabs: list[Slab], master: Any, shardings: Any) -> float:
    """Master bytes (per device) of the largest iteration of ``slabs``: multiply by the
    optimizer state's bytes per master byte for what one iteration brings down."""
    leaves, placed = jax.tree.leaves(master), _shardings(shardings)
    return max((sum(_local_bytes(leaves[j], placed[j]) * (r / leaves[j].shape[a]
                                                          if leaves[j].ndim else 1)
                    for j, a, r in zip(s.leaves, s.axes, s.rows, strict=True))
                for s in slabs), default=0.0)


def _unsplit(spec: Any, axis: int) -> bool:
    entries = tuple(spec) if spec is not None else ()
    return axis >= len(entries) or entries[axis] is None


def _shardings(tree: Any) -> list[NamedSharding]:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def _local_bytes(x: Any, sharding: NamedSharding) -> float:
    """Bytes of one device's shard of ``x``."""
    return float(math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize)


def state_owners(optimizer: Any, opt_state: Any, master: Any) -> list[int]:
    """For each leaf of ``opt_state``, the index of the ``master`` leaf it mirrors (a
    moment of that tensor, same shape), or -1 (a step count, or state not shaped like its
    tensor)."""
    leaves = jax.tree.leaves(master)
    index = jax.tree.unflatten(jax.tree.structure(master), list(range(len(leaves))))
    owners = optax.tree_map_params(
        optimizer, lambda s, j: j if jnp.shape(s) == jnp.shape(leaves[j]) else -1,
        opt_state, index, transform_non_params=lambda v: jax.tree.map(lambda _: -1, v))
    return jax.tree.leaves(owners)


def streamed_update(update: Update, grads: Any, opt_state: Any, master: Any, params: Any,
                    *, owners: list[int], slabs: list[Slab],
                    space: jax.memory.Space = jax.memory.Space.Device
                    ) -> tuple[Any, Any, Any]:
    """Inside a traced step: ``update`` applied slab by slab (see :func:`plan_slabs`),
    returning (new master, new optimizer state, new working weights). Leaves of
    ``master`` and ``opt_state`` in host memory stay there (each slab is written back in
    place); ``params`` (the working weights in device memory, or None when they are the
    master weights) receives each slab's new working copy. ``owners`` is
    :func:`state_owners`' answer.

    ``space`` is where the slabs are updated: device memory, or host memory, where
    ``update`` must then run on the host (:func:`jaxpar.parallel.offload.on_host`): then
    only the gradients go down and the new working weights come up, a slab at a time."""
    move = functools.partial(_to_space, space=space)
    g_leaves, g_def = jax.tree.flatten(grads)
    m_leaves, m_def = jax.tree.flatten(master)
    s_leaves, s_def = jax.tree.flatten(opt_state)
    p_leaves = jax.tree.leaves(params) if params is not None else None
    old_scalars = [x for x, o in zip(s_leaves, owners, strict=True) if o < 0]

    def run(slab: Slab, carry: tuple, i: jax.Array) -> tuple:
        ms, ss, ps, _ = carry
        where = dict(zip(slab.leaves, zip(slab.axes, slab.rows, strict=True), strict=True))

        def view(x: jax.Array, j: int) -> jax.Array:
            if not x.ndim:
                return move(x)
            if j not in where:  # outside this slab: an empty stand-in, same rank
                return move(jnp.zeros((0,) + x.shape[1:], x.dtype))
            axis, rows = where[j]
            if rows == x.shape[axis]:
                return move(x)
            return move(jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis))

        it = iter(old_scalars)
        new_m, new_s, new_p = update(
            jax.tree.unflatten(g_def, [view(g, j) for j, g in enumerate(g_leaves)]),
            jax.tree.unflatten(s_def, [view(s, o) if o >= 0 else move(next(it))
                                       for s, o in zip(ss, owners, strict=True)]),
            jax.tree.unflatten(m_def, [view(m, j) for j, m in enumerate(ms)]))
        new_m, new_s, new_p = jax.tree.leaves(new_m), jax.tree.leaves(new_s), \
            jax.tree.leaves(new_p)

        def put(old: jax.Array, new: jax.Array, j: int) -> jax.Array:
            if j not in where:
                return old
            new = jax.device_put(new, jax.typeof(old).memory_space)
            axis, rows = where[j]
            if not old.ndim or rows == old.shape[axis]:
                return new
            return jax.lax.dynamic_update_slice_in_dim(old, new, i * rows, axis)

        ms = [put(o, n, j) for j, (o, n) in enumerate(zip(ms, new_m, strict=True))]
        ss = [put(o, n, k) if k >= 0 else o
              for o, n, k in zip(ss, new_s, owners, strict=True)]
        if ps is not None:
            ps = [put(o, n, j) for j, (o, n) in enumerate(zip(ps, new_p, strict=True))]
        scalars = [_to_space(n, jax.typeof(old).memory_space) for n, old in zip(
            (n for n, o in zip(new_s, owners, strict=True) if o < 0), old_scalars, strict=True)]
        return ms, ss, ps, scalars

    carry = (m_leaves, s_leaves, p_leaves, old_scalars)
    for slab in slabs:
        if slab.count == 1:
            carry = run(slab, carry, jnp.zeros((), jnp.int32))
        else:
            carry = jax.lax.fori_loop(0, slab.count, lambda i, c, s=slab: run(s, c, i), carry)
    ms, ss, ps, scalars = carry
    it = iter(scalars)
    ss = [next(it) if o < 0 else x for x, o in zip(ss, owners, strict=True)]
    new_params = jax.tree.unflatten(jax.tree.structure(params), ps) if ps is not None else None
    return jax.tree.unflatten(m_def, ms), jax.tree.unflatten(s_def, ss), new_params


def _to_space(x: jax.Array, space: jax.memory.Space) -> jax.Array:
    if jax.typeof(x).memory_space == space:
        return x
    return jax.device_put(x, space)


def is_elementwise(optimizer: optax.GradientTransformation, master: Any) -> bool:
    """Whether ``optimizer`` gives the same update streamed slab by slab as whole, tried
    on the host's CPU with a copy of ``master``'s tree (arrays or shapes) at most two
    entries a dimension, gradients large enough to be clipped: False for an optimizer
    that mixes tensors (a global norm it computes itself, factored moments)."""
    rng = np.random.default_rng(0)

    def tiny(x: Any, scale: float) -> np.ndarray:
        shape = tuple(min(d, 2) for d in x.shape)
        return np.asarray(scale * rng.standard_normal(shape), dtype=x.dtype)

    optimizer = optax.with_extra_args_support(optimizer)
    with jax.default_device(jax.devices("cpu")[0]):
        m = jax.tree.map(lambda x: tiny(x, 1.0), master)
        g = jax.tree.map(lambda x: tiny(x, 100.0), master)
        s = optimizer.init(m)
        norm = optax.tree.norm(g)

        def update(g, s, m):
            updates, s = optimizer.update(g, s, m, global_norm=norm)
            m = optax.apply_updates(m, updates)
            return m, s, m

        leaves = jax.tree.leaves(m)
        split = tuple(j for j, x in enumerate(leaves) if x.ndim and x.shape[0] == 2)
        rest = tuple(j for j in range(len(leaves)) if j not in split)
        # One loop over the first and second rows of every leaf that has two, then the
        # rest whole: each iteration traces the update of the whole tree, so a loop per
        # leaf would grow the program with the square of the leaves (48 leaves: 12 s).
        slabs = [Slab(split, (0,) * len(split), (1,) * len(split), 2)] if split else []
        slabs.append(Slab(rest, (0,) * len(rest),
                          tuple(leaves[j].shape[0] if leaves[j].ndim else 0 for j in rest), 1))
        owners = state_owners(optimizer, s, m)
        want = jax.jit(update)(g, s, m)[:2]
        got = jax.jit(lambda g, s, m: streamed_update(update, g, s, m, None, owners=owners,
                                                      slabs=slabs))(g, s, m)[:2]
    return all(np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                           rtol=1e-5, atol=1e-7)
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
