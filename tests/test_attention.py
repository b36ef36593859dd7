"""Attention implementations against ``jax.nn.dot_product_attention``'s XLA lowering: the
chunked (online-softmax, custom-gradient) one in forward and gradients, alone and inside the
reference model under sharding, and its compiled temporary memory at a long sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.attention import attention, chunked_attention, resolve
from jaxpar.errors import JaxparError
from jaxpar.models.transformer import Transformer, TransformerConfig


def _qkv(b=2, s=37, n=4, kv=2, h=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = 2.0 * jax.random.normal(keys[0], (b, s, n, h))  # peaked, not uniform, attention
    k = 2.0 * jax.random.normal(keys[1], (b, s, kv, h))
    v = jax.random.normal(keys[2], (b, s, kv, h))
    cotangent = jax.random.normal(keys[3], (b, s, n, h))
    return q, k, v, cotangent


@pytest.mark.parametrize("window,block", [(0, 8), (5, 8), (0, 64), (12, 16)])
def test_chunked_equals_xla_forward_and_gradients(window, block):
    q, k, v, ct = _qkv()

    def loss(impl):
        def f(q, k, v):
            if impl == "chunked":
                out = chunked_attention(q, k, v, window=window, block=block)
            else:
                out = attention(q, k, v, implementation="xla", window=window)
            return jnp.sum(out * ct), out
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (_, want), want_grads = loss("xla")
    (_, got), got_grads = loss("chunked")
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for g, w, name in zip(got_grads, want_grads, "qkv", strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=f"d{name}")


def test_chunked_inside_the_sharded_model_equals_xla():
    base = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             d_ff=64, max_seq_len=32, attention="xla")
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp")
    tokens = jax.random.randint(jax.random.key(1), (4, 25), 0, 64)
    results = []
    for impl in ("xla", "chunked"):
        cfg = TransformerConfig(**{**vars(base), "attention": impl, "attention_block": 8})
        model = jaxpar.init_sharded(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0)), plan)
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(params, graphdef=graphdef):
            return jaxpar.train.lm_loss(nnx.merge(graphdef, params), tokens)

        with plan.activate(mesh_context=True):
            results.append(jax.jit(jax.value_and_grad(loss))(params))
    (loss_x, grads_x), (loss_c, grads_c) = results
    np.testing.assert_allclose(loss_c, loss_x, rtol=1e-6)
    for gx, gc in zip(jax.tree.leaves(grads_x), jax.tree.leaves(grads_c), strict=True):
        np.testing.assert_allclose(gc, gx, atol=1e-6, rtol=1e-4)


def test_chunked_lowers_temporary_memory_at_seq_2048():
    q, k, v, _ = (jax.ShapeDtypeStruct(s, jnp.float32) for s in
                  ((1, 2048, 4, 32), (1, 2048, 4, 32), (1, 2048, 4, 32), ()))

    def temp_bytes(fn):
        grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    xla = temp_bytes(lambda q, k, v: attention(q, k, v, implementation="xla"))
    chunked = temp_bytes(lambda q, k, v: chunked_attention(q, k, v, block=256))
    scores = 2048 * 2048 * 4 * 4  # one f32 (seq, seq) matrix per head
    assert xla >= scores  # XLA materialises the scores (and more for the backward pass)
    assert chunked < xla / 4, (chunked, xla)


def test_implementation_choice():
    assert resolve("auto", jnp.float32) == "xla"  # on this CPU backend
    assert resolve("chunked", jnp.float32) == "chunked"
    with pytest.raises(JaxparError, match="model.attention='flash'"):
        resolve("flash", jnp.float32)
    with pytest.raises(JaxparError, match="model.attention='flash'"):
        TransformerConfig(attention="flash")
