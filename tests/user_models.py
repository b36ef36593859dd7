"""Models written the way users write them: plain Flax NNX, no jaxpar calls inside.

Used by tests/sharding/test_user_models.py and by ``model.factory`` configs in tests
(``tests.user_models:llama_like``). Each is a tiny language model: token ids
``(batch, seq)`` -> logits ``(batch, seq, vocab)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx
from jax.sharding import PartitionSpec as P

VOCAB = 64


# --- (a) nnx.MultiHeadAttention + nnx.LinearGeneral + dropout, Flax-legal short specs -----


class MhaBlock(nnx.Module):
    def __init__(self, d: int, heads: int, ff: int, rate: float, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        # One kernel_init with two names for 3-D (embed, heads, head_dim) kernels: legal in
        # Flax and jax.sharding (trailing dimensions unnamed).
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=d, qkv_features=d, decode=False, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("embed", "heads")),
            out_kernel_init=nnx.with_partitioning(init, ("heads",)))
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.LinearGeneral(d, ff, rngs=rngs,
                                    kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
        self.down = nnx.LinearGeneral(ff, d, rngs=rngs,
                                      kernel_init=nnx.with_partitioning(init, ("mlp", "embed")))
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.drop(self.attn(self.norm1(x), mask=mask))
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.norm2(x)))))


class MhaLM(nnx.Module):
    def __init__(self, d: int = 32, heads: int = 4, ff: int = 64, layers: int = 2,
                 rate: float = 0.1, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.5)
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs,
                               embedding_init=nnx.with_partitioning(init, ("vocab", "embed")))
        self.blocks = nnx.List([MhaBlock(d, heads, ff, rate, rngs=rngs) for _ in range(layers)])
        self.head = nnx.LinearGeneral(d, VOCAB, use_bias=False, rngs=rngs, kernel_init=
                                      nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                            ("embed", "vocab")))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


# --- (b) unannotated, unscanned, Llama-like with grouped-query attention ------------------


def _rms(x: jax.Array, w: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w


def _rope(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-jnp.arange(half) / half)
    angles = jnp.arange(x.shape[1])[:, None] * freqs
    sin, cos = jnp.sin(angles)[None, :, None], jnp.cos(angles)[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


class RMSNorm(nnx.Module):
    def __init__(self, d: int):
        self.weight = nnx.Param(jnp.ones((d,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return _rms(x, self.weight[...])


class LlamaAttention(nnx.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, *, rngs: nnx.Rngs):
        hd = d // heads
        self.heads, self.kv_heads = heads, kv_heads
        self.q_proj = nnx.Einsum("bsd,dnh->bsnh", (d, heads, hd), rngs=rngs)
        self.k_proj = nnx.Einsum("bsd,dnh->bsnh", (d, kv_heads, hd), rngs=rngs)
        self.v_proj = nnx.Einsum("bsd,dnh->bsnh", (d, kv_heads, hd), rngs=rngs)
        self.o_proj = nnx.Einsum("bsnh,nhd->bsd", (heads, hd, d), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = _rope(self.q_proj(x)), _rope(self.k_proj(x)), self.v_proj(x)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / jnp.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        return self.o_proj(jnp.einsum("bnqk,bknh->bqnh", probs, v))


class LlamaMLP(nnx.Module):
    def __init__(self, d: int, ff: int, *, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(d, ff, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(d, ff, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(ff, d, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ff: int, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(d)
        self.self_attn = LlamaAttention(d, heads, kv_heads, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d)
        self.mlp = LlamaMLP(d, ff, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLike(nnx.Module):
    def __init__(self, d: int = 64, heads: int = 8, kv_heads: int = 2, ff: int = 128,
                 layers: int = 2, *, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(VOCAB, d, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(1.0))
        self.layers = nnx.List([LlamaDecoderLayer(d, heads, kv_heads, ff, rngs=rngs)
                                for _ in range(layers)])
        self.norm = RMSNorm(d)
        self.lm_head = nnx.Linear(d, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def llama_like(rngs: nnx.Rngs, **sizes: int) -> LlamaLike:
    """A factory as a user's package would export it (``model.factory``)."""
    return LlamaLike(rngs=rngs, **sizes)


