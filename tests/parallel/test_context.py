"""Context-parallel attention (sequence split over the ``context`` axis) against
``jax.nn.dot_product_attention`` on unsharded inputs in natural order: the all-gather and
ring kinds, alone and with tensor, fsdp and an unused axis, forward and gradients; the
balanced layout with and without a sliding window; kv heads too few for the tensor axis;
which collectives each kind compiles to; and the balanced order itself."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.errors import JaxparError
from jaxpar.parallel.attention import KV_NAMES, Q_NAMES
from jaxpar.parallel.context import balanced_order, context_attention, inverse_order

B, S, N, KV, H = 2, 32, 4, 2, 8
MESHES = {
    "c2": {"context": 2},
    "c4": {"context": 4},
    "c2_tp2": {"context": 2, "tensor": 2},
    "c2_fsdp2_stage2": {"context": 2, "fsdp": 2, "stage": 2},  # stage: unused by attention
    "c2_tp4": {"context": 2, "tensor": 4},  # 2 kv heads do not divide tensor=4
}


@functools.cache
def _data():
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, S, N, H))
    k = jax.random.normal(keys[1], (B, S, KV, H))
    v = jax.random.normal(keys[2], (B, S, KV, H))
    ct = jax.random.normal(keys[3], (B, S, N, H))
    return tuple(np.asarray(x) for x in (q, k, v, ct))


@functools.cache
def _reference(window):
    """Output and (dq, dk, dv) of the XLA attention on the whole, naturally ordered input."""
    q, k, v, ct = _data()
    local = (window - 1, 0) if window else None

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads]


def laid_out(mesh, arrays, balanced: bool):
    """The fsdp_tp plan on ``mesh``, the query and key/value specs of ``arrays``' first
    two (q, k), the sequence order (balanced over the context axis, or natural) and the
    arrays (batch, seq, ...) put in that order."""
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    q_spec = plan.act_spec(Q_NAMES, shape=arrays[0].shape)
    kv_spec = plan.act_spec(KV_NAMES, shape=arrays[1].shape)
    seq = arrays[0].shape[1]
    order = (balanced_order(seq, mesh.shape["context"]) if balanced
             else np.arange(seq, dtype=np.int32))
    return plan, q_spec, kv_spec, order, tuple(x[:, order] for x in arrays)


def _mesh(name):
    axes = MESHES[name]
    return jaxpar.make_mesh(axes, devices=jax.devices()[:math.prod(axes.values())])


@functools.cache
def _context(kind, mesh_name, window, balanced):
    """(output, grads, compiled HLO text, (q_spec, kv_spec)) of context attention, the
    arrays back in natural order. Always called with all four arguments (one cache key)."""
    mesh = _mesh(mesh_name)
    plan, q_spec, kv_spec, order, (q, k, v, ct) = laid_out(mesh, _data(), balanced)
    undo = inverse_order(order)

    def loss(q, k, v, positions, ct):
        out = context_attention(q, k, v, positions, mesh=mesh, q_spec=q_spec,
                                kv_spec=kv_spec, kind=kind, window=window)
        return jnp.sum(out * ct), out

    put = lambda x, spec: jax.device_put(x, plan.sharding(spec))
    args = (put(q, q_spec), put(k, kv_spec), put(v, kv_spec), order, put(ct, q_spec))
    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    compiled = program.lower(*args).compile()
    (_, out), grads = compiled(*args)
    assert out.sharding.spec == q_spec or out.sharding.is_equivalent_to(
        plan.sharding(q_spec), out.ndim)
    return (np.asarray(out)[:, undo], [np.asarray(g)[:, undo] for g in grads],
            compiled.as_text(), (q_spec, kv_spec))


def _assert_matches(kind, mesh_name, window=0, balanced=False):
    out, grads, _, _ = _context(kind, mesh_name, window, balanced)
    want, want_grads = _reference(window)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    for g, w, name in zip(grads, want_grads, "qkv", strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6, err_msg=f"d{name}")


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("kind", ["allgather", "ring"])
def test_matches_reference_forward_and_gradients(kind, mesh_name):
    _assert_matches(kind, mesh_name)


@pytest.mark.parametrize("window,balanced", [(6, False), (0, True), (6, True)])
@pytest.mark.parametrize("kind", ["allgather", "ring"])
def test_windows_and_balanced_layout(kind, window, balanced):
    _assert_matches(kind, "c4", window, balanced)


def test_kv_heads_replicated_while_query_heads_split():
    _, _, _, (q_spec, kv_spec) = _context("ring", "c2_tp4", 0, False)
    assert q_spec[2] == "tensor" and kv_spec[2] is None  # the case under test


@pytest.mark.parametrize("kind,present,absent", [
    ("allgather", ("all-gather",), ("collective-permute",)),
    ("ring", ("collective-permute", "conditional"), ())])  # conditional: masked blocks skipped
def test_compiled_collectives(kind, present, absent):
    hlo = _context(kind, "c4", 0, False)[2]
    for op in present:
        assert op in hlo, op
    for op in absent:
        assert op not in hlo, op


def test_balanced_order_layout():
    order = balanced_order(16, 2)  # chunks of 4: device 0 holds 0 and 3, device 1: 1 and 2
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    np.testing.assert_array_equal(order[inverse_order(order)], np.arange(16))
    np.testing.assert_array_equal(balanced_order(6, 1), np.arange(6))


def test_balanced_order_needs_divisible_sequence():
    with pytest.raises(JaxparError, match=r"seq_len=30, context=4"):
        balanced_order(30, 4)


def test_bad_arguments():
    mesh = _mesh("c2")
    q, k, v, _ = _data()
    spec = jax.sharding.PartitionSpec(None, "context", None, None)
    call = functools.partial(context_attention, mesh=mesh, q_spec=spec, kv_spec=spec)
    with pytest.raises(JaxparError, match="kind"):
        call(q, k, v, np.arange(S), kind="tree")
    with pytest.raises(JaxparError, match="positions"):
        call(q, k, v, np.arange(S - 1))
    bad = jax.sharding.PartitionSpec(None, None, None, "context")
    with pytest.raises(JaxparError, match="head_dim"):
        context_attention(q, k, v, np.arange(S), mesh=mesh, q_spec=bad, kv_spec=bad)


@pytest.mark.parametrize("kind", ["allgather", "ring"])
def test_softcap_matches_a_capped_reference(kind):
    """Logit soft-capping (cap 0.5, below the scores' spread) on context=4 in the balanced
    layout with a window: outputs and gradients equal attention written out with the cap."""
    softcap, window = 0.5, 6
    q, k, v, ct = _data()

    def reference(q, k, v):
        group = N // KV
        kr, vr = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = softcap * jnp.tanh(jnp.einsum("bqnh,bknh->bnqk", q, kr) / np.sqrt(H) / softcap)
        query, key = np.arange(S)[:, None], np.arange(S)[None, :]
        keep = (key <= query) & (key > query - window)
        probs = jax.nn.softmax(jnp.where(keep, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bnqk,bknh->bqnh", probs, vr)
        return jnp.sum(out * ct), out

    mesh = _mesh("c4")
    spec = jax.sharding.PartitionSpec(None, "context", None, None)
    order = balanced_order(S, 4)
    undo = inverse_order(order)

    def capped(q, k, v):
        out = context_attention(q[:, order], k[:, order], v[:, order], order, mesh=mesh,
                                q_spec=spec, kv_spec=spec, kind=kind, window=window,
                                softcap=softcap)[:, undo]
        return jnp.sum(out * ct), out

    grads = functools.partial(jax.value_and_grad, argnums=(0, 1, 2), has_aux=True)
    (_, want), want_grads = jax.jit(grads(reference))(q, k, v)
    (_, got), got_grads = jax.jit(grads(capped))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, w, name in zip(got_grads, want_grads, "qkv", strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6, err_msg=f"d{name}")
    assert not np.allclose(want, _reference(window)[0], atol=1e-3)  # the cap bites
