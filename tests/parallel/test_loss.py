"""Chunked cross-entropy (``model.loss_chunk``): equal to the full-logits loss in value and
gradients (alone against optax, inside the reference model tied and untied, under FSDP x
TP sharding, through the pipeline, a LoRA head and one Trainer step in bf16), and its
compiled temporary memory at a large vocabulary."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.adapters import lora
from jaxpar.errors import JaxparError
from jaxpar.models.transformer import Transformer, TransformerConfig
from jaxpar.parallel import pipeline as pl
from jaxpar.parallel.loss import chunked_cross_entropy
from jaxpar.sharding.precision import Policy
from jaxpar.training.trainer import lm_loss

CFG = TransformerConfig(vocab_size=96, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)
SEQ = 24  # chunk 8 divides it, chunk 5 does not


def _tokens(batch=4, seq=SEQ, vocab=CFG.vocab_size, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, vocab)


def _assert_trees_close(got, want, atol, rtol):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=atol, rtol=rtol)


def _loss_and_grads(cfg, tokens, *, plan=None, wrap=lambda m: m, trainable=nnx.Param):
    """lm_loss of a fresh model of ``cfg`` (seed 0) and its gradients."""
    if plan is None:
        model = wrap(Transformer(cfg, rngs=nnx.Rngs(0)))
    else:
        model = jaxpar.init_sharded(lambda: wrap(Transformer(cfg, rngs=nnx.Rngs(0))), plan)
    graphdef, params, rest = nnx.split(model, trainable, ...)

    def loss(params):
        return lm_loss(nnx.merge(graphdef, params, rest), tokens)

    step = jax.jit(jax.value_and_grad(loss))
    if plan is None:
        return step(params)
    with plan.activate(mesh_context=True):
        compiled = step.lower(params).compile()
        return compiled(params), compiled.as_text()


@pytest.mark.parametrize("chunk", [8, 5, 100])
def test_matches_optax_on_plain_logits(chunk):
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (3, SEQ, 16))
    kernel = 0.5 * jax.random.normal(keys[1], (16, 50))
    targets = jax.random.randint(keys[2], (3, SEQ), 0, 50)

    def reference(hidden, kernel):
        logits = jnp.einsum("bse,ev->bsv", hidden, kernel)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def chunked(hidden, kernel):
        return chunked_cross_entropy(hidden, kernel, targets, chunk=chunk)

    want, want_grads = jax.value_and_grad(reference, argnums=(0, 1))(hidden, kernel)
    got, got_grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, kernel)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    _assert_trees_close(got_grads, want_grads, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("tie,chunk,gemma,cap", [(False, 5, False, 0.0), (True, 8, True, 0.0),
                                                 (True, 8, True, 0.5)])
def test_model_chunked_equals_full_logits(tie, chunk, gemma, cap):
    """Gemma 2's final logit soft-cap (``cap``, small enough to bind) is applied chunk by
    chunk: the chunked loss runs with it (before, it fell back to the full logits)."""
    extra = {"norm_offset": 1.0, "embed_scale": True} if gemma else {}
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, final_logit_softcap=cap, **extra)
    tokens = _tokens()
    want, want_grads = _loss_and_grads(cfg, tokens)
    got, got_grads = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=chunk), tokens)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    _assert_trees_close(got_grads, want_grads, atol=1e-7, rtol=1e-4)

    # And against optax on logits formed by plain jnp from the same weights.
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    x = nnx.jit(lambda m, t: m.hidden_states(t))(model, tokens[:, :-1])
    scale = model.final_norm.scale[...] + cfg.norm_offset
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * scale
    w = model.embed[...].T if tie else model.lm_head.kernel[...]
    logits = x @ w if not cap else cap * jnp.tanh((x @ w) / cap)
    reference = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    np.testing.assert_allclose(got, reference, rtol=2e-6)


def test_sharded_fsdp_tp_equals_full_and_keeps_vocab_split():
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp")
    tokens = _tokens()
    (want, want_grads), _ = _loss_and_grads(CFG, tokens, plan=plan)
    (got, got_grads), hlo = _loss_and_grads(dataclasses.replace(CFG, loss_chunk=5), tokens,
                                            plan=plan)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    _assert_trees_close(got_grads, want_grads, atol=1e-7, rtol=1e-4)
    # Per device: one row (batch 4 over fsdp 4) of a 5-position chunk, half the vocabulary.
    assert "f32[1,5,48]" in hlo
    assert f"f32[1,5,{CFG.vocab_size}]" not in hlo


def test_pipelined_model_chunked_equals_full():
    """The pipelined model (chunked loss) against the same weights unpipelined (full)."""
    cfg = dataclasses.replace(CFG, n_layers=2)
    tokens = _tokens(batch=8)
    want, want_grads = _loss_and_grads(cfg, tokens)
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"stage": 2, "data": 4}), "fsdp_tp")
    chunked = dataclasses.replace(cfg, loss_chunk=5)
    model = jaxpar.init_sharded(
        lambda: Transformer(chunked, rngs=nnx.Rngs(0), pipeline=pl.Schedule(2, 2, 1)), plan)
    graphdef, params = nnx.split(model, nnx.Param)
    with plan.activate(mesh_context=True):
        got, got_grads = jax.jit(jax.value_and_grad(
            lambda p: lm_loss(nnx.merge(graphdef, p), tokens)))(params)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    _assert_trees_close(pl.from_pipeline_layout(got_grads), want_grads, atol=1e-7, rtol=1e-4)


def test_lora_head_is_applied_by_chunk_and_dropout_falls_back():
    tokens = _tokens()
    cfg = dataclasses.replace(CFG, loss_chunk=5)

    def adapt(model):
        model = lora.apply(model, r"(attn/wq|lm_head)$", rank=4)
        # Nonzero B, so the adapter changes the logits and the test sees whether it is applied.
        for _, proj in lora.adapted(model):
            b = proj.lora_b
            b.set_value(0.1 * jax.random.normal(jax.random.key(3), b.get_value().shape))
        return model

    want, want_grads = _loss_and_grads(CFG, tokens, wrap=adapt, trainable=nnx.LoRAParam)
    got, got_grads = _loss_and_grads(cfg, tokens, wrap=adapt, trainable=nnx.LoRAParam)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    _assert_trees_close(got_grads, want_grads, atol=1e-7, rtol=1e-4)

    with_dropout = lora.apply(Transformer(cfg, rngs=nnx.Rngs(0)), "lm_head$", rank=4,
                              dropout=0.1)
    assert with_dropout.next_token_loss(tokens) is None  # a new mask per chunk: not chunked
    assert np.isfinite(lm_loss(with_dropout, tokens))
    with_dropout.eval()
    assert with_dropout.next_token_loss(tokens) is not None


def test_one_trainer_step_equal_in_bf16():
    tokens = np.asarray(_tokens(batch=8))
    out = []
    for chunk in (0, 8):
        cfg = dataclasses.replace(CFG, loss_chunk=chunk)
        plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp",
                                       precision=Policy.parse("p=f32,c=bf16,o=f32"))
        model = jaxpar.init_sharded(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0)), plan)
        trainer = jaxpar.Trainer(model, optax.sgd(0.1), plan)
        metrics = trainer.step(tokens)
        out.append((metrics, trainer.state[trainer.master_key]))
    (want, want_params), (got, got_params) = out
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-3)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-2)
    _assert_trees_close(got_params, want_params, atol=2e-4, rtol=1e-2)


def test_chunked_loss_lowers_temporary_memory_at_vocab_32000():
    tokens = jax.ShapeDtypeStruct((2, 513), jnp.int32)

    def temp_bytes(chunk):
        cfg = TransformerConfig(vocab_size=32000, d_model=32, n_layers=1, n_heads=2,
                                n_kv_heads=2, d_ff=64, max_seq_len=512, loss_chunk=chunk)
        graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))),
                                     nnx.Param)
        grad = jax.grad(lambda p, t: lm_loss(nnx.merge(graphdef, p), t))
        return jax.jit(grad).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    full, chunked = temp_bytes(0), temp_bytes(32)
    logits = 2 * 512 * 32000 * 4  # one f32 (batch, seq, vocab) array
    assert full >= logits
    assert chunked < full / 5, (chunked, full)


def test_loss_chunk_is_validated():
    with pytest.raises(JaxparError, match="model.loss_chunk=-1"):
        TransformerConfig(loss_chunk=-1)
    with pytest.raises(JaxparError, match="chunk=0"):
        chunked_cross_entropy(jnp.zeros((1, 4, 8)), jnp.zeros((8, 16)),
                              jnp.zeros((1, 4), jnp.int32), chunk=0)