LLAMA_ANNOTATIONS = [
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"self_attn/q_proj/kernel$", ("embed", "heads", "head_dim")),
    (r"self_attn/(k|v)_proj/kernel$", ("embed", "kv_heads", "head_dim")),
    (r"self_attn/o_proj/kernel$", ("heads", "head_dim", "embed")),
    (r"mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
]
"""The path rules a user writes for :class:`LlamaLike` (``jaxpar.annotate``)."""


def next_token_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """A user's loss on a dict batch: masked next-token cross-entropy."""
    logits = model(batch["inputs"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    return (nll * batch["mask"]).sum() / batch["mask"].sum()


# --- (c) annotated with mesh-axis names (``tp``), explicit sharding with reshard ----------


class ExplicitLM(nnx.Module):
    """Written for JAX's explicit sharding mode, as Flax's sharding guide does it."""

    def __init__(self, d: int = 32, ff: int = 128, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.3)
        self.embed = nnx.Param(init(rngs.params(), (VOCAB, d)), out_sharding=P(None, "fsdp"))
        self.w_in = nnx.Param(init(rngs.params(), (d, ff)), out_sharding=P("fsdp", "tp"))
        self.w_out = nnx.Param(init(rngs.params(), (ff, d)), out_sharding=P("tp", "fsdp"))
        self.head = nnx.Param(init(rngs.params(), (d, VOCAB)), out_sharding=P("fsdp", None))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        rows = P(("data", "fsdp"), None, None)
        table = jax.sharding.reshard(self.embed[...], P(None, None))
        x = table.at[tokens].get(out_sharding=rows)
        w_in = jax.sharding.reshard(self.w_in[...], P(None, "tensor"))
        h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", x, w_in))
        w_out = jax.sharding.reshard(self.w_out[...], P("tensor", None))
        x = x + jnp.einsum("bsf,fd->bsd", h, w_out, out_sharding=rows)
        head = jax.sharding.reshard(self.head[...], P(None, None))
        return jnp.einsum("bsd,dv->bsv", x, head)


class ExplicitLinearLM(nnx.Module):
    """Explicit sharding with ``nnx.Linear`` layers: kernels sharded at construction, the
    output sharding passed at call time (``out_sharding=``), as bonsai's models do."""

    def __init__(self, d: int = 32, ff: int = 64, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.3)
        self.embed = nnx.Param(init(rngs.params(), (VOCAB, d)), out_sharding=P(None, "fsdp"))
        self.up = nnx.Linear(d, ff, use_bias=False, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, P("fsdp", "tp")))
        self.down = nnx.Linear(ff, d, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, P("tp", "fsdp")))
        self.head = nnx.Param(init(rngs.params(), (d, VOCAB)), out_sharding=P("fsdp", None))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        rows = P(("data", "fsdp"), None, None)
        table = jax.sharding.reshard(self.embed[...], P(None, None))
        x = table.at[tokens].get(out_sharding=rows)
        h = jax.nn.gelu(self.up(x, out_sharding=P(("data", "fsdp"), None, "tensor")))
        x = x + self.down(h, out_sharding=rows)
        head = jax.sharding.reshard(self.head[...], P(None, None))
        return jnp.einsum("bsd,dv->bsv", x, head)


# --- (d) dropout that needs a mode, or RNGs at call time -----------------------------------


