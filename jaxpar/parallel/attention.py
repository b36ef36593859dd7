"""Causal self-attention implementations behind one call, chosen by ``model.attention``.

``xla``: ``jax.nn.dot_product_attention`` with XLA's own lowering (scores materialised,
``seq x seq`` per head). ``cudnn``: the same call with cuDNN's fused flash kernel (NVIDIA
GPUs, bf16/fp16). ``chunked``: blockwise attention in plain JAX for any backend: keys and
values are visited ``block`` at a time with an online softmax (running max and sum), and
the backward pass (a ``custom_vjp``) recomputes each block's probabilities from the saved
log-sum-exp instead of storing them, so memory grows with ``seq x block`` rather than
``seq x seq``. ``splash``: the Pallas TPU splash-attention kernel (block-sparse flash
attention that skips the blocks the causal or window mask hides), in tiles of ``block``
rounded to a multiple of 128; under a plan it runs per shard inside ``shard_map``, split
over batch and heads as the activation rules say (sequence and head_dim must not be split).
Off TPU it runs in Pallas interpret mode: exact but slow, for tests. ``auto`` picks splash
on a TPU, cuDNN on a GPU for half precision, else ``xla``.

All take queries ``(batch, seq, heads, head_dim)`` and keys/values ``(batch, seq,
kv_heads, head_dim)`` (grouped-query attention when ``kv_heads < heads``) and an optional
sliding ``window`` (a query sees itself and the ``window - 1`` keys before it), and
optional document ``segments`` ``(batch, seq)`` for packed sequences: a query sees only the
keys of its own segment (same id), so documents packed into one row never attend to each
other (``xla``, ``chunked`` and ``splash``; ``cudnn`` refuses them).

``softcap`` > 0 caps the scaled scores smoothly, ``softcap * tanh(scores / softcap)``,
before the mask and softmax (Gemma 2's attention logit soft-capping): ``xla`` then computes
attention explicitly in plain JAX (``jax.nn.dot_product_attention`` has no cap), ``chunked``
caps each block in its forward and backward passes, ``splash`` uses the kernel's own cap,
and ``cudnn`` refuses it (``auto`` does not pick cuDNN for a capped model).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.errors import JaxparError
from jaxpar.sharding.plan import current_plan
from jaxpar.sharding.rules import entry_axes

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "chunked", "splash")
DEFAULT_BLOCK = 512
"""Keys and values per block of the chunked implementation (and the splash tile)."""
SPLASH_TILE = 128
"""Splash attention's tiles along the sequence are multiples of this (TPU lanes)."""
Q_NAMES = ("batch", "seq", "heads", "head_dim")
KV_NAMES = ("batch", "seq", "kv_heads", "head_dim")


def document_positions(segments: jax.Array) -> jax.Array:
    """Each token's position inside its own document: ``(batch, seq)`` segment ids (runs
    of one id per document) -> ``(batch, seq)`` positions counting from 0 at every
    document's first token (RoPE's positions for packed rows)."""
    index = jnp.arange(segments.shape[-1])
    first = jnp.concatenate([jnp.ones_like(segments[..., :1], bool),
                             segments[..., 1:] != segments[..., :-1]], axis=-1)
    return index - jax.lax.cummax(jnp.where(first, index, 0), axis=segments.ndim - 1)


def target_platform() -> str:
    """The platform the program being traced is for: the active plan's devices' (a TPU
    slice compiled for from this host, say), else JAX's default backend."""
    plan = current_plan()
    if plan is not None:
        return plan.mesh.devices.flat[0].platform
    return jax.default_backend()


CUDNN_HEAD_DIMS = 128
"""The largest head dimension cuDNN's fused attention takes through JAX (a multiple of 8):
Gemma 3's 256 is refused as the step is traced."""


def cudnn_takes(head_dim: int = 0, softcap: float = 0.0) -> bool:
    """Whether cuDNN's fused attention runs heads of ``head_dim`` (0: not known) with a
    logit ``softcap`` (it takes none)."""
    return not softcap and (not head_dim or (head_dim <= CUDNN_HEAD_DIMS and head_dim % 8 == 0))


