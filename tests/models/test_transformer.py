"""The reference decoder held to a NumPy decoder written from the textbook definitions
(RMSNorm, rotary embeddings with split halves, grouped-query causal attention, gated MLP),
for the plain Llama layout and for the family variants (biases, q/k norms, tied and scaled
embeddings, Gemma's norm offset, GeGLU, a sliding window, Gemma 2's local/global layers and
attention logit soft-capping)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

import jaxpar
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.models.transformer import (
    RMSNorm,
    apply_rotary,
    rope_frequencies,
    rotary_tables,
    sequence_order,
)
from jaxpar.parallel.pipeline import Schedule
from jaxpar.sharding.partitioning import logical_names
from jaxpar.sharding.paths import path_str
from jaxpar.training.objective import lm_loss
from tests.helpers import SMALL

TINY = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                         d_ff=24, max_seq_len=16)
VARIANTS = {
    "llama": {},
    "families": dict(qkv_bias=True, qk_norm=True, tie_embeddings=True, embed_scale=True,
                     norm_offset=1.0, mlp_activation="gelu_tanh", head_dim=6,
                     rope_scaling="linear", rope_factor=2.0, sliding_window=3, n_kv_heads=1),
    # Layers 0 and 2 see 3 tokens, 1 and 3 all; large weights so that the cap bites.
    "gemma2": dict(n_layers=4, sliding_window=3, global_every=2, attn_logit_softcap=1.0,
                   init_std=0.3),
}


# --- the NumPy reference -------------------------------------------------------------------


def np_rms(x, scale, eps, offset):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (offset + scale)


def np_rope(x, positions, freqs):
    """Rotate (first half, second half) pairs of ``x`` (b, s, n, h) by ``position * freq``."""
    angle = positions[:, None] * freqs[None, :]
    sin, cos = np.sin(angle)[None, :, None, :], np.cos(angle)[None, :, None, :]
    a, b = np.split(x, 2, axis=-1)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


GELU_TANH = lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
ACTIVATIONS = {"silu": lambda x: x / (1 + np.exp(-x)), "gelu_tanh": GELU_TANH,
               "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))}


def np_decoder(cfg: TransformerConfig, params: dict[str, np.ndarray], tokens: np.ndarray
               ) -> np.ndarray:
    """Logits of ``tokens`` (b, s) by the definitions, one layer and one head at a time."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    eps, off, h = cfg.norm_eps, cfg.norm_offset, cfg.head_dim
    s = tokens.shape[1]
    pos = np.arange(s, dtype=np.float64)
    freqs = 1.0 / cfg.rope_theta ** (np.arange(0, h, 2) / h)
    if cfg.rope_scaling == "linear":
        freqs = freqs / cfg.rope_factor
    x = p["embed"][tokens]
    if cfg.embed_scale:
        x = x * math.sqrt(cfg.d_model)
    group = cfg.n_heads // cfg.n_kv_heads
    for layer in range(cfg.n_layers):
        window = cfg.sliding_window
        if cfg.global_every and (layer + 1) % cfg.global_every == 0:
            window = 0  # a global layer: the whole causal prefix
        allowed = np.tril(np.ones((s, s), bool))
        if window:
            allowed &= ~np.tril(np.ones((s, s), bool), -window)
        w = {k[len("blocks/"):]: v[layer] for k, v in p.items() if k.startswith("blocks/")}
        y = np_rms(x, w["attn_norm/scale"], eps, off)
        q = np.einsum("bse,enh->bsnh", y, w["attn/wq/kernel"])
        k = np.einsum("bse,enh->bsnh", y, w["attn/wk/kernel"])
        v = np.einsum("bse,enh->bsnh", y, w["attn/wv/kernel"])
        if cfg.qkv_bias:
            q, k, v = (q + w["attn/wq/bias"], k + w["attn/wk/bias"], v + w["attn/wv/bias"])
        if cfg.qk_norm:
            q = np_rms(q, w["attn/q_norm/scale"], eps, off)
            k = np_rms(k, w["attn/k_norm/scale"], eps, off)
        q, k = np_rope(q, pos, freqs), np_rope(k, pos, freqs)
        heads = []
        for n in range(cfg.n_heads):
            kv = n // group
            scores = np.einsum("bqh,bkh->bqk", q[:, :, n], k[:, :, kv]) / math.sqrt(h)
            if cfg.attn_logit_softcap:
                cap = cfg.attn_logit_softcap
                scores = cap * np.tanh(scores / cap)
            scores = np.where(allowed, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            heads.append(np.einsum("bqk,bkh->bqh", probs, v[:, :, kv]))
        x = x + np.einsum("bsnh,nhe->bse", np.stack(heads, 2), w["attn/wo/kernel"])
        y = np_rms(x, w["mlp_norm/scale"], eps, off)
        gate = ACTIVATIONS[cfg.mlp_activation](y @ w["mlp/w_gate/kernel"])
        x = x + (gate * (y @ w["mlp/w_up/kernel"])) @ w["mlp/w_down/kernel"]
    x = np_rms(x, p["final_norm/scale"], eps, off)
    return x @ (p["embed"].T if cfg.tie_embeddings else p["lm_head/kernel"])


def randomized(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    """A model whose norm scales and biases are random too (they start at constants)."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path_str(path)
        if name.endswith(("scale", "bias")):
            value = np.asarray(var.get_value())
            var.set_value(jnp.asarray(value + rng.normal(0, 0.3, value.shape), value.dtype))
    return model


@functools.cache
def model_of(variant: str) -> Transformer:
    """One randomized model per variant, shared by the tests that only read it."""
    return randomized(dataclasses.replace(TINY, **VARIANTS[variant]))


forward = nnx.jit(lambda model, tokens: model(tokens))


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {path_str(p): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# --- moved tests -----------------------------------------------------------------------------


def test_builtin_model_builds_and_runs_outside_any_plan():
    model = jaxpar.models.Transformer(jaxpar.models.TransformerConfig(), rngs=nnx.Rngs(0))
    assert model(jnp.zeros((1, 8), jnp.int32)).shape == (1, 8, 256)


def test_stacked_layers_carry_layers_name(devices):
    with jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 8})).activate():
        model = nnx.eval_shape(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)))
    var = nnx.state(model)["blocks"]["mlp"]["w_up"]["kernel"]
    assert logical_names(var) == ("layers", "embed", "mlp")


# --- the whole decoder -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_the_numpy_decoder(variant):
    cfg = dataclasses.replace(TINY, **VARIANTS[variant])
    model = model_of(variant)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7))
    got = np.asarray(forward(model, jnp.asarray(tokens)))
    want = np_decoder(cfg, flat_params(model), tokens)
    assert got.shape == (2, 7, cfg.vocab_size)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_the_numpy_decoder_can_tell_variants_apart():
    # The comparison above is only worth something if the variants change the logits.
    tokens = np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 7))
    cfg = dataclasses.replace(TINY, **VARIANTS["families"])
    params = flat_params(model_of("families"))
    windowed = np_decoder(cfg, params, tokens)
    full = np_decoder(dataclasses.replace(cfg, sliding_window=0), params, tokens)
    np.testing.assert_allclose(windowed[:, :3], full[:, :3], rtol=1e-10)  # within the window
    assert not np.allclose(windowed[:, 3:], full[:, 3:], atol=1e-4)


def test_global_layers_and_the_softcap_change_the_numpy_decoder():
    tokens = np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 7))
    cfg = dataclasses.replace(TINY, **VARIANTS["gemma2"])
    params = flat_params(model_of("gemma2"))
    want = np_decoder(cfg, params, tokens)
    for change in ({"global_every": 0}, {"attn_logit_softcap": 0.0}):
        other = np_decoder(dataclasses.replace(cfg, **change), params, tokens)
        assert not np.allclose(want[:, 3:], other[:, 3:], atol=1e-3), change


@pytest.mark.parametrize("attention", ["chunked", "splash"])
def test_gemma2_layers_under_other_implementations(attention):
    """The local/global pattern and the cap through the chunked and splash (interpret mode)
    implementations, with the plan's remat policy wrapping each layer, equal the NumPy
    decoder; the model holds no state beyond a plain sliding-window model's."""
    cfg = dataclasses.replace(TINY, **VARIANTS["gemma2"], attention=attention,
                              attention_block=4)
    model = model_of("gemma2")
    model = nnx.merge(nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0))), nnx.state(model))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7))
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 1},
                                                    devices=jax.devices()[:1]), remat="full")
    with plan.activate():
        got = np.asarray(forward(model, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, np_decoder(cfg, flat_params(model), tokens),
                               rtol=2e-4, atol=2e-4)
    plain = Transformer(dataclasses.replace(cfg, global_every=0, attn_logit_softcap=0.0),
                        rngs=nnx.Rngs(0))
    assert (jax.tree.structure(nnx.state(plain))
            == jax.tree.structure(nnx.state(model)))


def test_every_position_sees_only_its_prefix():
    model = model_of("llama")
    tokens = np.random.default_rng(2).integers(0, TINY.vocab_size, (2, 7))
    changed = tokens.copy()
    changed[:, 5] = (changed[:, 5] + 1) % TINY.vocab_size
    a = np.asarray(forward(model, jnp.asarray(tokens)))
    b = np.asarray(forward(model, jnp.asarray(changed)))
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert not np.allclose(a[:, 5:], b[:, 5:])


def test_embed_tokens_computes_in_the_given_dtype():
    model = model_of("families")  # embed_scale, d_model=16
    tokens = jnp.asarray([[3, 1, 4]])
    x = model.embed_tokens(tokens, jnp.bfloat16)
    assert x.dtype == jnp.bfloat16
    want = np.asarray(model.embed[...])[[3, 1, 4]] * 4.0  # sqrt(d_model=16)
    np.testing.assert_allclose(np.asarray(x, np.float32)[0], want, rtol=1e-2)
    assert model.embed_tokens(tokens).dtype == jnp.float32


def test_unembedding_is_the_head_kernel_or_the_tied_table():
    untied = model_of("llama")
    np.testing.assert_array_equal(untied.unembedding(), untied.lm_head.kernel[...])
    tied = model_of("families")
    assert not hasattr(tied, "lm_head")
    np.testing.assert_array_equal(tied.unembedding(), np.asarray(tied.embed[...]).T)
    # Without loss_chunk a dense model leaves the loss to the full logits.
    assert untied.next_token_loss(jnp.zeros((1, 5), jnp.int32)) is None


def test_initial_weights_have_the_configured_scales():
    params = flat_params(model_of("llama"))  # kernels as drawn (only norms were randomized)
    std = TINY.init_std

    def pooled_std(names):
        return np.std(np.concatenate([params[f"blocks/{n}/kernel"].ravel() for n in names]))

    assert np.std(params["embed"]) == pytest.approx(1.0, rel=0.1)
    assert pooled_std(["attn/wq", "attn/wk", "attn/wv", "mlp/w_gate", "mlp/w_up"]) == (
        pytest.approx(std, rel=0.1))
    # Residual outputs start at std / sqrt(2 * n_layers) = std / 2.
    assert pooled_std(["attn/wo", "mlp/w_down"]) == pytest.approx(std / 2, rel=0.1)
    assert np.std(params["lm_head/kernel"]) == pytest.approx(std, rel=0.1)
    fresh = Transformer(TINY, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(fresh.blocks.attn_norm.scale[...], 1.0)
    # Layers are drawn independently.
    assert not np.allclose(params["blocks/attn/wq/kernel"][0], params["blocks/attn/wq/kernel"][1])


# --- pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(offset):
    with nnx.use_eager_sharding(False):
        norm = RMSNorm(6, 1e-5, rngs=nnx.Rngs(0), offset=offset)
    x = np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32)
    np.testing.assert_allclose(norm(jnp.asarray(x)), x / np.sqrt((x * x).mean(-1,
                               keepdims=True) + 1e-5), rtol=1e-5)  # starts as the identity scale
    norm.scale.set_value(jnp.arange(6, dtype=jnp.float32))
    want = np_rms(x.astype(np.float64), np.arange(6), 1e-5, offset)
    np.testing.assert_allclose(norm(jnp.asarray(x)), want, rtol=1e-5, atol=1e-6)
    assert norm(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


def test_rope_frequencies_plain_and_linear():
    cfg = dataclasses.replace(TINY, head_dim=8, rope_theta=100.0)
    np.testing.assert_allclose(rope_frequencies(cfg), [1.0, 100 ** -0.25, 0.1, 100 ** -0.75],
                               rtol=1e-6)
    linear = dataclasses.replace(cfg, rope_scaling="linear", rope_factor=4.0)
    np.testing.assert_allclose(rope_frequencies(linear), np.asarray(rope_frequencies(cfg)) / 4,
                               rtol=1e-6)


def test_rope_frequencies_llama3():
    cfg = TransformerConfig(d_model=256, n_heads=2, n_kv_heads=2, rope_theta=500000.0,
                            rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                            rope_high_freq_factor=4.0, rope_original_max_len=8192)
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    # Llama 3.1's scaling, frequency by frequency.
    want, bands = [], set()
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want.append(f)
            bands.add("kept")
        elif wavelen > 8192 / 1.0:
            want.append(f / 8.0)
            bands.add("divided")
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 8.0 + smooth * f)
            bands.add("blended")
    assert bands == {"kept", "divided", "blended"}
    np.testing.assert_allclose(rope_frequencies(cfg), want, rtol=1e-5)


def test_rotary_tables_and_rotation():
    freqs = np.array([1.0, 0.5, 0.25])
    sin, cos = rotary_tables(5, 6, 10000.0)
    angle = np.arange(5)[:, None] * (1.0 / 10000.0 ** (np.arange(0, 6, 2) / 6))[None]
    np.testing.assert_allclose(sin, np.sin(angle), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cos, np.cos(angle), rtol=1e-6, atol=1e-6)
    positions = np.array([4, 0, 7])
    sin, cos = rotary_tables(3, 6, freqs=jnp.asarray(freqs), positions=positions)
    np.testing.assert_allclose(sin, np.sin(positions[:, None] * freqs), rtol=1e-6, atol=1e-6)
    x = np.random.default_rng(0).normal(size=(2, 3, 2, 6))
    got = apply_rotary(jnp.asarray(x, jnp.float32), sin, cos)
    np.testing.assert_allclose(got, np_rope(x, positions, freqs), rtol=1e-5, atol=1e-5)
    # A rotation keeps lengths, and q.k after rotation depends on the distance only.
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    # q at positions 7, 4, 7 against k at 3, 0, 4: distances 4, 4, 3.
    q = jnp.asarray(np.repeat(x[:1, :1], 3, axis=1), jnp.float32)
    k = jnp.asarray(np.repeat(x[1:, :1], 3, axis=1), jnp.float32)
    qs, qc = rotary_tables(3, 6, freqs=jnp.asarray(freqs), positions=[7, 4, 7])
    ks, kc = rotary_tables(3, 6, freqs=jnp.asarray(freqs), positions=[3, 0, 4])
    dots = np.sum(np.asarray(apply_rotary(q, qs, qc)) * np.asarray(apply_rotary(k, ks, kc)),
                  axis=-1)[0, :, 0]
    assert dots[0] == pytest.approx(dots[1], rel=1e-4)
    assert dots[0] != pytest.approx(dots[2], rel=1e-3)


def test_rotation_in_bf16_is_within_one_percent_of_f32():
    """bf16 queries are rotated in bf16 (no f32 copy): within 1% of ``max |x|`` of the
    float32 rotation of the same values, at positions up to 128k (Llama 3 frequencies),
    and the gradient too."""
    freqs = rope_frequencies(TransformerConfig(head_dim=128, rope_theta=500000.0))
    positions = np.array([0, 1, 17, 4095, 65_537, 131_071])
    sin, cos = rotary_tables(len(positions), 128, freqs=freqs, positions=positions)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, len(positions), 4, 128)),
                    jnp.bfloat16)
    want = np.asarray(apply_rotary(x.astype(jnp.float32), sin, cos))
    got = apply_rotary(x, sin, cos)
    assert got.dtype == jnp.bfloat16
    scale = float(np.abs(want).max())
    assert np.abs(np.asarray(got, np.float32) - want).max() <= 0.01 * scale
    g = np.random.default_rng(1).normal(size=x.shape)
    grad = lambda x: jax.grad(lambda x: jnp.sum(apply_rotary(x, sin, cos).astype(  # noqa: E731
        jnp.float32) * g))(x)
    g32, g16 = np.asarray(grad(x.astype(jnp.float32))), np.asarray(grad(x), np.float32)
    assert np.abs(g16 - g32).max() <= 0.01 * np.abs(g32).max()