class AttentionDropoutLM(nnx.Module):
    """Attention dropout with no ``deterministic`` argument at call time (as bonsai's ViT):
    Flax refuses to run it until the model is put in train or eval mode."""

    def __init__(self, d: int = 32, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=d, dropout_rate=0.3,
                                           decode=False, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        return self.head(x + self.attn(x, mask=nnx.make_causal_mask(tokens)))


class CallTimeRngsLM(nnx.Module):
    """Dropout fed RNGs at call time rather than holding a stream."""

    def __init__(self, d: int = 32, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.mix = nnx.Linear(d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.3)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = self.embed(tokens)
        x = jnp.cumsum(x, axis=1) / jnp.arange(1, tokens.shape[1] + 1)[:, None]
        return self.head(x + self.drop(jax.nn.gelu(self.mix(x)), rngs=rngs))


# --- (e) models the default next-token loss must refuse -----------------------------------


class ShiftsRightLM(nnx.Module):
    """Shifts its inputs right itself, as Flax's lm1b example does: position i sees
    ``tokens[:i]`` and is meant to predict ``tokens[i]``."""

    def __init__(self, d: int = 32, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        shifted = jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]
        x = jnp.cumsum(self.embed(shifted), axis=1)
        return self.head(x / jnp.arange(1, tokens.shape[1] + 1)[:, None])


class BidirectionalLM(nnx.Module):
    """Every position sees the whole sequence (an encoder)."""

    def __init__(self, d: int = 32, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        return self.head(x + x.mean(axis=1, keepdims=True))


# --- (f) Flax linen, written the way linen users write them --------------------------------


class LinenBlock(linen.Module):
    """Pre-norm decoder block with causal self-attention and dropout."""

    d: int
    heads: int
    rate: float = 0.1

    @linen.compact
    def __call__(self, x: jax.Array, mask: jax.Array, deterministic: bool = True) -> jax.Array:
        h = linen.LayerNorm(name="ln_1")(x)
        h = linen.MultiHeadDotProductAttention(
            num_heads=self.heads, dropout_rate=self.rate, deterministic=deterministic,
            name="attn")(h, h, mask=mask)
        x = x + linen.Dropout(self.rate)(h, deterministic=deterministic)
        h = linen.Dense(4 * self.d, name="c_fc")(linen.LayerNorm(name="ln_2")(x))
        h = linen.Dense(self.d, name="c_proj")(linen.gelu(h))
        return x + linen.Dropout(self.rate)(h, deterministic=deterministic)


class LinenGPT(linen.Module):
    """A GPT-2-style decoder: learned positions, tied input and output embeddings."""

    vocab: int = VOCAB
    d: int = 32
    heads: int = 4
    layers: int = 2

    @linen.compact
    def __call__(self, tokens: jax.Array, deterministic: bool = True) -> jax.Array:
        wte = linen.Embed(self.vocab, self.d, name="wte")
        pos = self.param("wpe", linen.initializers.normal(0.02), (64, self.d))
        x = wte(tokens) + pos[: tokens.shape[1]]
        mask = linen.make_causal_mask(tokens)
        for i in range(self.layers):
            x = LinenBlock(self.d, self.heads, name=f"h_{i}")(x, mask, deterministic)
        return wte.attend(linen.LayerNorm(name="ln_f")(x))


GPT_ANNOTATIONS = [
    (r"wte/embedding$", ("vocab", "embed")),
    (r"wpe$", (None, "embed")),
    (r"attn/(query|key|value)/kernel$", ("embed", "heads", "head_dim")),
    (r"attn/out/kernel$", ("heads", "head_dim", "embed")),
    (r"c_fc/kernel$", ("embed", "mlp")),
    (r"c_proj/kernel$", ("mlp", "embed")),
]
"""Names by path for :class:`LinenGPT`, given from outside as a user would."""


class LinenViT(linen.Module):
    """A small vision transformer: patches by a strided convolution, a class token."""

    classes: int = 10
    d: int = 32
    patch: int = 4

    @linen.compact
    def __call__(self, images: jax.Array, train: bool = False) -> jax.Array:
        x = linen.Conv(self.d, (self.patch, self.patch), strides=self.patch,
                       name="patches")(images)
        x = x.reshape(x.shape[0], -1, self.d)
        cls = self.param("cls", linen.initializers.zeros, (1, 1, self.d))
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, self.d)), x], axis=1)
        for i in range(2):
            h = linen.LayerNorm()(x)
            x = x + linen.MultiHeadDotProductAttention(num_heads=4, name=f"attn_{i}")(h, h)
            h = linen.Dense(2 * self.d, name=f"mlp_{i}_in")(linen.LayerNorm()(x))
            h = linen.Dropout(0.2, deterministic=not train)(linen.gelu(h))
            x = x + linen.Dense(self.d, name=f"mlp_{i}_out")(h)
        return linen.Dense(self.classes, name="head")(x[:, 0])


