"""Context-parallel attention from a fused kernel called per pair of sequence chunks:
cuDNN's flash attention on GPUs, or a plain-JAX kernel of the same interface (the
reference the driver is tested with on CPU).

Under context parallelism each device holds ``seq / c`` tokens, as two equal halves (the
balanced layout's two chunks, or the two halves of a contiguous block). Each half is a run
of consecutive positions, so a query half and a key half of equal length are in one of
three relations, read from their first positions: the keys all precede the queries (every
key visible: the kernel without a mask), they are the same positions (the kernel's causal
mask), or the keys all follow (nothing visible: skipped). The driver picks one with
``lax.switch`` for every pair, merges the partial results by their log-sum-exps, and
needs nothing of the kernel but:

- ``forward(q, k, v, causal) -> (out, lse)``: ``(b, s, n, h)`` outputs normalised within
  the block, and their f32 log-sum-exp ``(b, n, s)`` of the scaled scores;
- ``backward(q, k, v, out, lse, d_out, causal) -> (dq, dk, dv)``: the kernel's backward
  pass run with the *whole row's* ``out`` and ``lse`` (the flash-attention identity: a
  block's probabilities are ``exp(scores - lse)`` with the row's ``lse``).

``ring`` passes the key/value blocks round the context axis (``ppermute``), and in the
backward pass passes each block's f32 key/value gradients along with it until they are
home; ``allgather`` gathers the keys and values once and reduce-scatters their gradients.
Grouped-query attention is the kernel's own (``kv_heads`` dividing ``heads``). Windows,
packed documents and soft-capping are not offered here (cuDNN's window is relative to a
block's own diagonal); :func:`jaxpar.parallel.context.context_attention` runs them as plain
blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxpar.errors import JaxparError


class BlockKernel(NamedTuple):
    """A fused attention kernel called on one (query chunk, key chunk) pair."""

    forward: Callable
    backward: Callable


# --- the reference kernel (plain JAX) -----------------------------------------------------
def _scores(q, k, causal: bool):
    n, kv = q.shape[2], k.shape[2]
    k = jnp.repeat(k, n // kv, axis=2)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k, preferred_element_type=jnp.float32)
    s = s * (q.shape[-1] ** -0.5)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return s


def _reference_forward(q, k, v, causal: bool):
    s = _scores(q, k, causal)
    lse = jax.nn.logsumexp(s, axis=-1)
    v = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
    out = jnp.einsum("bnqk,bknh->bqnh", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
    return out.astype(q.dtype), lse


def _reference_backward(q, k, v, out, lse, d_out, causal: bool):
    n, kv = q.shape[2], k.shape[2]
    p = jnp.exp(_scores(q, k, causal) - lse[..., None])  # (b, n, q, k)
    do = d_out.astype(jnp.float32)
    vr = jnp.repeat(v, n // kv, axis=2).astype(jnp.float32)
    di = jnp.einsum("bqnh,bqnh->bnq", do, out.astype(jnp.float32))
    ds = p * (jnp.einsum("bqnh,bknh->bnqk", do, vr) - di[..., None]) * (q.shape[-1] ** -0.5)
    kr = jnp.repeat(k, n // kv, axis=2).astype(jnp.float32)
    dq = jnp.einsum("bnqk,bknh->bqnh", ds, kr)
    fold = lambda x: x.reshape(*x.shape[:2], kv, n // kv, x.shape[-1]).sum(3)
    dk = fold(jnp.einsum("bnqk,bqnh->bknh", ds, q.astype(jnp.float32)))
    dv = fold(jnp.einsum("bnqk,bqnh->bknh", p, do))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


REFERENCE = BlockKernel(_reference_forward, _reference_backward)
"""The plain-JAX kernel: what cuDNN's computes, written out (tests the driver on CPU)."""


# --- cuDNN's fused attention --------------------------------------------------------------
def _cudnn():
    from jax._src.cudnn import fused_attention_stablehlo as fused

    return fused


def _cudnn_forward(q, k, v, causal: bool):
    fused = _cudnn()
    mask = fused.MaskType.CAUSAL if causal else fused.MaskType.NO_MASK
    out, lse = fused.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5,
                                           mask_type=mask, return_residual=True)
    return out, lse.astype(jnp.float32)