def resolve(implementation: str, dtype: jnp.dtype, softcap: float = 0.0,
            head_dim: int = 0) -> str:
    """The concrete implementation ``auto`` stands for on this backend and dtype (never
    ``cudnn`` where :func:`cudnn_takes` says no: a ``softcap``, or heads wider than
    :data:`CUDNN_HEAD_DIMS`)."""
    if implementation not in IMPLEMENTATIONS:
        raise JaxparError(f"model.attention={implementation!r}: choose one of "
                          f"{list(IMPLEMENTATIONS)}")
    if implementation != "auto":
        return implementation
    backend = target_platform()
    if backend == "tpu":
        return "splash"
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if backend == "gpu" and half and cudnn_takes(head_dim, softcap) else "xla"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "auto",
              window: int = 0, block: int = DEFAULT_BLOCK,
              segments: jax.Array | None = None, softcap: float = 0.0) -> jax.Array:
    """Causal attention ``softmax(q k^T / sqrt(head_dim)) v`` by the chosen implementation;
    with ``segments`` ``(batch, seq)``, within each segment only; with ``softcap`` > 0, the
    scaled scores capped to ``softcap * tanh(scores / softcap)`` before the softmax."""
    softcap = _check_softcap(softcap)
    kind = resolve(implementation, q.dtype, softcap, q.shape[-1])
    if kind == "chunked":
        return chunked_attention(q, k, v, window=window, block=block, segments=segments,
                                 softcap=softcap)
    if kind == "splash":
        return splash_attention(q, k, v, window=window, block=block, segments=segments,
                                softcap=softcap)
    if kind == "cudnn" and segments is not None:
        raise JaxparError("model.attention='cudnn' does not take document masks (packed "
                          "sequences, data.eos_id): use model.attention=xla or chunked")
    if kind == "cudnn" and softcap:
        raise JaxparError(f"model.attention='cudnn' does not take model.attn_logit_softcap="
                          f"{softcap} (cuDNN's kernel has no logit cap): use "
                          "model.attention=xla, chunked or splash")
    if softcap:
        return explicit_attention(q, k, v, window=window, segments=segments, softcap=softcap)
    local = (window - 1, 0) if window else None
    mask = None if segments is None else (
        segments[:, None, :, None] == segments[:, None, None, :])  # (b, 1, q, k)
    if kind == "xla" and q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA:CPU lacks the f16 x f16 -> f32 dot that attention's backward pass needs.
        f32 = lambda t: t.astype(jnp.float32)
        out = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), mask=mask,
                                           is_causal=True, local_window_size=local)
        return out.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                        local_window_size=local, implementation=kind)


def _check_softcap(softcap: float) -> float:
    """``softcap`` as a float, refused when negative."""
    softcap = float(softcap)
    if softcap < 0:
        raise JaxparError(f"attention softcap={softcap}: must be 0 (off) or positive")
    return softcap


def soft_cap(scores: jax.Array, softcap: float) -> jax.Array:
    """``softcap * tanh(scores / softcap)``, or ``scores`` unchanged when ``softcap`` is 0
    (Gemma 2's attention scores and final logits)."""
    return softcap * jnp.tanh(scores / softcap) if softcap else scores


