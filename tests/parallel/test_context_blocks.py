"""Context-parallel attention from a fused kernel per chunk pair
(``jaxpar.parallel.context_blocks``): the driver, with the plain-JAX kernel of cuDNN's
interface, against attention written out from the formula (outputs and gradients, ring and
all-gather, natural and balanced layouts, grouped-query heads split over tensor); and
cuDNN's kernel in the program lowered for CUDA under a context axis (no GPU here: the
lowering's custom calls are read)."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.parallel.context import inverse_order
from jaxpar.parallel.context_blocks import REFERENCE, block_context_attention
from tests.parallel.test_context import laid_out
from tests.parallel.test_context_splash import reference_attention

B, S, N, KV, H = 2, 64, 4, 2, 8


@functools.cache
def _data():
    keys = jax.random.split(jax.random.key(1), 4)
    q, k = (2.0 * jax.random.normal(keys[i], (B, S, n, H)) for i, n in ((0, N), (1, KV)))
    v = jax.random.normal(keys[2], (B, S, KV, H))
    ct = jax.random.normal(keys[3], (B, S, N, H))
    return tuple(np.asarray(x) for x in (q, k, v, ct))


@functools.cache
def _reference():
    q, k, v, ct = _data()

    def loss(q, k, v):
        out = reference_attention(q, k, v, np.zeros((B, S), np.int32))
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads]


def _run(kind, axes, balanced, kernel=REFERENCE, lower_for=None):
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:math.prod(axes.values())])
    plan, q_spec, kv_spec, order, (q, k, v, ct) = laid_out(mesh, _data(), balanced)
    if lower_for:
        q, k, v, ct = (x.astype(jnp.bfloat16) for x in (q, k, v, ct))

    def loss(q, k, v):
        out = block_context_attention(q, k, v, order, mesh=mesh, q_spec=q_spec,
                                      kv_spec=kv_spec, kind=kind, axis="context",
                                      kernel=kernel)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    if lower_for:
        return program.trace(q, k, v).lower(lowering_platforms=(lower_for,)).as_text()
    put = lambda x, spec: jax.device_put(x, plan.sharding(spec))
    (_, out), grads = program(put(q, q_spec), put(k, kv_spec), put(v, kv_spec))
    undo = inverse_order(order)
    return np.asarray(out)[:, undo], [np.asarray(g)[:, undo] for g in grads]


@pytest.mark.parametrize("kind", ["ring", "allgather"])
@pytest.mark.parametrize("axes,balanced", [({"context": 4}, True), ({"context": 2}, False),
                                           ({"context": 2, "tensor": 2}, True)],
                         ids=["c4-balanced", "c2-natural", "c2-tp2-balanced"])
def test_the_driver_equals_the_formula(kind, axes, balanced):
    out, grads = _run(kind, axes, balanced)
    want, want_grads = _reference()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    for g, w, name in zip(grads, want_grads, "qkv", strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5, err_msg=f"d{name}")


@pytest.fixture
def cudnn_here(monkeypatch):
    """jax asks the installed cuDNN for its version before lowering its kernel; none is
    installed here, so it is told one (9.10, what jax's CUDA wheels bring)."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)


@pytest.mark.parametrize("kind", ["ring", "allgather"])
def test_cudnn_runs_per_block_under_a_context_axis(cudnn_here, kind):
    from jaxpar.parallel.context_blocks import CUDNN

    text = _run(kind, {"context": 2, "tensor": 2}, True, kernel=CUDNN, lower_for="cuda")
    # Per chunk pair, a switch between cuDNN's causal and unmasked kernel (or nothing).
    assert len(re.findall(r"__cudnn\$fmhaSoftmax\(", text)) >= 4
    assert len(re.findall(r"__cudnn\$fmhaSoftmaxBackward\(", text)) >= 4
    assert ("collective_permute" if kind == "ring" else "all_gather") in text
