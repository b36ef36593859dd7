"""Context-parallel attention on the splash kernel: each device runs the Pallas TPU kernel
on its own queries, against the gathered keys (``allgather``) or one visiting key block per
ring step (``ring``).

The kernel's mask is static (block-sparse tables built on the host), but under context
parallelism what a device may see depends on which part of the sequence it holds. Splash
supports exactly this: a kernel built for ``q_seq_shards = c`` holds the tables of every
query shard, and passed to ``shard_map`` split along the query sequence
(``manual_sharding_spec``) each device receives the rows of its own queries. The masks here
are written in the sequence's *layout* order with each token's true position, so the
balanced layout (:func:`jaxpar.parallel.context.balanced_order`) keeps its load balance:
the kernel skips every tile no query of it may see, on every device.

``allgather``
  Keys, values and their document ids are all-gathered over the context axis; one kernel
  call per example attends the device's ``seq / c`` queries to all ``seq`` keys. The
  gradient is the kernel's own; the all-gather's transpose reduce-scatters the key and
  value gradients.

``ring``
  ``c`` kernel calls, one per key block as it travels round the axis (``ppermute``), each
  with the mask of that block against this device's queries; the block results are merged
  by their log-sum-exps. The backward pass (a ``custom_vjp``) sends the blocks round again
  and runs the kernel's backward on each with the *merged* log-sum-exp and output (the
  flash-attention identity: a block's probabilities are ``exp(scores - lse)`` with the
  whole row's ``lse``), passing each block's key and value gradients along with it until
  they are back with their owner.

Queries are scaled by ``1 / sqrt(head_dim)`` before the kernel; ``softcap`` is the
kernel's ``attn_logits_soft_cap`` (``cap * tanh(scores / cap)``). Each device's share of
the sequence must be a multiple of 128 (the kernel's tiles).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.errors import JaxparError
from jaxpar.parallel.attention import SPLASH_TILE, splash_tile
from jaxpar.parallel.context_blocks import send_round
from jaxpar.sharding.rules import entry_axes


def _splash():
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )
    return kernel, masks


def _mask_class():
    _, masks = _splash()

    class ShardedPositionsMask(masks.Mask):
        """Causal (optionally windowed) visibility between tokens at given positions.

        ``q_pos`` ``(q_len,)``: the true position of each query row; the rows are split
        into ``len(k_pos)`` equal shards, and the rows of shard ``i`` are matched against
        the keys at positions ``k_pos[i]`` (``(shards, kv_len)``). A key is visible to a
        query at or after it, and (``window > 0``) less than ``window`` positions back.
        """

        def __init__(self, q_pos: np.ndarray, k_pos: np.ndarray, window: int):
            self.q_pos = np.asarray(q_pos, np.int64)
            self.k_pos = np.asarray(k_pos, np.int64)
            self.window = int(window)
            self._rows = len(self.q_pos) // len(self.k_pos)
            self._key = (self.q_pos.tobytes(), self.k_pos.tobytes(), self.k_pos.shape,
                         self.window)

        @property
        def shape(self) -> tuple[int, int]:
            return len(self.q_pos), self.k_pos.shape[1]

        def __getitem__(self, idx) -> np.ndarray:
            q = self.q_pos[idx[0]][:, None]
            keys = self.k_pos[:, idx[1]]
            shards = np.arange(self.shape[0])[idx[0]] // self._rows
            # A tile of rows lies in one shard: one row of key positions serves it.
            k = keys[shards[0]][None] if shards[0] == shards[-1] else keys[shards]
            keep = k <= q
            if self.window:
                keep &= k > q - self.window
            return keep

        def __eq__(self, other: object) -> bool:
            return isinstance(other, type(self)) and self._key == other._key

        def __hash__(self) -> int:
            return hash(self._key)

    return ShardedPositionsMask


@functools.lru_cache(maxsize=32)
def _kernels(key: tuple, heads: int, window: int, tile: int, softcap: float,
             interpret: bool, kind: str, shards: int) -> tuple:
    """The splash kernels of one layout: one (allgather) or one per ring step, each built
    for ``shards`` query shards. ``key``: ``(positions bytes, length)``."""
    kernel_lib, masks = _splash()
    positions = np.frombuffer(key[0], np.int64)
    local = len(positions) // shards
    mask_class = _mask_class()
    if kind == "allgather":
        layouts = [positions[None]]
    else:  # step t: device i holds the block of device (i - t) % shards
        by_device = positions.reshape(shards, local)
        layouts = [by_device[(np.arange(shards) - t) % shards] for t in range(shards)]
    sizes = kernel_lib.BlockSizes(
        block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile,
        block_kv_dkv=tile, block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile)
    built = []
    with jax.ensure_compile_time_eval():  # the mask tables are constants, even mid-trace
        for k_pos in layouts:
            mask = masks.MultiHeadMask([mask_class(positions, k_pos, window)] * heads)
            options = dict(block_sizes=sizes, interpret=interpret,
                           save_residuals=kind == "ring", attn_logits_soft_cap=softcap or None)
            kernel = None
            if all(_sees_something(q, k_pos[i], window)
                   for i, q in enumerate(positions.reshape(len(k_pos), -1))):
                try:
                    kernel = kernel_lib.make_splash_mha(
                        mask, head_shards=1, q_seq_shards=shards, **options)
                except ValueError:  # no partially masked tile in any shard (jax 0.10)
                    kernel = None
            # A shard that sees nothing of this block fails the grid shrinking too.
            built.append(kernel or _unshrunk_kernel(mask, shards, **options))
    return tuple(built)


def _sees_something(q_pos: np.ndarray, k_pos: np.ndarray, window: int) -> bool:
    """Whether any query at ``q_pos`` may see any key at ``k_pos``."""
    keys = np.sort(k_pos)
    upto = np.searchsorted(keys, q_pos, side="right")
    after = np.searchsorted(keys, q_pos - window, side="right") if window else 0
    return bool(np.any(upto > after))


def _unshrunk_kernel(mask, shards: int, *, block_sizes, interpret: bool,
                     save_residuals: bool, attn_logits_soft_cap):
    """A splash kernel as ``make_splash_mha`` builds it, without shrinking the grid to the
    visible tiles of each query shard (which needs every shard to see some key)."""
    kernel_lib, _ = _splash()
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask_info as info_lib,
    )

    def process(fn, shape):
        info, function = fn(mask, shape, head_shards=1, q_seq_shards=shards,
                            shrink_grid=False)
        return jax.tree.map(jnp.array, info), function

    sizes = block_sizes
    fwd, function = process(info_lib.process_mask, (sizes.block_q, sizes.block_kv))
    dq, _ = process(info_lib.process_mask, (sizes.block_q_dq, sizes.block_kv_dq))
    dkv, _ = process(info_lib.process_mask_dkv, (sizes.block_q_dkv, sizes.block_kv_dkv))
    return kernel_lib.SplashAttentionKernel(
        fwd, dq, dkv, block_sizes=sizes, is_mqa=False, save_residuals=save_residuals,
        mask_value=kernel_lib.DEFAULT_MASK_VALUE, attn_logits_soft_cap=attn_logits_soft_cap,
        residual_checkpoint_name=None, mask_function=function, interpret=interpret)


def splash_context_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                             positions: np.ndarray, segments: jax.Array, *, mesh: Mesh,
                             q_spec: PartitionSpec, kv_spec: PartitionSpec, kind: str,
                             axis: str, window: int = 0, softcap: float = 0.0,
                             block: int = 512, interpret: bool = False) -> jax.Array:
    """Causal attention with the sequence split over ``axis``, by the splash kernel.

    Arguments as :func:`jaxpar.parallel.context.context_attention` (whose checks they
    have passed: kv heads split like query heads, the sequence over ``axis`` only), with
    ``positions`` concrete (NumPy: the kernel's masks are built from them on the host).

    Raises:
      JaxparError: when a device's share of the sequence is not a multiple of 128.
    """
    b, s, n, h = q.shape
    c = mesh.shape[axis]
    if s % (c * SPLASH_TILE):
        raise JaxparError(
            f"model.attention='splash' under context parallelism needs each device's share "
            f"of the sequence to be a multiple of {SPLASH_TILE}: seq={s} over {axis}={c} "
            f"gives {s / c:g}; use a sequence length divisible by {c * SPLASH_TILE}, or "
            "model.attention=xla (plain blocks)")
    head_ways = int(np.prod([mesh.shape[a] for a in entry_axes(q_spec[2])]))
    tile = splash_tile(s // c, block)
    key = (np.asarray(positions, np.int64).tobytes(), s)
    kernels = _kernels(key, n // head_ways, int(window), tile, float(softcap),
                       bool(interpret), kind, c)
    kernel_specs = tuple(kr.manual_sharding_spec(NamedSharding(mesh, PartitionSpec(None, axis)))
                         for kr in kernels)
    seg_spec = PartitionSpec(q_spec[0], q_spec[1])
    scale = jnp.asarray(h ** -0.5, q.dtype)
    if kind == "allgather":
        local = functools.partial(_allgather_local, axis=axis)
        kernels_arg: tuple | object = kernels[0]
        kernels_spec: tuple | object = kernel_specs[0]
    else:
        local = functools.partial(_ring_local, axis=axis, size=c)
        kernels_arg, kernels_spec = kernels, kernel_specs
    shard = jax.shard_map(local, mesh=mesh,
                          in_specs=(q_spec, kv_spec, kv_spec, seg_spec, kernels_spec),
                          out_specs=q_spec, check_vma=False)
    return shard(q * scale, k, v, segments.astype(jnp.int32), kernels_arg)


def _heads_major(x: jax.Array) -> jax.Array:
    """``(b, s, heads, h)`` <-> ``(b, heads, s, h)``."""
    return x.swapaxes(1, 2)


def _segment_ids(q_seg: jax.Array, kv_seg: jax.Array):
    kernel_lib, _ = _splash()
    return kernel_lib.SegmentIds(q_seg, kv_seg)


def _allgather_local(q, k, v, seg, kernel, *, axis: str):
    """This device's queries against the whole gathered sequence, one kernel call."""
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    k, v, kv_seg = gather(k, axis=1), gather(v, axis=1), gather(seg, axis=1)
    out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=_segment_ids(qs, ks)))(
        _heads_major(q), _heads_major(k), _heads_major(v), seg, kv_seg)
    return _heads_major(out)