VIT_ANNOTATIONS = [
    (r"attn_\d+/(query|key|value)/kernel$", ("embed", "heads", "head_dim")),
    (r"attn_\d+/out/kernel$", ("heads", "head_dim", "embed")),
    (r"mlp_\d+_in/kernel$", ("embed", "mlp")),
    (r"mlp_\d+_out/kernel$", ("mlp", "embed")),
]


def image_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """A user's classification loss on an image batch."""
    logits = model(batch["images"])
    labels = jax.nn.one_hot(batch["labels"], logits.shape[-1])
    return -(jax.nn.log_softmax(logits) * labels).sum(-1).mean()


# --- (g) linen with nn.DenseGeneral and nn.Einsum projections -----------------------------


class LinenEinsumBlock(linen.Module):
    """Pre-norm block: multi-dimensional attention projections (``nn.DenseGeneral`` to and
    from ``(heads, head_dim)``) and an MLP of two ``nn.Einsum``."""

    d: int
    heads: int

    @linen.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        head_dim = self.d // self.heads
        h = linen.RMSNorm(name="attn_norm")(x)
        q, k, v = (linen.DenseGeneral((self.heads, head_dim), use_bias=False, name=n)(h)
                   for n in ("query", "key", "value"))
        h = linen.dot_product_attention(q, k, v, mask=mask)
        x = x + linen.DenseGeneral(self.d, axis=(-2, -1), use_bias=False, name="out")(h)
        h = linen.RMSNorm(name="mlp_norm")(x)
        h = linen.Einsum((self.d, 4 * self.d), "bsd,df->bsf", name="wi")(h)
        return x + linen.Einsum((4 * self.d, self.d), "bsf,fd->bsd", use_bias=False,
                                name="wo")(linen.gelu(h))


class LinenEinsumLM(linen.Module):
    """A decoder of :class:`LinenEinsumBlock` with an untied output head."""

    vocab: int = VOCAB
    d: int = 32
    heads: int = 4
    layers: int = 2

    @linen.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = linen.Embed(self.vocab, self.d, name="embed")(tokens)
        mask = linen.make_causal_mask(tokens)
        for i in range(self.layers):
            x = LinenEinsumBlock(self.d, self.heads, name=f"layers_{i}")(x, mask)
        x = linen.RMSNorm(name="norm")(x)
        return linen.Dense(self.vocab, use_bias=False, name="lm_head")(x)


EINSUM_ANNOTATIONS = [
    (r"embed/embedding$", ("vocab", "embed")),
    (r"(query|key|value)/kernel$", ("embed", "heads", "head_dim")),
    (r"out/kernel$", ("heads", "head_dim", "embed")),
    (r"wi/kernel$", ("embed", "mlp")),
    (r"wi/bias$", ("mlp",)),
    (r"wo/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
]
"""Names by path for :class:`LinenEinsumLM`."""


# --- (h) a linen Llama laid out as Hugging Face's Flax Llama (names, nesting) ---------------


class LinenLlamaAttention(linen.Module):
    """Grouped-query attention with rotary positions, one ``nn.Dense`` per projection."""

    heads: int
    kv_heads: int

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        hd = d // self.heads

        def proj(name: str, n: int) -> jax.Array:
            return linen.Dense(n * hd, use_bias=False, name=name)(x).reshape(b, s, n, hd)

        q, k = _rope(proj("q_proj", self.heads)), _rope(proj("k_proj", self.kv_heads))
        out = jax.nn.dot_product_attention(q, k, proj("v_proj", self.kv_heads), is_causal=True)
        return linen.Dense(d, use_bias=False, name="o_proj")(out.reshape(b, s, d))


class LinenLlamaMLP(linen.Module):
    ff: int

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = linen.Dense(self.ff, use_bias=False, name="gate_proj")(x)
        up = linen.Dense(self.ff, use_bias=False, name="up_proj")(x)
        return linen.Dense(x.shape[-1], use_bias=False, name="down_proj")(linen.silu(gate) * up)


class LinenLlamaLayer(linen.Module):
    heads: int
    kv_heads: int
    ff: int

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = linen.RMSNorm(epsilon=1e-6, name="input_layernorm")(x)
        x = x + LinenLlamaAttention(self.heads, self.kv_heads, name="self_attn")(h)
        h = linen.RMSNorm(epsilon=1e-6, name="post_attention_layernorm")(x)
        return x + LinenLlamaMLP(self.ff, name="mlp")(h)


class LinenLlamaLayers(linen.Module):
    """The layers, named ``0``, ``1``, ... (so their params sit at ``layers/0/...``)."""

    heads: int
    kv_heads: int
    ff: int
    n: int

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.n):
            x = LinenLlamaLayer(self.heads, self.kv_heads, self.ff, name=str(i))(x)
        return x