def test_sequence_order_under_context_parallelism(devices):
    assert sequence_order(8) is None
    mesh = jaxpar.make_mesh({"data": 4, "context": 2})
    with jaxpar.Plan.from_preset(mesh).activate():
        # 4 chunks of 2: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
        np.testing.assert_array_equal(sequence_order(8), [0, 1, 6, 7, 2, 3, 4, 5])
    with jaxpar.Plan.from_preset(mesh, context_balance=False).activate():
        assert sequence_order(8) is None
    with jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 8})).activate():
        assert sequence_order(8) is None


def test_the_plan_remat_policy_wraps_each_block(devices):
    model = model_of("llama")
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, TINY.vocab_size, (8, 6)))
    graphdef, state = nnx.split(model, nnx.Param)
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(tokens) ** 2)
    mesh = jaxpar.make_mesh({"data": 8})
    kept = {}
    for remat in ("none", "full"):
        with jaxpar.Plan.from_preset(mesh, "dp", remat=remat).activate():
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                print_saved_residuals(loss, state)
        # The MLP's hidden activations of both layers, (layers, batch, seq, d_ff).
        kept[remat] = out.getvalue().count("f32[2,8,6,24]")
    assert kept["none"] > 0 and kept["full"] == 0, kept


# --- errors --------------------------------------------------------------------------------------