def _ring_local(q, k, v, seg, kernels, *, axis: str, size: int):
    out = _ring(_heads_major(q), _heads_major(k), _heads_major(v), seg, kernels, axis, size)
    return _heads_major(out)


def _ring_forward(q, k, v, seg, kernels, axis, size):
    """Merged output ``(b, n, s, h)`` (q's dtype) and log-sum-exp ``(b, n, s)`` (f32)."""
    out = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)
    kv = [k, v, seg]
    for t, kernel in enumerate(kernels):
        block_out, (block_lse,) = jax.vmap(
            lambda q, k, v, qs, ks, kernel=kernel: kernel(
                q, k, v, segment_ids=_segment_ids(qs, ks)))(q, *kv[:2], seg, kv[2])
        merged = jnp.logaddexp(lse, block_lse)
        finite = jnp.isfinite(merged)
        keep_old = jnp.where(finite, jnp.exp(lse - jnp.where(finite, merged, 0.0)), 0.0)
        seen = jnp.isfinite(block_lse)  # rows of a block that sees nothing: -inf, NaN out
        take = jnp.where(seen, jnp.exp(block_lse - jnp.where(finite, merged, 0.0)), 0.0)
        block_out = jnp.where(seen[..., None], block_out.astype(jnp.float32), 0.0)
        out = out * keep_old[..., None] + block_out * take[..., None]
        lse = merged
        if t < size - 1:
            kv = send_round(kv, axis, size)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, seg, kernels, axis, size):
    return _ring_forward(q, k, v, seg, kernels, axis, size)[0]


