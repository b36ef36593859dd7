"""plan.quantize: int8 and fp8 matmuls in training through Qwix, read from the program the
Trainer hands to XLA (the dot operands' types), on the reference decoder, a user's model
written without jaxpar and LoRA; training tracks the unquantized run."""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.adapters import lora
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.sharding.quantization import DEFAULT_EXCLUDE
from tests import user_models as um

CFG = TransformerConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
_DOT = re.compile(r"stablehlo\.dot_general .*?: \(tensor<(?:\d+x)*(\w+?)>, "
                  r"tensor<(?:\d+x)*(\w+?)>\)")


def batches(steps: int = 1, vocab: int = CFG.vocab_size) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, (8, 17)).astype(np.int32) for _ in range(steps)]


def dot_types(trainer: jaxpar.Trainer, batch: np.ndarray) -> collections.Counter:
    """(lhs, rhs) element types of every dot in the step as lowered for XLA."""
    text = trainer.lower(batch).as_text()
    return collections.Counter(_DOT.findall(text))


def trainer(quantize: str = "none", model=None, **knobs) -> jaxpar.Trainer:
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH), "fsdp_tp", quantize=quantize,
                                   **knobs)
    model = model or (lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    return jaxpar.Trainer(jaxpar.init_sharded(model, plan), optax.adam(1e-2), plan)


@functools.cache
def reference_dots() -> collections.Counter:
    return dot_types(trainer(), batches()[0])


def test_int8_runs_every_projection_on_int8_operands_forward_and_backward(devices):
    """Seven projections a layer (q, k, v, o, gate, up, down), each three int8 products
    (forward, input gradient, weight gradient), in the layer loop's body once; attention's
    own products and the head stay f32."""
    got = dot_types(trainer("int8"), batches()[0])
    assert got[("i8", "i8")] == 21
    assert sum(got.values()) == sum(reference_dots().values())
    assert got[("f32", "f32")] == reference_dots()[("f32", "f32")] - 21


def test_fp8_uses_e4m3_forward_and_e5m2_gradients(devices):
    got = dot_types(trainer("fp8"), batches()[0])
    assert got[("f8E4M3FN", "f8E4M3FN")] == 7  # forward
    assert got[("f8E5M2", "f8E4M3FN")] == 14  # gradients (e5m2) x forward values (e4m3)
    assert not got[("i8", "i8")]


def test_target_and_exclude_select_the_modules(devices):
    only_mlp = dot_types(trainer("int8", quantize_target=r"blocks/mlp/.*"), batches()[0])
    assert only_mlp[("i8", "i8")] == 9
    no_attention = dot_types(trainer("int8", quantize_exclude=rf"{DEFAULT_EXCLUDE}|.*/attn/.*"),
                             batches()[0])
    assert no_attention[("i8", "i8")] == 9
    assert not dot_types(trainer("none"), batches()[0])[("i8", "i8")]


def test_lora_keeps_its_update_unquantized_and_quantizes_the_base(devices):
    """LoRA on every projection: the frozen base's products are int8 (forward and input
    gradient: a frozen weight has no gradient product), the low-rank update (A and B,
    trained) stays in the compute dtype."""
    def model():
        return lora.apply(Transformer(CFG, rngs=nnx.Rngs(0)), rank=4)

    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH), "fsdp_tp", quantize="int8")
    step = jaxpar.Trainer(jaxpar.init_sharded(model, plan), optax.adam(1e-2), plan,
                          trainable=nnx.LoRAParam)
    got = dot_types(step, batches()[0])
    assert got[("i8", "i8")] == 14
    assert got[("f32", "f32")] > reference_dots()[("f32", "f32")]
    before = float(step.step(batches()[0])["loss"])
    assert float(step.step(batches()[0])["loss"]) < before


def test_a_users_model_quantizes_by_its_own_paths(devices):
    """A Llama-like model written with plain Flax: its projections (layers/self_attn/q_proj,
    ..., its two layers scanned) are int8; its embedding, head and the attention products
    it writes with jnp.einsum inside self_attn stay f32."""
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH), "fsdp_tp", quantize="int8",
                                   annotations=um.LLAMA_ANNOTATIONS)
    model = jaxpar.init_sharded(lambda: um.LlamaLike(rngs=nnx.Rngs(0)), plan)
    step = jaxpar.Trainer(model, optax.adam(1e-2), plan)
    got = dot_types(step, batches(vocab=um.VOCAB)[0])
    # The scan's body holds one layer: seven projections, three products each.
    assert got[("i8", "i8")] == 21
    assert got[("f32", "f32")] == 2 * 3 + 3  # attention's two products, the head