def test_bad_shapes_and_pipelines_are_named():
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(jaxpar.JaxparError, match=r"sequence length 17 exceeds "
                                                 r"model.max_seq_len=16"):
        model(jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(jaxpar.JaxparError, match=r"model.n_layers=2 must equal pipeline stages "
                                                 r"x repeats x layers per stage = 2 x 2 x 1"):
        nnx.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(0), pipeline=Schedule(2, 2, 2)))
    moe = dataclasses.replace(TINY, n_experts=2)
    with pytest.raises(jaxpar.JaxparError, match=r"model.n_experts > 0 with pipeline stages"):
        nnx.eval_shape(lambda: Transformer(moe, rngs=nnx.Rngs(0), pipeline=Schedule(2, 2)))
    gemma2 = dataclasses.replace(TINY, sliding_window=3, global_every=2)
    with pytest.raises(jaxpar.JaxparError, match=r"model.global_every=2 with pipeline stages"):
        nnx.eval_shape(lambda: Transformer(gemma2, rngs=nnx.Rngs(0), pipeline=Schedule(2, 1)))


@pytest.mark.parametrize("tied", [False, True])
def test_a_fresh_model_starts_near_the_uniform_loss(tied):
    """ln(vocab) is the loss of uniform guesses: an untrained model, tied or not, starts
    within 10% of it (a tied head drawn at the embedding's scale started at 106 for
    ln 256 = 5.55)."""
    cfg = dataclasses.replace(SMALL, tie_embeddings=tied)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, cfg.vocab_size)
    loss = float(lm_loss(model, tokens))
    assert abs(loss - math.log(cfg.vocab_size)) < 0.1 * math.log(cfg.vocab_size), loss
