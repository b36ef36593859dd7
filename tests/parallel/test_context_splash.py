"""The splash kernel under context parallelism (Pallas interpret mode here) against plain
attention written out in this file (scores, soft cap, causal/window/document mask, softmax)
on the whole, naturally ordered sequence: all-gather and ring, natural and balanced layouts,
with a sliding window, packed documents and soft-capping, outputs and gradients."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.errors import JaxparError
from jaxpar.parallel import context as context_lib
from jaxpar.parallel.context import inverse_order
from jaxpar.parallel.context_splash import splash_context_attention
from tests.parallel.test_context import laid_out

B, S, N, KV, H = 2, 512, 4, 2, 8


@functools.cache
def _data():
    keys = jax.random.split(jax.random.key(0), 4)
    q = 2.0 * jax.random.normal(keys[0], (B, S, N, H))
    k = 2.0 * jax.random.normal(keys[1], (B, S, KV, H))
    v = jax.random.normal(keys[2], (B, S, KV, H))
    ct = jax.random.normal(keys[3], (B, S, N, H))
    # Row 0: three documents of uneven length; row 1: one.
    seg = np.zeros((B, S), np.int32)
    seg[0, 100:300], seg[0, 300:] = 1, 2
    return tuple(np.asarray(x) for x in (q, k, v, ct)) + (seg,)


def reference_attention(q, k, v, segments, window=0, softcap=0.0):
    """Causal attention as the formula says, in float32."""
    b, s, n, h = q.shape
    k = jnp.repeat(k, n // k.shape[2], axis=2)
    v = jnp.repeat(v, n // v.shape[2], axis=2)
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(h)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    pos = jnp.arange(s)
    keep = pos[None, :] <= pos[:, None]
    if window:
        keep &= pos[None, :] > pos[:, None] - window
    keep = keep[None] & (segments[:, :, None] == segments[:, None, :])
    scores = jnp.where(keep[:, None], scores, -jnp.inf)
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, axis=-1), v)


@functools.cache
def _reference(window, softcap, packed):
    q, k, v, ct, seg = _data()
    seg = seg if packed else np.zeros_like(seg)

    def loss(q, k, v):
        out = reference_attention(q, k, v, seg, window, softcap)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads]


def _splash(kind, axes, window=0, softcap=0.0, balanced=False, packed=False, block=512):
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:math.prod(axes.values())])
    q, k, v, ct, seg = _data()
    seg = seg if packed else np.zeros_like(seg)
    plan, q_spec, kv_spec, order, (q, k, v, ct, seg) = laid_out(mesh, (q, k, v, ct, seg),
                                                                balanced)

    def loss(q, k, v):
        out = splash_context_attention(
            q, k, v, order, jnp.asarray(seg), mesh=mesh, q_spec=q_spec, kv_spec=kv_spec,
            kind=kind, axis="context", window=window, softcap=softcap, block=block,
            interpret=True)
        return jnp.sum(out * ct), out

    put = lambda x, spec: jax.device_put(x, plan.sharding(spec))
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        put(q, q_spec), put(k, kv_spec), put(v, kv_spec))
    undo = inverse_order(order)
    return np.asarray(out)[:, undo], [np.asarray(g)[:, undo] for g in grads]


def _assert_matches(got, want):
    out, grads = got
    want_out, want_grads = want
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for g, w, name in zip(grads, want_grads, "qkv", strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("kind", ["allgather", "ring"])
@pytest.mark.parametrize("axes,window,softcap,balanced,packed", [
    ({"context": 2, "tensor": 2}, 100, 0.0, False, True),
    ({"context": 4}, 0, 5.0, True, True),
], ids=["c2-tp2-window-documents", "c4-balanced-softcap-documents"])
def test_splash_under_context_equals_the_formula(kind, axes, window, softcap, balanced,
                                                 packed):
    got = _splash(kind, axes, window, softcap, balanced, packed)
    _assert_matches(got, _reference(window, softcap, packed))


def test_each_shard_a_multiple_of_the_tile():
    mesh = jaxpar.make_mesh({"context": 8})
    spec = jax.sharding.PartitionSpec(None, "context", None, None)
    q = jnp.zeros((1, 512, 2, 8))
    with pytest.raises(JaxparError, match="seq=512 over context=8 gives 64"):
        splash_context_attention(q, q, q, np.arange(512), jnp.zeros((1, 512)), mesh=mesh,
                                 q_spec=spec, kv_spec=spec, kind="ring", axis="context")


def test_a_training_step_on_splash_under_context_equals_one_device(capfd, monkeypatch):
    """The reference model with ``attention=splash`` trained on context=2 x tensor=2 (ring,
    balanced layout; interpret mode here) gives one device's loss and gradient norm."""
    from tests.helpers import SMALL, loader, make_trainer

    cfg = dataclasses.replace(SMALL, max_seq_len=256, n_layers=1)
    batch = loader(batch=2, seq=256).batch(0)
    one = make_trainer({"data": 1}, devices=jax.devices()[:1],
                       cfg=dataclasses.replace(cfg, attention="xla")).step(batch)
    trainer = make_trainer({"context": 2, "tensor": 2}, devices=jax.devices()[:4],
                           cfg=dataclasses.replace(cfg, attention="splash"))
    trainer = jaxpar.Trainer(trainer.model, trainer.optimizer,
                             trainer.plan.replace(context_attention="ring"))
    calls = []
    inner = context_lib.splash_context_attention
    monkeypatch.setattr(context_lib, "splash_context_attention",
                        lambda *a, **kw: calls.append(kw["kind"]) or inner(*a, **kw))
    got = trainer.step(batch)
    assert calls == ["ring"]
    np.testing.assert_allclose(got["loss"], one["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], one["grad_norm"], rtol=1e-5)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