def _cudnn_backward(q, k, v, out, lse, d_out, causal: bool):
    fused = _cudnn()
    unused = jnp.zeros(0, q.dtype)
    mask = fused.MaskType.CAUSAL if causal else fused.MaskType.NO_MASK
    grads = fused._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, unused, unused, unused, unused, unused, unused, lse, out,
        d_out.astype(q.dtype), scale=q.shape[-1] ** -0.5, seed=42, dropout_rate=0.0,
        variadic_args=(False, False), mask_type=mask,
        layout=fused.AttentionLayout.BTNH.value, sliding_window_length=None)
    return grads[0], grads[1], grads[2]


CUDNN = BlockKernel(_cudnn_forward, _cudnn_backward)
"""cuDNN's fused flash attention (NVIDIA GPUs, bf16/fp16), forward with its log-sum-exp
and backward from a given one."""


# --- the driver ---------------------------------------------------------------------------
def block_context_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                            *, mesh: Mesh, q_spec: PartitionSpec, kv_spec: PartitionSpec,
                            kind: str, axis: str, kernel: BlockKernel = CUDNN) -> jax.Array:
    """Causal attention with the sequence split over ``axis``, ``kernel`` on chunk pairs.

    Arguments as :func:`jaxpar.parallel.context.context_attention` (whose checks they
    have passed); ``positions`` may be traced.

    Raises:
      JaxparError: when a device's share of the sequence does not halve.
    """
    s, c = q.shape[1], mesh.shape[axis]
    if s % (2 * c):
        raise JaxparError(f"attention on fused kernels under context parallelism cuts each "
                          f"device's share of the sequence in two: seq={s} is not a multiple "
                          f"of 2 x {axis}={c}")
    local = functools.partial(_local, kernel=kernel, axis=axis, size=c,
                              gathered=kind == "allgather")
    shard = jax.shard_map(local, mesh=mesh,
                          in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(q_spec[1])),
                          out_specs=q_spec, check_vma=False)
    return shard(q, k, v, jnp.asarray(positions, jnp.int32))


def _local(q, k, v, pos, *, kernel, axis, size, gathered):
    return _attend(q, k, v, pos, kernel, axis, size, gathered)


def _halves(x: jax.Array, dim: int) -> list[jax.Array]:
    return jnp.split(x, 2, axis=dim)


