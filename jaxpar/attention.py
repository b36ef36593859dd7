"""Causal self-attention implementations behind one call, chosen by ``model.attention``.

``xla``: ``jax.nn.dot_product_attention`` with XLA's own lowering (scores materialised,
``seq x seq`` per head). ``cudnn``: the same call with cuDNN's fused flash kernel (NVIDIA
GPUs, bf16/fp16). ``chunked``: blockwise attention in plain JAX for any backend: keys and
values are visited ``block`` at a time with an online softmax (running max and sum), and
the backward pass (a ``custom_vjp``) recomputes each block's probabilities from the saved
log-sum-exp instead of storing them, so memory grows with ``seq x block`` rather than
``seq x seq``. ``auto`` picks cuDNN on a GPU for half precision, else ``xla``.

All take queries ``(batch, seq, heads, head_dim)`` and keys/values ``(batch, seq,
kv_heads, head_dim)`` (grouped-query attention when ``kv_heads < heads``) and an optional
sliding ``window`` (a query sees itself and the ``window - 1`` keys before it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.errors import JaxparError

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "chunked")
DEFAULT_BLOCK = 512
"""Keys and values per block of the chunked implementation."""


def resolve(implementation: str, dtype: jnp.dtype) -> str:
    """The concrete implementation ``auto`` stands for on this backend and dtype."""
    if implementation not in IMPLEMENTATIONS:
        raise JaxparError(f"model.attention={implementation!r}: choose one of "
                          f"{list(IMPLEMENTATIONS)}")
    if implementation != "auto":
        return implementation
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if jax.default_backend() == "gpu" and half else "xla"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "auto",
              window: int = 0, block: int = DEFAULT_BLOCK) -> jax.Array:
    """Causal attention ``softmax(q k^T / sqrt(head_dim)) v`` by the chosen implementation."""
    kind = resolve(implementation, q.dtype)
    if kind == "chunked":
        return chunked_attention(q, k, v, window=window, block=block)
    local = (window - 1, 0) if window else None
    if kind == "xla" and q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA:CPU lacks the f16 x f16 -> f32 dot that attention's backward pass needs.
        f32 = lambda t: t.astype(jnp.float32)
        out = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True,
                                           local_window_size=local)
        return out.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                        implementation=kind)


# --- chunked (blockwise, online softmax) --------------------------------------------------
def _blocks(x: jax.Array, block: int) -> jax.Array:
    """``(b, s, k, h)`` -> ``(s_padded / block, b, block, k, h)``, zero-padded."""
    b, s, kv, h = x.shape
    pad = -s % block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return x.reshape(b, (s + pad) // block, block, kv, h).swapaxes(0, 1)


def _mask(j: jax.Array, s: int, block: int, window: int) -> jax.Array:
    """``(s, block)``: whether query i may see key ``j * block + c`` (causal, window)."""
    q_pos = jnp.arange(s)[:, None]
    k_pos = j * block + jnp.arange(block)[None, :]
    keep = k_pos <= q_pos
    if window:
        keep &= k_pos > q_pos - window
    return keep


def _scores(qg: jax.Array, kj: jax.Array, keep: jax.Array) -> jax.Array:
    s = jnp.einsum("bskgh,bckh->bskgc", qg, kj.astype(jnp.float32))
    return jnp.where(keep[None, :, None, None, :], s, -jnp.inf)


def _forward(q, k, v, window, block):
    b, s, n, h = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, s, kvh, n // kvh, h).astype(jnp.float32) * h ** -0.5

    def body(carry, xs):
        o, m, total = carry
        kj, vj, j = xs
        sc = _scores(qg, kj, _mask(j, s, block, window))
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
    (o, m, total), _ = jax.lax.scan(body, init, (kb, vb, jnp.arange(kb.shape[0])))
    o = o / total[..., None]
    lse = m + jnp.log(total)
    return o.reshape(b, s, n, h).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(q, k, v, window, block):
    return _forward(q, k, v, window, block)[0]


def _chunked_fwd(q, k, v, window, block):
    out, lse = _forward(q, k, v, window, block)
    return out, (q, k, v, out, lse)


def _chunked_bwd(window, block, residuals, d_out):
    q, k, v, out, lse = residuals
    b, s, n, h = q.shape
    kvh = k.shape[2]
    g = n // kvh
    scale = h ** -0.5
    qg = q.reshape(b, s, kvh, g, h).astype(jnp.float32) * scale
    do = d_out.reshape(b, s, kvh, g, h).astype(jnp.float32)
    delta = jnp.sum(do * out.reshape(b, s, kvh, g, h).astype(jnp.float32), -1)

    def body(dq, xs):
        kj, vj, j = xs
        p = jnp.exp(_scores(qg, kj, _mask(j, s, block, window)) - lse[..., None])
        dv = jnp.einsum("bskgc,bskgh->bckh", p, do)
        dp = jnp.einsum("bskgh,bckh->bskgc", do, vj.astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        dq = dq + jnp.einsum("bskgc,bckh->bskgh", ds, kj.astype(jnp.float32))
        dk = jnp.einsum("bskgc,bskgh->bckh", ds, qg)
        return dq, (dk, dv)

    kb, vb = _blocks(k, block), _blocks(v, block)
    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(qg.shape, jnp.float32),
                                (kb, vb, jnp.arange(kb.shape[0])))

    def unblock(x, like):  # (blocks, b, block, k, h) -> (b, s, k, h)
        x = x.swapaxes(0, 1).reshape(b, -1, kvh, h)[:, :s]
        return x.astype(like.dtype)

    return ((dq * scale).reshape(b, s, n, h).astype(q.dtype), unblock(dk, k), unblock(dv, v))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int = 0,
                      block: int = DEFAULT_BLOCK) -> jax.Array:
    """Causal attention computed ``block`` keys at a time with an online softmax; its
    gradient recomputes each block from the saved log-sum-exp (memory O(seq x block))."""
    if q.shape[2] % k.shape[2]:
        raise JaxparError(f"{q.shape[2]} query heads do not group over {k.shape[2]} kv heads")
    return _chunked(q, k, v, int(window), int(min(block, k.shape[1])))