class LinenLlamaModel(linen.Module):
    vocab: int
    d: int
    heads: int
    kv_heads: int
    ff: int
    layers: int

    @linen.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = linen.Embed(self.vocab, self.d, name="embed_tokens")(tokens)
        x = LinenLlamaLayers(self.heads, self.kv_heads, self.ff, self.layers, name="layers")(x)
        return linen.RMSNorm(epsilon=1e-6, name="norm")(x)


class LinenLlamaForCausalLM(linen.Module):
    """A Llama whose params nest and are named as Hugging Face's Flax Llama's
    (``model/layers/0/self_attn/q_proj/kernel``), with an untied head; the
    ``transformers`` config of the same sizes is :func:`linen_llama_config`'s."""

    vocab: int = VOCAB
    d: int = 32
    heads: int = 4
    kv_heads: int = 2
    ff: int = 64
    layers: int = 2

    @linen.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = LinenLlamaModel(self.vocab, self.d, self.heads, self.kv_heads, self.ff,
                            self.layers, name="model")(tokens)
        return linen.Dense(self.vocab, use_bias=False, name="lm_head")(x)


LINEN_LLAMA_ANNOTATIONS = [
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"self_attn/[qkv]_proj/kernel$", ("embed", "heads")),
    (r"self_attn/o_proj/kernel$", ("heads", "embed")),
    (r"mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
]