def _relation(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """0: no key visible, 1: every key visible, 2: the same positions (causal)."""
    return jnp.where(k_pos[0] == q_pos[0], 2, jnp.where(k_pos[0] < q_pos[0], 1, 0))


def _gathered_blocks(k, v, pos, axis: str, size: int) -> list[tuple]:
    """Every device's ``(k, v, positions)`` block, all-gathered over ``axis``."""
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    ks, vs, ps = gather(k, axis=1), gather(v, axis=1), gather(pos, axis=0)
    return [(_slice(ks, i, size, 1), _slice(vs, i, size, 1), _slice(ps, i, size, 0))
            for i in range(size)]


def _slice(x, i: int, size: int, dim: int):
    n = x.shape[dim] // size
    return jax.lax.slice_in_dim(x, i * n, (i + 1) * n, axis=dim)


def send_round(xs, axis: str, size: int) -> list[jax.Array]:
    """Each of ``xs`` passed one device on round the ``axis`` ring (``i`` to ``i + 1``)."""
    ring = [(i, (i + 1) % size) for i in range(size)]
    return [jax.lax.ppermute(x, axis, ring) for x in xs]


def _merge(acc, part):
    """Combine two partial results over disjoint keys: ``(out (b, s, n, h) f32, lse
    (b, n, s))``; a part whose rows saw nothing has ``lse = -inf``."""
    (out, lse), (part_out, part_lse) = acc, part
    top = jnp.logaddexp(lse, part_lse)
    finite = jnp.isfinite(top)
    shift = jnp.where(finite, top, 0.0)
    keep = jnp.where(finite, jnp.exp(lse - shift), 0.0)
    seen = jnp.isfinite(part_lse)
    take = jnp.where(seen, jnp.exp(part_lse - shift), 0.0)
    to_rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # (b, n, s) -> (b, s, n, 1)
    part_out = jnp.where(to_rows(seen), part_out.astype(jnp.float32), 0.0)
    return out * to_rows(keep) + part_out * to_rows(take), top


def _pair_forward(kernel, qh, kh, vh, rel):
    b, s, n, _ = qh.shape
    nothing = lambda: (jnp.zeros(qh.shape, qh.dtype), jnp.full((b, n, s), -jnp.inf))
    return jax.lax.switch(rel, [nothing, lambda: kernel.forward(qh, kh, vh, False),
                                lambda: kernel.forward(qh, kh, vh, True)])


def _pair_backward(kernel, qh, kh, vh, oh, lh, dh, rel):
    nothing = lambda: (jnp.zeros_like(qh), jnp.zeros_like(kh), jnp.zeros_like(vh))
    return jax.lax.switch(rel, [
        nothing, lambda: kernel.backward(qh, kh, vh, oh, lh, dh, False),
        lambda: kernel.backward(qh, kh, vh, oh, lh, dh, True)])


def _forward(q, k, v, pos, kernel, axis, size, gathered):
    """Output ``(b, s, n, h)`` and per-half log-sum-exps."""
    q_halves, q_pos = _halves(q, 1), _halves(pos, 0)
    accs = [(jnp.zeros(qh.shape, jnp.float32),
             jnp.full((qh.shape[0], qh.shape[2], qh.shape[1]), -jnp.inf)) for qh in q_halves]
    gathered_blocks = _gathered_blocks(k, v, pos, axis, size) if gathered else None
    block = (k, v, pos)
    for t in range(size):
        if gathered_blocks is not None:
            block = gathered_blocks[t]
        for kh, vh, kp in zip(_halves(block[0], 1), _halves(block[1], 1),
                              _halves(block[2], 0), strict=True):
            accs = [_merge(acc, _pair_forward(kernel, qh, kh, vh, _relation(qp, kp)))
                    for acc, qh, qp in zip(accs, q_halves, q_pos, strict=True)]
        if gathered_blocks is None and t < size - 1:
            block = tuple(send_round(block, axis, size))
    out = jnp.concatenate([acc[0] for acc in accs], axis=1).astype(q.dtype)
    return out, [acc[1] for acc in accs]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attend(q, k, v, pos, kernel, axis, size, gathered):
    return _forward(q, k, v, pos, kernel, axis, size, gathered)[0]


def _attend_fwd(q, k, v, pos, kernel, axis, size, gathered):
    out, lse = _forward(q, k, v, pos, kernel, axis, size, gathered)
    return out, (q, k, v, pos, out, lse)


def _attend_bwd(kernel, axis, size, gathered, residuals, d_out):
    q, k, v, pos, out, lse = residuals
    f32 = jnp.float32
    q_halves, q_pos = _halves(q, 1), _halves(pos, 0)
    o_halves, d_halves = _halves(out, 1), _halves(d_out, 1)
    dq = [jnp.zeros(qh.shape, f32) for qh in q_halves]

    def visit(block):
        """The block's (dk, dv) halves, accumulating this device's dq on the way."""
        grads = []
        for kh, vh, kp in zip(_halves(block[0], 1), _halves(block[1], 1),
                              _halves(block[2], 0), strict=True):
            dk, dv = jnp.zeros(kh.shape, f32), jnp.zeros(vh.shape, f32)
            for i, (qh, qp) in enumerate(zip(q_halves, q_pos, strict=True)):
                gq, gk, gv = _pair_backward(kernel, qh, kh, vh, o_halves[i], lse[i],
                                            d_halves[i], _relation(qp, kp))
                dq[i] = dq[i] + gq.astype(f32)
                dk, dv = dk + gk.astype(f32), dv + gv.astype(f32)
            grads.append((dk, dv))
        return (jnp.concatenate([g[0] for g in grads], axis=1),
                jnp.concatenate([g[1] for g in grads], axis=1))

    if gathered:
        parts = [visit(b) for b in _gathered_blocks(k, v, pos, axis, size)]
        scatter = functools.partial(jax.lax.psum_scatter, axis_name=axis, scatter_dimension=1,
                                    tiled=True)
        dk = scatter(jnp.concatenate([p[0] for p in parts], axis=1))
        dv = scatter(jnp.concatenate([p[1] for p in parts], axis=1))
    else:
        block = (k, v, pos)
        dk, dv = jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
        for t in range(size):
            gk, gv = visit(block)
            dk, dv = dk + gk, dv + gv
            # The block's gradients travel with it; one more send brings them home.
            if t < size - 1:
                *block, dk, dv = send_round([*block, dk, dv], axis, size)
            else:
                dk, dv = send_round([dk, dv], axis, size)
    dq = jnp.concatenate(dq, axis=1)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            np.zeros(pos.shape, jax.dtypes.float0))


_attend.defvjp(_attend_fwd, _attend_bwd)
