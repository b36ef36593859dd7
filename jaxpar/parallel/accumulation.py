"""Gradient accumulation whose data-parallel reduction runs once a step.

Under GSPMD a gradient-accumulation loop reduces every microbatch's gradients over the
data-parallel axes: the accumulator is laid out like the parameters, whole over ``data``,
so XLA puts the all-reduce inside the loop and a step with ``k`` microbatches moves ``k``
reductions where one would do (PyTorch DDP's ``no_sync`` skips all but the last). Here
the loop runs inside ``jax.shard_map`` over the ``data`` axis alone (the other axes stay
automatic, so FSDP's gathers and reductions and tensor parallelism's collectives are
GSPMD's as before): each device sums the gradients of its own rows of every microbatch,
and one all-reduce after the loop averages the devices' sums.

It applies where that is the same computation: the batch is split over ``data``, no
weight is stored split over it (ZeRO-2 and 3 keep only their shard of the gradient:
summing whole gradients locally would cost them the memory they save), and nothing in
the step depends on which device runs which rows (random draws, running statistics,
state a quantizer carries between steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.pipeline import manual_batch_axes

Grads = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, Any, Any, dict[str, Any]]]
"""``(params, frozen, microbatch, index) -> (loss, grads, frozen, extra)``."""


def local_axes(plan: Any, rows: int, microbatches: int, frozen: Any, *,
               draws_keys: bool = False) -> tuple[str, ...]:
    """The data-parallel axes whose gradient reduction can wait for the end of the
    accumulation loop: ``("data",)`` or ``()``.

    ``frozen``: the model's state that is not trained; accumulation by hand needs it to
    hold weights only (no random-stream counters, batch statistics or quantizer state,
    which differ by the rows a device sees). ``draws_keys``: the loss function takes
    random keys. Never where the step moves the weights or reduces the gradients its own
    way (one-bit compression, ZeRO++, streamed weights), nor on an explicit mesh (its
    shardings do not cross ``shard_map``'s).
    """
    own_way = (plan.offload_params or plan.compress_gradients != "none"
               or "int8" in (plan.quantize_gather, plan.quantize_reduce))
    if (microbatches <= 1 or draws_keys or own_way or plan.zero_stage >= 2
            or plan.explicit):
        return ()
    if any(plan.mesh.shape.get(a, 1) > 1 for a in ("stage", "context", "expert")):
        return ()
    leaves = jax.tree.leaves(frozen, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if any(not isinstance(v, nnx.Param) for v in leaves):
        return ()
    return manual_batch_axes(plan, rows, microbatches)


def accumulate(loss_and_grads: Grads, params: Any, frozen: Any, micro: Any, *,
               mesh: jax.sharding.Mesh, axes: tuple[str, ...] = (),
               reduce_as: Callable[[Any], Any] = lambda grads: grads,
               lay_out: Callable[[Any], Any] = lambda grads: grads
               ) -> tuple[jax.Array, Any, Any, dict[str, Any]]:
    """Mean loss, mean gradients (float32), ``frozen`` after the loop and the mean extra
    metrics over the ``k`` microbatches of ``micro`` (leaves shaped ``(k, rows, ...)``).

    With ``axes`` (:func:`local_axes`), each device sums the gradients of its rows of
    every microbatch and they are reduced over ``axes`` once, after the loop, cast by
    ``reduce_as`` (a function of the gradients' tree: to the compute dtype) for the
    reduction; without, the loop runs under GSPMD, which reduces each microbatch's
    gradients in it. On XLA:CPU they are reduced as summed, in float32: it communicates
    in float32 whatever it is given, and stops on this loop's bf16 all-reduce ("Invalid
    binary instruction opcode copy").

    ``lay_out`` places the running sum (a function of the gradients' tree, applied to
    the zeros it starts from and to each microbatch's gradients before they are added):
    ZeRO-2 and 3 keep only their shard of it, so each microbatch's gradients are
    reduce-scattered into the shard. Left to the compiler, the sum's layout followed
    whatever sharding propagation found (the TPU compiler kept it whole over ``data``
    for some steps and split for others).
    """
    if mesh.devices.flat[0].platform == "cpu":
        reduce_as = lambda grads: grads
    k = jax.tree.leaves(micro)[0].shape[0]

    def loop(params, frozen, micro):
        zeros = lay_out(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

        def step(carry, one):
            total_loss, total, frozen = carry
            index, rows = one
            loss, grads, frozen, extra = loss_and_grads(params, frozen, rows, index)
            grads = lay_out(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
            total = jax.tree.map(jnp.add, total, grads)
            return (total_loss + loss.astype(jnp.float32), total, frozen), extra

        start = (jnp.zeros((), jnp.float32), zeros, frozen)
        (loss, grads, frozen), extras = jax.lax.scan(step, start, (jnp.arange(k), micro))
        extra = jax.tree.map(lambda e: jnp.mean(e, axis=0), extras)
        return loss / k, jax.tree.map(lambda g: g / k, grads), frozen, extra

    if not axes:
        return loop(params, frozen, micro)

    def local(params, frozen, micro):
        # The gradients are taken inside: each device's are of its own rows, summed over
        # the microbatches on the device, and averaged over ``axes`` once, here.
        loss, grads, _, extra = loop(params, frozen, micro)
        mean = lambda tree: jax.tree.map(lambda a: jax.lax.pmean(a, axes), tree)
        # Reduced in the dtypes ``reduce_as`` gives (the compute dtype: as XLA reduces
        # each microbatch's gradients under GSPMD), then on in float32.
        grads = jax.tree.map(lambda g: mean(g).astype(jnp.float32), reduce_as(grads))
        return mean(loss), grads, mean(extra)

    # check_vma=False: the model's own kernels (splash attention's pallas_call, inside a
    # shard_map of its own) do not declare how their outputs vary over ``axes``.
    rows = jax.tree.map(lambda _: P(None, axes), micro)
    loss, grads, extra = jax.shard_map(
        local, mesh=mesh, axis_names=set(axes), in_specs=(P(), P(), rows),
        out_specs=(P(), P(), P()), check_vma=False)(params, frozen, micro)
    return loss, grads, frozen, extra