def linen_llama_config(model: LinenLlamaForCausalLM) -> dict:
    """The Hugging Face ``config.json`` of a :class:`LinenLlamaForCausalLM`."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "vocab_size": model.vocab, "hidden_size": model.d,
            "intermediate_size": model.ff, "num_hidden_layers": model.layers,
            "num_attention_heads": model.heads, "num_key_value_heads": model.kv_heads,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": False, "hidden_act": "silu"}


# --- (g) layers stacked with nnx.vmap and run with nnx.scan, as Flax's scan guide does ----


class ScanBlock(nnx.Module):
    def __init__(self, d: int, ff: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, ff, use_bias=False, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
        self.down = nnx.Linear(ff, d, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, ("mlp", "embed")))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class ScanLM(nnx.Module):
    def __init__(self, d: int = 32, ff: int = 128, layers: int = 4, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(1.0), ("vocab", "embed")))

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs: nnx.Rngs) -> ScanBlock:
            return ScanBlock(d, ff, rngs=rngs)

        self.blocks = stack(rngs)
        self.head = nnx.Linear(d, VOCAB, use_bias=False, rngs=rngs, kernel_init=(
            nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab"))))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(block: ScanBlock, x: jax.Array) -> jax.Array:
            return block(x)

        return self.head(run(self.blocks, self.embed(tokens)))


# --- (h) explicit sharding with a list of blocks -----------------------------------------


class ExplicitBlock(nnx.Module):
    def __init__(self, d: int, ff: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.2)
        self.w_in = nnx.Param(init(rngs.params(), (d, ff)), out_sharding=P("fsdp", "tensor"))
        self.w_out = nnx.Param(init(rngs.params(), (ff, d)), out_sharding=P("tensor", "fsdp"))

    def __call__(self, x: jax.Array) -> jax.Array:
        rows = P(("data", "fsdp"), None, None)
        w_in = jax.sharding.reshard(self.w_in[...], P(None, "tensor"))
        h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", x, w_in))
        w_out = jax.sharding.reshard(self.w_out[...], P("tensor", None))
        return x + jnp.einsum("bsf,fd->bsd", h, w_out, out_sharding=rows)


class ExplicitBlocksLM(nnx.Module):
    def __init__(self, d: int = 32, ff: int = 128, layers: int = 3, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.3)
        self.embed = nnx.Param(init(rngs.params(), (VOCAB, d)), out_sharding=P(None, "fsdp"))
        self.blocks = nnx.List([ExplicitBlock(d, ff, rngs=rngs) for _ in range(layers)])
        self.head = nnx.Param(init(rngs.params(), (d, VOCAB)), out_sharding=P("fsdp", None))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = jax.sharding.reshard(self.embed[...], P(None, None))
        x = table.at[tokens].get(out_sharding=P(("data", "fsdp"), None, None))
        for block in self.blocks:
            x = block(x)
        head = jax.sharding.reshard(self.head[...], P(None, None))
        return jnp.einsum("bsd,dv->bsv", x, head)


# --- (i) nanoGPT, ported to NNX as such ports are written ---------------------------------


class CausalSelfAttention(nnx.Module):
    """GPT-2 attention with one fused q/k/v projection (``c_attn``), split in three."""

    def __init__(self, d: int, heads: int, rate: float, *, rngs: nnx.Rngs):
        self.c_attn = nnx.Linear(d, 3 * d, rngs=rngs)
        self.c_proj = nnx.Linear(d, d, rngs=rngs)
        self.attn_dropout = nnx.Dropout(rate, rngs=rngs)
        self.resid_dropout = nnx.Dropout(rate, rngs=rngs)
        self.n_head = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, c = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=2)
        q, k, v = (a.reshape(b, t, self.n_head, c // self.n_head).transpose(0, 2, 1, 3)
                   for a in (q, k, v))
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / jnp.sqrt(k.shape[-1]))
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
        att = self.attn_dropout(jax.nn.softmax(att, axis=-1))
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nnx.Module):
    def __init__(self, d: int, rate: float, *, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.c_proj = nnx.Linear(4 * d, d, rngs=rngs)
        self.dropout = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.c_proj(jax.nn.gelu(self.c_fc(x))))


class GPTBlock(nnx.Module):
    def __init__(self, d: int, heads: int, rate: float, *, rngs: nnx.Rngs):
        self.ln_1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = CausalSelfAttention(d, heads, rate, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = GPTMLP(d, rate, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nnx.Module):
    """Karpathy's nanoGPT in NNX: learned positions, a list of blocks, a tied head, dropout
    with its own RNG stream, and a forward that returns ``(logits, loss)``."""

    def __init__(self, vocab: int = VOCAB, block_size: int = 64, d: int = 32, heads: int = 4,
                 layers: int = 2, dropout: float = 0.0, *, rngs: nnx.Rngs):
        self.wte = nnx.Embed(vocab, d, rngs=rngs, embedding_init=nnx.initializers.normal(0.02))
        self.wpe = nnx.Embed(block_size, d, rngs=rngs,
                             embedding_init=nnx.initializers.normal(0.02))
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.h = nnx.List([GPTBlock(d, heads, dropout, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, idx: jax.Array, targets: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None]:
        pos = jnp.arange(idx.shape[1])
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.wte.attend(self.ln_f(x))
        if targets is None:
            return logits, None
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        loss = -jnp.take_along_axis(logp, targets[..., None], -1).mean()
        return logits, loss


def nanogpt(rngs: nnx.Rngs, **sizes: Any) -> NanoGPT:
    """nanoGPT's constructor as a ``model.factory``."""
    return NanoGPT(rngs=rngs, **sizes)


def nanogpt_loss(model: NanoGPT, tokens: jax.Array) -> jax.Array:
    """nanoGPT's own loss, as its training loop takes it: ``model(x, y)[1]``."""
    return model(tokens[:, :-1], tokens[:, 1:])[1]


NANOGPT_ANNOTATIONS = [
    (r"wte/embedding$", ("vocab", "embed")),
    (r"wpe/embedding$", (None, "embed")),
    (r"attn/c_attn/kernel$", ("embed", "heads")),
    (r"attn/c_proj/kernel$", ("heads", "embed")),
    (r"mlp/c_fc/kernel$", ("embed", "mlp")),
    (r"mlp/c_proj/kernel$", ("mlp", "embed")),
]
"""Names by path for :class:`NanoGPT` as the sharding guide tells a user to write them."""