def _ring_fwd(q, k, v, seg, kernels, axis, size):
    out, lse = _ring_forward(q, k, v, seg, kernels, axis, size)
    return out, (q, k, v, seg, kernels, out, lse)


def _block_backward(kernel, q, k, v, q_seg, kv_seg, out, lse, d_out):
    """The kernel's own backward on one key block, with the whole row's ``out`` and
    ``lse``: ``(dq, dk, dv)`` of this block's share."""
    kernel_lib, _ = _splash()

    def collapse(info):  # as the kernel's own entry point lays out partial mask blocks
        if info is None or info.partial_mask_blocks is None:
            return info
        blocks = info.partial_mask_blocks
        return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))

    kw = kernel.kwargs
    residuals = (q, k, v, _segment_ids(q_seg, kv_seg), None, out, lse,
                 collapse(kernel.dq_mask_info), collapse(kernel.dkv_mask_info))
    grads = kernel_lib._splash_attention_bwd(
        False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"],
        kw["residual_checkpoint_name"], kw["mask_function"], kw["attn_logits_soft_cap"],
        kw["interpret"], residuals, d_out)
    return grads[3], grads[4], grads[5]


def _ring_bwd(axis, size, residuals, d_out):
    q, k, v, seg, kernels, out, lse = residuals
    f32 = jnp.float32
    dq = jnp.zeros(q.shape, f32)
    kv = [k, v, seg]
    dk, dv = jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    for t, kernel in enumerate(kernels):
        gq, gk, gv = jax.vmap(functools.partial(_block_backward, kernel))(
            q, kv[0], kv[1], seg, kv[2], out, lse, d_out)
        dq, dk, dv = dq + gq.astype(f32), dk + gk.astype(f32), dv + gv.astype(f32)
        # The block's gradients travel with it; after the last step one more send brings
        # them home (device i then holds the block of device i + 1 - size = i + 1).
        if t < size - 1:
            *kv, dk, dv = send_round([*kv, dk, dv], axis, size)
        else:
            dk, dv = send_round([dk, dv], axis, size)
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), kernels)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            np.zeros(seg.shape, jax.dtypes.float0), zeros)


_ring.defvjp(_ring_fwd, _ring_bwd)
