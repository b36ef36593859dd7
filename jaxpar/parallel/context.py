"""Context parallelism: exact causal attention with the sequence split over a mesh axis.

Under context parallelism every activation's sequence dimension is split over the
``context`` mesh axis, ``c`` ways. Everything but attention is position-wise and needs no
communication; attention must let each query see keys held by other devices. Two ways are
offered by :func:`context_attention`:

``allgather``
  Each device all-gathers the keys and values (and their positions) of the whole sequence
  over the axis, then attends its own ``seq / c`` queries to all of them in one go. One
  collective per layer (a reduce-scatter of the key/value gradients going back), simple,
  and fast when the gathered keys and values are small next to the rest of the layer (few
  kv heads, moderate sequences). Queries, outputs and the MLP stay at ``seq / c`` per
  device, but keys, values and the ``seq / c x seq`` scores are full length.

``ring``
  Key/value blocks travel round the axis: ``c - 1`` times each device passes its current
  block (with its positions) to the next device with ``ppermute`` and merges the block it
  holds into an online softmax (running max and sum, as flash attention does). The same
  total bytes move as with the all-gather, but in ``c - 1`` steps that XLA can overlap
  with the block computations, and no device ever holds more than two ``seq / c`` blocks
  of keys and values or more than ``(seq / c)^2`` scores at once. Each step is
  rematerialised in the backward pass, so training keeps one block of keys and values
  per step, not its scores.

Both are exact: the positional mask is applied to true token positions, passed in
alongside the arrays, so the sequence may be laid out in any order.

Load balancing. With a causal mask, the ring skips (via ``lax.cond``) each half-block pair
in which no key is visible to any query. In the contiguous layout device ``i`` holds
positions ``[i s/c, (i+1) s/c)`` and sees the blocks of devices ``0..i`` only, so device
``c - 1`` does about ``c`` times the work of device 0 (``c`` visible blocks against one;
``4c - 1`` half-block pairs against 3), and every ring step waits for the busiest device.
:func:`balanced_order` lays the sequence out in ``2c`` chunks with device ``i`` holding
chunks ``i`` and ``2c - 1 - i`` (one early, one late), which gives every device the same
number of visible chunk pairs, ``2c + 1``, and so equal work. Permute tokens (and
targets) by the order once at the input, pass ``positions=order``, and everything
downstream is unchanged. The all-gather kind computes every score whatever the mask, so
its work is balanced in either layout.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxpar.errors import JaxparError
from jaxpar.parallel import attention as attention_lib
from jaxpar.parallel.context_blocks import block_context_attention
from jaxpar.parallel.context_splash import splash_context_attention
from jaxpar.sharding.plan import CONTEXT_ATTENTION
from jaxpar.sharding.rules import entry_axes

KINDS = CONTEXT_ATTENTION
"""The context-attention implementations :func:`context_attention` offers."""

_Partial = tuple[jax.Array, jax.Array, jax.Array]  # unnormalised output, running max, sum


def balanced_order(seq_len: int, context: int) -> np.ndarray:
    """The sequence order that balances causal attention work over ``context`` devices.

    The sequence is cut into ``2 * context`` equal chunks; device ``i`` gets chunks ``i``
    and ``2 * context - 1 - i``, so in device order the chunks are ``0, 2c-1, 1, 2c-2, ...``.
    Returns ``order`` (int32, length ``seq_len``) with ``x_balanced = x[:, order]``;
    the position of each balanced index is ``order`` itself, and :func:`inverse_order`
    (``np.argsort(order)``) undoes it.

    Raises:
      JaxparError: when ``seq_len`` is not a multiple of ``2 * context``.
    """
    if context < 1:
        raise JaxparError(f"context must be at least 1, got {context}")
    if seq_len % (2 * context):
        raise JaxparError(
            f"balanced context layout needs seq_len divisible by 2 x context = {2 * context}; "
            f"got seq_len={seq_len}, context={context}: pad the sequence or turn balancing off")
    chunk = seq_len // (2 * context)
    chunks = [c for i in range(context) for c in (i, 2 * context - 1 - i)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks]
                          ).astype(np.int32)


def inverse_order(order: np.ndarray) -> np.ndarray:
    """The permutation undoing ``order``: ``x_balanced[:, inverse_order(order)] == x``."""
    return np.argsort(np.asarray(order)).astype(np.int32)


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *,
                      mesh: Mesh, q_spec: PartitionSpec, kv_spec: PartitionSpec,
                      kind: str = "allgather", window: int = 0, axis: str = "context",
                      segments: jax.Array | None = None, softcap: float = 0.0,
                      implementation: str = "xla", block: int = 512) -> jax.Array:
    """Causal attention with the sequence split over mesh axis ``axis``.

    Args:
      q: queries ``(batch, seq, heads, head_dim)``.
      k, v: keys and values ``(batch, seq, kv_heads, head_dim)``; ``heads`` must be a
        multiple of ``kv_heads`` (grouped-query attention).
      positions: int ``(seq,)``, the true position of each sequence index (``arange`` for
        the natural layout, :func:`balanced_order` for the balanced one).
      mesh: the device mesh; the computation runs in ``jax.shard_map`` over all of it.
      q_spec, kv_spec: how ``q`` and ``k``/``v`` are laid out over ``mesh``. Batch and
        heads may be split over any axes, the sequence over ``axis`` only, head_dim not
        at all. If the kv heads are split differently from the query heads (too few to
        divide the tensor axis), they are repeated to ``heads`` first.
      kind: ``"allgather"`` or ``"ring"`` (see the module docstring).
      implementation: ``"splash"``: each device's share by the Pallas TPU kernel
        (:mod:`jaxpar.parallel.context_splash`; interpret mode when the program is not
        for a TPU), in tiles of ``block`` rounded to 128; needs concrete ``positions`` and
        the sequence split over ``axis``. ``"cudnn"``: cuDNN's fused kernel on each pair
        of sequence chunks (:mod:`jaxpar.parallel.context_blocks`; no window, documents or
        soft-capping). Anything else: the plain-JAX blocks below.
      window: if positive, a query at position ``p`` sees only keys in
        ``(p - window, p]``; otherwise every key at or before ``p``.
      axis: the mesh axis the sequence is split over.
      segments: int ``(batch, seq)``, each token's document in a packed row: a query sees
        only keys of its own document (gathered or passed round the ring with the keys).
      softcap: if positive, the scaled scores are capped to ``softcap * tanh(scores /
        softcap)`` before the mask and softmax (Gemma 2's logit soft-capping).

    Returns:
      ``(batch, seq, heads, head_dim)`` in ``q.dtype``, laid out as ``q_spec``. Scores
      are scaled by ``1 / sqrt(head_dim)`` and the softmax is computed in float32.

    Raises:
      JaxparError: for an unknown ``kind``, mismatched shapes, or specs this layout
        cannot run with.
    """
    if kind not in KINDS:
        raise JaxparError(f"context attention kind={kind!r}: choose one of {list(KINDS)}")
    if softcap < 0:
        raise JaxparError(f"context attention softcap={softcap}: must be 0 (off) or positive")
    if axis not in mesh.shape:
        raise JaxparError(f"context axis {axis!r} is not in the mesh {dict(mesh.shape)}")
    b, s, n, h = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, s) or k.shape[3] != h:
        raise JaxparError(f"context attention: keys {k.shape} and values {v.shape} do not "
                          f"match queries {q.shape}")
    kvh = k.shape[2]
    if n % kvh:
        raise JaxparError(f"{n} query heads do not group over {kvh} kv heads")
    given, positions = positions, jnp.asarray(positions)
    if positions.shape != (s,) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise JaxparError(f"positions must be integers shaped ({s},), got "
                          f"{positions.dtype}{tuple(positions.shape)}")
    q_spec, kv_spec = _padded(q_spec), _padded(kv_spec)
    if entry_axes(kv_spec[2]) != entry_axes(q_spec[2]):  # kv heads not split like query heads
        k, v = jnp.repeat(k, n // kvh, axis=2), jnp.repeat(v, n // kvh, axis=2)
        kv_spec = q_spec
    _check_specs(mesh, axis, q_spec, kv_spec, q.shape, k.shape)
    seq_split = entry_axes(q_spec[1]) == (axis,) and mesh.shape[axis] > 1
    if implementation == "splash" and seq_split:
        return _on_splash(q, k, v, given, segments, mesh=mesh, q_spec=q_spec,
                          kv_spec=kv_spec, kind=kind, axis=axis, window=window,
                          softcap=softcap, block=block)
    if implementation == "cudnn" and seq_split:
        unsupported = [what for what, on in (("a sliding window", window),
                                             ("document masks", segments is not None),
                                             ("soft-capping", softcap)) if on]
        if unsupported:
            raise JaxparError(f"model.attention='cudnn' under context parallelism does not "
                              f"take {' or '.join(unsupported)}: use model.attention=xla "
                              "(plain blocks)")
        return block_context_attention(q, k, v, positions, mesh=mesh, q_spec=q_spec,
                                       kv_spec=kv_spec, kind=kind, axis=axis)
    local = functools.partial(
        _allgather_local if kind == "allgather" else _ring_local, window=int(window),
        softcap=float(softcap),
        axis=axis if seq_split else None, size=mesh.shape[axis] if seq_split else 1)
    pos_spec = PartitionSpec(q_spec[1])
    if segments is None:  # one document a row: every key is of the query's document
        segments = jnp.zeros((b, s), jnp.int32)
    elif segments.shape != (b, s):
        raise JaxparError(f"segments must be shaped ({b}, {s}), got {segments.shape}")
    seg_spec = PartitionSpec(q_spec[0], q_spec[1])
    shard = jax.shard_map(local, mesh=mesh,
                          in_specs=(q_spec, kv_spec, kv_spec, pos_spec, seg_spec),
                          out_specs=q_spec, check_vma=False)
    return shard(q, k, v, positions.astype(jnp.int32), segments.astype(jnp.int32))


def _on_splash(q, k, v, positions, segments, **kw) -> jax.Array:
    """:func:`jaxpar.parallel.context_splash.splash_context_attention`, with the positions
    made concrete and interpret mode off a TPU."""
    try:
        positions = np.asarray(positions)
    except jax.errors.TracerArrayConversionError:
        raise JaxparError("model.attention='splash' under context parallelism builds its "
                          "masks from the token positions: pass them as a NumPy array, "
                          "not a traced one") from None
    if segments is None:
        segments = jnp.zeros(q.shape[:2], jnp.int32)
    return splash_context_attention(
        q, k, v, positions, segments,
        interpret=attention_lib.target_platform() != "tpu", **kw)


# --- checks -------------------------------------------------------------------------------
def _padded(spec: PartitionSpec) -> PartitionSpec:
    entries = tuple(spec)
    if len(entries) > 4:
        raise JaxparError(f"attention specs have 4 entries at most, got {spec}")
    return PartitionSpec(*entries, *(None,) * (4 - len(entries)))


def _check_specs(mesh: Mesh, axis: str, q_spec: PartitionSpec, kv_spec: PartitionSpec,
                 q_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> None:
    for spec, shape, what in ((q_spec, q_shape, "queries"), (kv_spec, kv_shape, "keys")):
        if spec[3] is not None:
            raise JaxparError(f"context attention cannot split the head_dim of the {what} "
                              f"(spec {spec})")
        seq = entry_axes(spec[1])
        if seq not in ((), (axis,)):
            raise JaxparError(f"context attention splits the sequence over {axis!r} only; "
                              f"the {what} spec {spec} splits it over {seq}")
        for d, name in ((0, "batch"), (2, "heads")):
            if axis in entry_axes(spec[d]):
                raise JaxparError(f"the {what} spec {spec} splits {name} over the context "
                                  f"axis {axis!r}")
        for d, name in enumerate(("batch", "seq", "heads", "head_dim")):
            ways = math.prod(mesh.shape[a] for a in entry_axes(spec[d]))
            if shape[d] % ways:
                raise JaxparError(f"attention {what}: {name}={shape[d]} does not divide over "
                                  f"{entry_axes(spec[d])} ({ways} ways); spec {spec}")
    for d, name in ((0, "batch"), (1, "seq")):
        if entry_axes(q_spec[d]) != entry_axes(kv_spec[d]):
            raise JaxparError(f"queries and keys must split {name} alike, got {q_spec} and "
                              f"{kv_spec}")


# --- blockwise softmax pieces -------------------------------------------------------------
def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """``(b, s, n, h)`` -> ``(b, s, kv_heads, n / kv_heads, h)``."""
    b, s, n, h = q.shape
    return q.reshape(b, s, kv_heads, n // kv_heads, h)


def _partial(qg: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
             window: int, q_seg: jax.Array, k_seg: jax.Array, softcap: float = 0.0
             ) -> _Partial:
    """One block's unnormalised softmax output, row max and row sum (all float32); keys
    are visible to a query at or before it, within the window, in its document; with
    ``softcap`` > 0 the scaled scores are capped to ``softcap * tanh(scores / softcap)``."""
    scores = jnp.einsum("bqkgh,bckh->bqkgc", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (qg.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    keep = k_pos[None, :] <= q_pos[:, None]
    if window:
        keep &= k_pos[None, :] > q_pos[:, None] - window
    keep = keep[None] & (q_seg[:, :, None] == k_seg[:, None, :])  # (batch, q, keys)
    scores = jnp.where(keep[:, :, None, None, :], scores, -jnp.inf)
    # The result does not depend on the shift, so it needs no gradient.
    top = jax.lax.stop_gradient(scores.max(-1))
    p = jnp.exp(scores - _finite(top)[..., None])
    out = jnp.einsum("bqkgc,bckh->bqkgh", p, v.astype(jnp.float32))
    return out, top, p.sum(-1)


def _finite(top: jax.Array) -> jax.Array:
    """The running max with ``-inf`` (rows that saw nothing yet) replaced by 0."""
    return jnp.where(jnp.isfinite(top), top, 0.0)


def _neutral(qg: jax.Array) -> _Partial:
    """The partial result of a block in which nothing is visible."""
    rows = qg.shape[:-1]
    return (jnp.zeros(qg.shape, jnp.float32), jnp.full(rows, -jnp.inf, jnp.float32),
            jnp.zeros(rows, jnp.float32))


def _merge(a: _Partial, b: _Partial) -> _Partial:
    """Combine two partial softmax results over disjoint key sets."""
    top = jnp.maximum(a[1], b[1])
    shift = _finite(top)
    ca, cb = jnp.exp(a[1] - shift), jnp.exp(b[1] - shift)
    return a[0] * ca[..., None] + b[0] * cb[..., None], top, a[2] * ca + b[2] * cb


def _finish(acc: _Partial, dtype) -> jax.Array:
    out = acc[0] / acc[2][..., None]
    b, s, kvh, g, h = out.shape
    return out.reshape(b, s, kvh * g, h).astype(dtype)


# --- per-device computations (inside shard_map) -------------------------------------------
def _allgather_local(q, k, v, pos, seg, *, window: int, axis: str | None, size: int,
                     softcap: float = 0.0):
    """Local queries against the whole gathered sequence of keys and values."""
    k_pos, k_seg = pos, seg
    if axis is not None:
        gather = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
        k, v, k_pos = gather(k, axis=1), gather(v, axis=1), gather(pos, axis=0)
        k_seg = gather(seg, axis=1)
    return _finish(_partial(_grouped(q, k.shape[2]), k, v, pos, k_pos, window, seg, k_seg,
                            softcap), q.dtype)


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """Whether any key of a block may be visible to any query (conservative)."""
    seen = q_pos.max() >= k_pos.min()
    if window:
        seen &= q_pos.min() - window < k_pos.max()
    return seen


def _masked_partial(qg, k, v, q_pos, k_pos, window: int, q_seg, k_seg,
                    softcap: float = 0.0) -> _Partial:
    """:func:`_partial`, or the neutral result without computing when nothing is visible."""
    return jax.lax.cond(_visible(q_pos, k_pos, window),
                        lambda: _partial(qg, k, v, q_pos, k_pos, window, q_seg, k_seg,
                                         softcap),
                        lambda: _neutral(qg))


def _halves(x: jax.Array, axis: int) -> list[jax.Array]:
    """Two halves along ``axis`` (one piece if its length is odd)."""
    return jnp.split(x, 2, axis=axis) if x.shape[axis] % 2 == 0 else [x]


def _ring_local(q, k, v, pos, seg, *, window: int, axis: str | None, size: int,
                softcap: float = 0.0):
    """Local queries against key/value blocks passed round the ring (with their positions
    and documents), merged online."""
    qg = _grouped(q, k.shape[2])
    q_parts = list(zip(_halves(qg, 1), _halves(pos, 0), _halves(seg, 1), strict=True))

    @jax.checkpoint  # the backward pass recomputes each step's scores, never stores them
    def absorb(accs, k, v, k_pos, k_seg):
        """Merge one key/value block into each query half's running result."""
        kv_parts = list(zip(_halves(k, 1), _halves(v, 1), _halves(k_pos, 0),
                            _halves(k_seg, 1), strict=True))
        return [functools.reduce(
                    _merge, [_masked_partial(qh, kh, vh, qp, kp, window, qs, ks, softcap)
                             for kh, vh, kp, ks in kv_parts], acc)
                for acc, (qh, qp, qs) in zip(accs, q_parts, strict=True)]

    accs = [_neutral(qh) for qh, _, _ in q_parts]
    if axis is not None and size > 1:
        ring = [(i, (i + 1) % size) for i in range(size)]

        def step(carry, _):
            accs, k, v, k_pos, k_seg = carry
            # Send the current block on first, so the transfer can overlap the compute.
            nxt = [jax.lax.ppermute(x, axis, ring) for x in (k, v, k_pos, k_seg)]
            return (absorb(accs, k, v, k_pos, k_seg), *nxt), None

        (accs, k, v, pos_kv, seg_kv), _ = jax.lax.scan(step, (accs, k, v, pos, seg),
                                                       length=size - 1)
    else:
        pos_kv, seg_kv = pos, seg
    accs = absorb(accs, k, v, pos_kv, seg_kv)
    return jnp.concatenate([_finish(acc, q.dtype) for acc in accs], axis=1)