@functools.cache
def plain_run() -> tuple[jaxpar.Trainer, tuple[float, ...]]:
    """The unquantized decoder after ten Adam steps on ``batches(10)``, and its losses."""
    plain = trainer()
    return plain, tuple(float(plain.step(b)["loss"]) for b in batches(10))


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_training_tracks_the_unquantized_run(devices, mode):
    """Ten Adam steps on the same batches: every loss within 2% of the unquantized run's
    and the loss falls as far (the 200-step curves on configs/tiny.yaml are in the
    README's "Fewer bits"). XLA:CPU widens int8 products to int32 arithmetic, but the
    quantized operands are in the compiled int8 program: no dequantized copy of the
    weights stands in for them."""
    data = batches(10)
    plain, want = plain_run()
    quantized = trainer(mode)
    got = [float(quantized.step(b)["loss"]) for b in data]
    assert max(abs(g - w) / w for g, w in zip(got, want, strict=True)) < 0.02
    assert got[-1] < got[0] - 0.5 * (want[0] - want[-1])
    if mode == "int8":  # (the programs the steps ran: compiled already)
        assert "s8[" in quantized.lower(data[0]).compile().as_text()
        assert "s8[" not in plain.lower(data[0]).compile().as_text()


def test_bad_settings_are_one_line(devices):
    with pytest.raises(jaxpar.JaxparError, match=r"quantize='int4': choose one of "
                                                 r"\['none', 'int8', 'fp8'\]"):
        jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH), "fsdp_tp", quantize="int4")
    with pytest.raises(jaxpar.JaxparError, match=r"quantize_target='\(': must be a valid"):
        jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH), "fsdp_tp", quantize_target="(")


class Mixer(nnx.Module):
    """A state-space-style mixer written with einsums: two weight projections around a
    four-operand scan einsum and a scores-times-values product (no weight in either), in
    a module whose name says nothing of attention."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_bc = nnx.Param(init(rngs.params(), (d, 2 * d)))
        self.w_out = nnx.Param(init(rngs.params(), (d, d)))

    def __call__(self, x):
        b, c = jnp.split(jnp.einsum("bsd,de->bse", x, self.w_bc[...]), 2, axis=-1)
        s = x.shape[1]
        decay = jnp.tril(jnp.exp(-0.1 * (jnp.arange(s)[:, None] - jnp.arange(s)[None])))
        y = jnp.einsum("bsd,bsd,ts,btd->btd", b, x, decay, c)
        causal = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]  # [s, t]: t <= s
        scores = jnp.where(causal, jnp.einsum("bsd,btd->bst", x, b), -1e9)
        mixed = jnp.einsum("bst,btd->bsd", jax.nn.softmax(scores, axis=-1), y)
        return x + jnp.einsum("bsd,de->bse", mixed, self.w_out[...])


class MixerLM(nnx.Module):
    def __init__(self, d: int = 32, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(um.VOCAB, d, rngs=rngs)
        self.mixers = nnx.List([Mixer(d, rngs=rngs) for _ in range(2)])
        self.logits = nnx.Linear(d, um.VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for mixer in self.mixers:
            x = mixer(x)
        return self.logits(x)


def test_only_weight_matmuls_are_quantized_whatever_the_modules_are_called(devices):
    """The two projections a mixer are int8 (three products each); its scan einsum (four
    operands: Qwix has no quantized form) and its scores and values products (batched, no
    weight) stay f32, as do the head's."""
    plan = jaxpar.Plan.from_preset(
        jaxpar.make_mesh(MESH), "fsdp_tp", quantize="int8", quantize_exclude="logits",
        annotations=[(r"w_bc$|w_out$", ("embed", "mlp")), (r"embedding$", ("vocab", "embed")),
                     (r"logits/kernel$", ("embed", "vocab"))])
    step = jaxpar.Trainer(jaxpar.init_sharded(lambda: MixerLM(rngs=nnx.Rngs(0)), plan),
                          optax.adam(1e-2), plan)
    got = dot_types(step, batches(vocab=um.VOCAB)[0])
    assert got[("i8", "i8")] == 2 * 3  # the two mixers scanned: one in the program
    before = float(step.step(batches(vocab=um.VOCAB)[0])["loss"])
    assert np.isfinite(before) and float(step.step(batches(vocab=um.VOCAB)[0])["loss"]) < before


def _linen_trainer(quantize: str) -> jaxpar.Trainer:
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH), "fsdp_tp", quantize=quantize,
                                   annotations=um.GPT_ANNOTATIONS)
    model = jaxpar.init_sharded(lambda: jaxpar.from_linen(
        um.LinenGPT(), np.zeros((2, 8), np.int32)), plan)
    return jaxpar.Trainer(model, optax.adam(1e-2), plan)


def test_a_linen_model_trains_on_int8_matmuls_and_tracks_its_f32_run(devices):
    """LinenGPT through jaxpar.from_linen: its four Dense layers a block (query, key, value
    and out of nn.MultiHeadDotProductAttention, c_fc, c_proj) run on int8 operands, three
    products each, in both blocks; attention's own products and the tied head
    (wte.attend) stay f32. Five steps stay within 2% of the f32 run's losses."""
    steps = batches(5, vocab=um.VOCAB)
    quantized, full = _linen_trainer("int8"), _linen_trainer("none")
    got = dot_types(quantized, steps[0])
    assert got[("i8", "i8")] == 2 * 6 * 3, got
    assert sum(got.values()) == sum(dot_types(full, steps[0]).values())
    q = [float(quantized.step(b)["loss"]) for b in steps]
    f = [float(full.step(b)["loss"]) for b in steps]
    assert q[-1] < q[0]
    np.testing.assert_allclose(q, f, rtol=0.02)