def explicit_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int = 0,
                       segments: jax.Array | None = None, softcap: float = 0.0
                       ) -> jax.Array:
    """Causal attention written out in plain JAX: grouped scores ``(batch, kv_heads, group,
    seq, seq)`` in float32, scaled by ``1 / sqrt(head_dim)``, capped by ``softcap`` (when
    positive), masked (causal, ``window``, ``segments``), softmax, times the values. What
    ``xla`` runs with a soft cap; it materialises every score, as XLA's lowering does."""
    b, s, n, h = q.shape
    kvh = k.shape[2]
    if n % kvh:
        raise JaxparError(f"{n} query heads do not group over {kvh} kv heads")
    qg = q.reshape(b, s, kvh, n // kvh, h).astype(jnp.float32) * h ** -0.5
    scores = soft_cap(jnp.einsum("bqkgh,bckh->bkgqc", qg, k.astype(jnp.float32)), softcap)
    keep = _mask(0, s, s, window, segments, segments)  # (batch or 1, q, keys)
    scores = jnp.where(keep[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqc,bckh->bqkgh", probs, v.astype(jnp.float32))
    return out.reshape(b, s, n, h).astype(q.dtype)


# --- chunked (blockwise, online softmax) --------------------------------------------------
def _blocks(x: jax.Array, block: int) -> jax.Array:
    """``(b, s, k, h)`` -> ``(s_padded / block, b, block, k, h)``, zero-padded."""
    b, s, kv, h = x.shape
    pad = -s % block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return x.reshape(b, (s + pad) // block, block, kv, h).swapaxes(0, 1)


def _mask(j: jax.Array, s: int, block: int, window: int, seg: jax.Array | None = None,
          seg_j: jax.Array | None = None) -> jax.Array:
    """``(batch or 1, s, block)``: whether query i may see key ``j * block + c`` (causal,
    window, and with segments ``seg`` ``(b, s)`` and the block's ``seg_j`` ``(b, block)``,
    the same segment)."""
    q_pos = jnp.arange(s)[:, None]
    k_pos = j * block + jnp.arange(block)[None, :]
    keep = k_pos <= q_pos
    if window:
        keep &= k_pos > q_pos - window
    keep = keep[None]
    if seg is not None:
        keep = keep & (seg[:, :, None] == seg_j[:, None, :])
    return keep


def _scores(qg: jax.Array, kj: jax.Array, keep: jax.Array, softcap: float = 0.0
            ) -> tuple[jax.Array, jax.Array | None]:
    """One key block's masked (and, with ``softcap``, capped) scores ``(b, s, kv, g,
    block)``, and the cap's derivative ``1 - tanh(scores / softcap)^2`` with respect to
    the uncapped scores (None without a cap)."""
    s = jnp.einsum("bskgh,bckh->bskgc", qg, kj.astype(jnp.float32))
    slope = None
    if softcap:
        t = jnp.tanh(s / softcap)
        s, slope = softcap * t, 1.0 - t * t
    return jnp.where(keep[:, :, None, None, :], s, -jnp.inf), slope


def _segment_blocks(seg: jax.Array | None, block: int) -> jax.Array | None:
    """``(b, s)`` segment ids -> ``(s_padded / block, b, block)`` (padding: id -1)."""
    if seg is None:
        return None
    b, s = seg.shape
    pad = -s % block
    if pad:
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
    return seg.reshape(b, (s + pad) // block, block).swapaxes(0, 1)


def _forward(q, k, v, seg, window, block, softcap):
    b, s, n, h = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, s, kvh, n // kvh, h).astype(jnp.float32) * h ** -0.5

    def body(carry, xs):
        o, m, total = carry
        kj, vj, j, seg_j = xs
        sc, _ = _scores(qg, kj, _mask(j, s, block, window, seg, seg_j), softcap)
        m_new = jnp.maximum(m, sc.max(-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing seen yet
        p = jnp.exp(sc - shift[..., None])
        corr = jnp.exp(m - shift)
        total = total * corr + p.sum(-1)
        o = o * corr[..., None] + jnp.einsum("bskgc,bckh->bskgh", p, vj.astype(jnp.float32))
        return (o, m_new, total), None

    kb, vb = _blocks(k, block), _blocks(v, block)
    init = (jnp.zeros(qg.shape, jnp.float32),
            jnp.full(qg.shape[:-1], -jnp.inf, jnp.float32),
            jnp.zeros(qg.shape[:-1], jnp.float32))
    (o, m, total), _ = jax.lax.scan(body, init, (kb, vb, jnp.arange(kb.shape[0]),
                                                 _segment_blocks(seg, block)))
    o = o / total[..., None]
    lse = m + jnp.log(total)
    return o.reshape(b, s, n, h).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked(q, k, v, seg, window, block, softcap):
    return _forward(q, k, v, seg, window, block, softcap)[0]


def _chunked_fwd(q, k, v, seg, window, block, softcap):
    out, lse = _forward(q, k, v, seg, window, block, softcap)
    return out, (q, k, v, seg, out, lse)


def _chunked_bwd(window, block, softcap, residuals, d_out):
    q, k, v, seg, out, lse = residuals
    b, s, n, h = q.shape
    kvh = k.shape[2]
    g = n // kvh
    scale = h ** -0.5
    qg = q.reshape(b, s, kvh, g, h).astype(jnp.float32) * scale
    do = d_out.reshape(b, s, kvh, g, h).astype(jnp.float32)
    delta = jnp.sum(do * out.reshape(b, s, kvh, g, h).astype(jnp.float32), -1)

    def body(dq, xs):
        kj, vj, j, seg_j = xs
        sc, slope = _scores(qg, kj, _mask(j, s, block, window, seg, seg_j), softcap)
        p = jnp.exp(sc - lse[..., None])
        dv = jnp.einsum("bskgc,bskgh->bckh", p, do)
        dp = jnp.einsum("bskgh,bckh->bskgc", do, vj.astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        if slope is not None:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2
            ds = ds * slope
        dq = dq + jnp.einsum("bskgc,bckh->bskgh", ds, kj.astype(jnp.float32))
        dk = jnp.einsum("bskgc,bskgh->bckh", ds, qg)
        return dq, (dk, dv)

    kb, vb = _blocks(k, block), _blocks(v, block)
    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(qg.shape, jnp.float32),
                                (kb, vb, jnp.arange(kb.shape[0]),
                                 _segment_blocks(seg, block)))

    def unblock(x, like):  # (blocks, b, block, k, h) -> (b, s, k, h)
        x = x.swapaxes(0, 1).reshape(b, -1, kvh, h)[:, :s]
        return x.astype(like.dtype)

    return ((dq * scale).reshape(b, s, n, h).astype(q.dtype), unblock(dk, k), unblock(dv, v),
            None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int = 0,
                      block: int = DEFAULT_BLOCK, segments: jax.Array | None = None,
                      softcap: float = 0.0) -> jax.Array:
    """Causal attention computed ``block`` keys at a time with an online softmax; its
    gradient recomputes each block from the saved log-sum-exp (memory O(seq x block));
    with ``segments`` ``(batch, seq)``, within each segment only; with ``softcap`` > 0,
    scores capped to ``softcap * tanh(scores / softcap)`` (in both passes)."""
    if q.shape[2] % k.shape[2]:
        raise JaxparError(f"{q.shape[2]} query heads do not group over {k.shape[2]} kv heads")
    return _chunked(q, k, v, segments, int(window), int(min(block, k.shape[1])),
                    _check_softcap(softcap))


# --- splash (Pallas TPU kernel, shard_map over batch and heads) ---------------------------
def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int = 0,
                     block: int = DEFAULT_BLOCK, interpret: bool | None = None,
                     segments: jax.Array | None = None, softcap: float = 0.0) -> jax.Array:
    """Causal attention by the Pallas splash-attention kernel.

    The sequence is zero-padded to a multiple of 128 (padded keys lie after every real
    query, so the causal mask hides them; padded queries are dropped) and tiled by the
    largest multiple of 128 up to ``block`` that divides it. Each example runs the kernel
    on ``(heads, seq, head_dim)`` (``jax.vmap`` over the batch); grouped-query attention
    is the kernel's own (query head ``i`` reads kv head ``i // (heads / kv_heads)``).

    Under an active plan the kernel runs inside ``jax.shard_map`` over the plan's mesh,
    each device on its own batch and head slice, as ``plan.act_spec`` lays out
    ``("batch", "seq", "heads", "head_dim")`` (and ``kv_heads`` for keys and values); a
    plan that splits the sequence or head_dim is an error. If the kv heads are not split
    like the query heads (too few to divide), they are repeated until they are.

    ``interpret``: run the kernel in Pallas interpret mode; default: when the program is
    not for a TPU (:func:`target_platform`). ``segments`` ``(batch, seq)``: the kernel's
    own segment ids (a query sees the keys of its segment only). ``softcap`` > 0: the
    kernel's own logit cap, ``softcap * tanh(scores / softcap)`` on the scaled scores.
    """
    n, kvh = q.shape[2], k.shape[2]
    if n % kvh:
        raise JaxparError(f"{n} query heads do not group over {kvh} kv heads")
    if interpret is None:
        interpret = target_platform() != "tpu"
    local = functools.partial(_splash_local, window=int(window), block=int(block),
                              interpret=bool(interpret), softcap=_check_softcap(softcap))
    plan = current_plan()
    if segments is None:
        segments = jnp.zeros(q.shape[:2], jnp.int32)
    if plan is None:
        return local(q, k, v, segments)
    qspec = plan.act_spec(Q_NAMES, shape=q.shape, path="attention queries")
    kspec = plan.act_spec(KV_NAMES, shape=k.shape, path="attention keys")
    for spec, what in ((qspec, "queries"), (kspec, "keys and values")):
        split = [f"{name} over {spec[d]}" for d, name in ((1, "seq"), (3, "head_dim"))
                 if spec[d] is not None]
        if split:
            raise JaxparError(
                f"model.attention='splash' cannot split attention {what} along "
                f"{' and '.join(split)}: the kernel needs whole sequences and whole heads "
                "on each device; map 'seq' and 'head_dim' to no mesh axes in the activation "
                "rules, or choose another model.attention")
    batch, heads = qspec[0], qspec[2]
    if kspec[2] != heads:  # kv heads split differently: repeat until they split alike
        k, v = _repeat_kv(k, v, n, _axes_size(plan.mesh, heads))
    spec = PartitionSpec(batch, None, heads, None)
    q, k, v = (plan.place(x, plan.sharding(spec)) for x in (q, k, v))  # explicit meshes
    rows = PartitionSpec(batch, None)
    segments = plan.place(segments.astype(jnp.int32), plan.sharding(rows))
    # check_vma=False: the kernel's pallas_call does not declare how its outputs vary.
    shard = plan.shard_map(local, in_specs=(spec, spec, spec, rows), out_specs=spec,
                           check_vma=False)
    return shard(q, k, v, segments)


def _axes_size(mesh, entry) -> int:
    return math.prod(mesh.shape[a] for a in entry_axes(entry))


def _repeat_kv(k: jax.Array, v: jax.Array, n: int, shards: int):
    """Repeat each kv head ``r`` times, ``r`` the least divisor of the group size that
    makes the kv heads divisible by ``shards``; query head ``i`` still reads its own kv
    head (now number ``i // (group / r)``)."""
    kvh = k.shape[2]
    group = n // kvh
    r = next(r for r in range(1, group + 1) if group % r == 0 and (kvh * r) % shards == 0)
    return jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)


def splash_tile(padded: int, block: int) -> int:
    """The largest multiple of 128 that is at most ``max(block, 128)`` and divides
    ``padded`` (itself a multiple of 128)."""
    units = padded // SPLASH_TILE
    most = max(block // SPLASH_TILE, 1)
    return SPLASH_TILE * max(d for d in range(1, min(units, most) + 1) if units % d == 0)


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, padded: int, window: int, tile: int, interpret: bool,
                   softcap: float = 0.0):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if window:
        mask = sa.LocalMask((padded, padded), window_size=(window - 1, 0), offset=0)
    else:
        mask = sa.CausalMask((padded, padded))
    sizes = sa.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile,
                          block_q_dkv=tile, block_kv_dkv=tile, block_kv_dkv_compute=tile,
                          block_q_dq=tile, block_kv_dq=tile)
    with jax.ensure_compile_time_eval():  # the mask tables are constants, even mid-trace
        return sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret,
                                  attn_logits_soft_cap=softcap or None)


def _splash_local(q, k, v, segments, *, window: int, block: int, interpret: bool,
                  softcap: float = 0.0):
    """Splash attention on (this device's) ``(batch, seq, heads, head_dim)`` arrays and
    ``(batch, seq)`` segment ids."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    s, n, h = q.shape[1:]
    padded = -(-s // SPLASH_TILE) * SPLASH_TILE
    kernel = _splash_kernel(n, padded, window, splash_tile(padded, block), interpret,
                            softcap)

    def heads_major(x):  # (b, s, k, h) -> (b, k, padded, h)
        return jnp.pad(x, ((0, 0), (0, padded - s), (0, 0), (0, 0))).swapaxes(1, 2)

    seg = jnp.pad(segments, ((0, 0), (0, padded - s)), constant_values=-1)
    q = q * jnp.asarray(h ** -0.5, q.dtype)
    out = jax.vmap(lambda q, k, v, g: kernel(q, k, v, segment_ids=SegmentIds(g, g)))(
        heads_major(q), heads_major(k), heads_major(v), seg)
    return out.swapaxes(1, 2)[:, :s]