def test_the_output_head_is_found_by_what_it_is_not_its_name(devices):
    """A model whose output projection is called ``logitdense`` (as Flax's lm1b example
    calls it) and has no logical names: it is the weight outside the repeated blocks whose
    last dimension is the embedding's row count, and it stays f32."""
    class Lm1bLike(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(um.VOCAB, 32, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(2)])
            self.logitdense = nnx.Linear(32, um.VOCAB, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = x + jax.nn.gelu(block(x))
            return self.logitdense(x)

    step = trainer("int8", model=lambda: Lm1bLike(nnx.Rngs(0)))
    got = dot_types(step, batches(vocab=um.VOCAB)[0])
    assert got[("i8", "i8")] == 2 * 3  # the blocks' products only
    assert got[("f32", "f32")] == 3  # the head's forward, input and weight gradients


def _explicit_trainer(model, quantize: str, adapters: bool = False) -> jaxpar.Trainer:
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2}, explicit=True)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", quantize=quantize)
    def build():
        base = model(rngs=nnx.Rngs(0))
        return lora.apply(base, rank=4, target="up|down") if adapters else base

    return jaxpar.Trainer(jaxpar.init_sharded(build, plan), optax.adam(1e-2), plan,
                          trainable=nnx.LoRAParam if adapters else nnx.Param)


@pytest.mark.parametrize("model, adapters, quantized", [
    (um.ExplicitLinearLM, False, 2 * 3),  # nnx.Linear up and down, out_sharding given
    (um.ExplicitBlocksLM, False, 2 * 3),  # jnp.einsum on resharded weights, 3 blocks scanned
    # frozen base: two forwards and the input gradient of down (up's input, the frozen
    # embedding's lookup, needs none)
    (um.ExplicitLinearLM, True, 3),
])
def test_an_explicit_sharding_model_trains_on_int8_matmuls(devices, model, adapters, quantized):
    """Models written for explicit sharding: each weight matmul quantized where its operands
    lie and its result typed as the model asked (``out_sharding``, or the operands'
    types), the embedding lookup and the head (the projection onto the vocabulary) left
    f32; five steps track the unquantized run within 2%."""
    steps = batches(5, vocab=um.VOCAB)
    q, f = _explicit_trainer(model, "int8", adapters), _explicit_trainer(model, "none", adapters)
    assert dot_types(q, steps[0])[("i8", "i8")] == quantized
    ql = [float(q.step(b)["loss"]) for b in steps]
    fl = [float(f.step(b)["loss"]) for b in steps]
    assert ql[-1] < ql[0]
    np.testing.assert_allclose(ql, fl, rtol=0.02)


@pytest.mark.parametrize("knobs", [{"quantize_gather": "int8", "zero_stage": 3},
                                   {"quantize_reduce": "int8", "zero_stage": 2}])
def test_an_explicit_mesh_is_told_zeropp_does_not_run_there_yet(devices, knobs):
    """ZeRO++'s shard_map cannot carry the model's sharding types: refused in one line
    naming the knob, not a traceback from inside the model."""
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2}, explicit=True)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", **knobs)
    model = jaxpar.init_sharded(lambda: um.ExplicitLinearLM(rngs=nnx.Rngs(0)), plan)
    knob = next(k for k in knobs if k.startswith("quantize"))
    with pytest.raises(jaxpar.JaxparError, match=f"plan.{knob}='int8' does not run on an "
                                                 "explicit-sharding mesh yet"):
        jaxpar.Trainer(model, optax.adam(1e-2), plan)


def test_a_scanned_stack_quantizes_its_blocks_once_in_the_loop_body(devices):
    """ScanLM (blocks stacked by nnx.vmap, run by nnx.scan): up and down of the scanned
    block, three int8 products each, in the loop body once; the head stays f32; five
    steps within 2% of the f32 run."""
    steps = batches(5, vocab=um.VOCAB)
    build = lambda: um.ScanLM(rngs=nnx.Rngs(0))  # noqa: E731
    q, f = trainer("int8", model=build), trainer("none", model=build)
    assert dot_types(q, steps[0])[("i8", "i8")] == 2 * 3
    ql = [float(q.step(b)["loss"]) for b in steps]
    fl = [float(f.step(b)["loss"]) for b in steps]
    assert ql[-1] < ql[0]
    np.testing.assert_allclose(ql, fl, rtol=0.02)


def test_patterns_that_match_no_matmul_are_named_at_start(devices):
    """A quantize_target that matches no weight matmul would compile a plain step: the
    Trainer says so when it starts."""
    with pytest.warns(jaxpar.errors.JaxparWarning, match="match no weight matmul of "
                                                         "Transformer, so nothing"):
        trainer("int8", quantize_target=r"no/such/module")
