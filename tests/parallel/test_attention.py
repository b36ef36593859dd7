"""Attention implementations against ``jax.nn.dot_product_attention``'s XLA lowering: the
chunked (online-softmax, custom-gradient) one in forward and gradients, alone and inside the
reference model under sharding, and its compiled temporary memory at a long sequence; the
splash (Pallas TPU) kernel, run here in Pallas interpret mode, alone, inside ``shard_map``
over a mesh (each device on its batch and head slice) and inside the sharded model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.errors import JaxparError
from jaxpar.models.transformer import Transformer, TransformerConfig
from jaxpar.parallel import attention as attention_lib
from jaxpar.parallel.attention import attention, chunked_attention, resolve, splash_attention
from jaxpar.sharding.rules import Rules
from jaxpar.training.objective import lm_loss


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
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, want), want_grads = loss("xla")
    (_, got), got_grads = loss("chunked")
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for g, w, name in zip(got_grads, want_grads, "qkv", strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=f"d{name}")


@functools.cache
def _sharded_model_loss_and_grads(impl):
    """Loss and gradients of a small model on fsdp=4 x tensor=2 with ``impl`` attention."""
    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=64, max_seq_len=32, attention=impl, attention_block=8)
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp")
    tokens = jax.random.randint(jax.random.key(1), (4, 25), 0, 64)
    model = jaxpar.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), plan)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        return lm_loss(nnx.merge(graphdef, params), tokens)

    with plan.activate(mesh_context=True):
        return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("blockwise", ["chunked", "splash"])
def test_blockwise_inside_the_sharded_model_equals_xla(blockwise):
    loss_x, grads_x = _sharded_model_loss_and_grads("xla")
    loss_c, grads_c = _sharded_model_loss_and_grads(blockwise)
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


def test_implementation_choice(monkeypatch):
    assert resolve("auto", jnp.float32) == "xla"  # on this CPU backend
    assert resolve("chunked", jnp.float32) == "chunked"
    assert resolve("splash", jnp.bfloat16) == "splash"
    TransformerConfig(attention="splash")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve("auto", jnp.bfloat16) == resolve("auto", jnp.float32) == "splash"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve("auto", jnp.bfloat16) == "cudnn"
    assert resolve("auto", jnp.float32) == "xla"
    with pytest.raises(JaxparError, match="model.attention='flash'"):
        resolve("flash", jnp.float32)
    with pytest.raises(JaxparError, match="model.attention='flash'"):
        TransformerConfig(attention="flash")


# --- splash (Pallas kernel; interpret mode on this CPU backend) ---------------------------
def _xla_and(impl, q, k, v, ct, **kw):
    """Forward outputs and (dq, dk, dv) of XLA's attention and of ``impl``, jitted."""
    def run(impl):
        def f(q, k, v):
            out = attention(q, k, v, implementation=impl, **kw)
            return jnp.sum(out * ct), out
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return run("xla"), run(impl)


def _assert_same(got, want):
    (_, got), got_grads = got
    (_, want), want_grads = want
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    for g, w, name in zip(got_grads, want_grads, "qkv", strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-5, err_msg=f"d{name}")


# Shapes: (batch, seq, heads, kv_heads, head_dim), window, block. Seq 200 and 130 are padded
# to 256 (two 128-tiles: the causal block skipping is exercised); block 512 on 256 -> 256.
@pytest.mark.parametrize("shape,window,block", [
    ((1, 200, 4, 2, 8), 0, 128),    # GQA, padded, two tiles
    ((1, 256, 2, 1, 8), 50, 128),   # MQA-like (one kv head), sliding window across tiles
    ((2, 130, 2, 2, 8), 0, 512),    # MHA, batch 2, padded, one 256 tile
], ids=["gqa-pad", "window", "mha-bigblock"])
def test_splash_equals_xla_forward_and_gradients(shape, window, block):
    b, s, n, kv, h = shape
    q, k, v, ct = _qkv(b, s, n, kv, h)
    want, got = _xla_and("splash", q, k, v, ct, window=window, block=block)
    _assert_same(got, want)


@pytest.mark.parametrize("kv_heads,explicit", [(2, False), (1, True)],
                         ids=["kv-split-like-heads", "kv-repeated-explicit-mesh"])
def test_splash_in_shard_map_splits_batch_and_heads(monkeypatch, kv_heads, explicit):
    """Under a plan each device runs the kernel on its own batch and head slice: batch 4
    over fsdp=4, 4 query heads over tensor=2; one kv head (too few to split) is repeated."""
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2}, explicit=explicit)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    q, k, v, ct = _qkv(4, 140, 4, kv_heads, 8)
    local_shapes = []
    inner = attention_lib._splash_local

    def spy(q, k, v, segments, **kw):
        local_shapes.append((q.shape, k.shape, v.shape))
        return inner(q, k, v, segments, **kw)

    monkeypatch.setattr(attention_lib, "_splash_local", spy)
    with plan.activate(mesh_context=True):
        want, got = _xla_and("splash", q, k, v, ct, window=30, block=128)
    _assert_same(got, want)
    out_spec = plan.act_spec(("batch", "seq", "heads", "head_dim"))
    assert got[0][1].sharding.is_equivalent_to(plan.sharding(out_spec), 4)
    assert set(local_shapes) == {((1, 140, 2, 8), (1, 140, 1, 8), (1, 140, 1, 8))}


def test_splash_without_a_plan_does_not_shard(monkeypatch):
    calls = []
    monkeypatch.setattr(jax, "shard_map", lambda *a, **kw: calls.append(a))
    q, k, v, _ = _qkv(1, 128, 2, 1, 8)
    out = jax.eval_shape(lambda q, k, v: splash_attention(q, k, v), q, k, v)
    assert out.shape == q.shape and not calls


@pytest.mark.parametrize("rule,message", [
    (("seq", "fsdp"), "queries along seq over fsdp"),
    (("head_dim", "tensor"), "queries along head_dim over tensor"),
], ids=["seq", "head_dim"])
def test_splash_refuses_a_split_sequence_or_head_dim(rule, message):
    _, acts = jaxpar.sharding.rules.preset("fsdp_tp")
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp")
    plan = plan.replace(act_rules=Rules([rule, *acts.rules]))
    q, k, v, _ = _qkv(4, 128, 4, 2, 8)
    with plan.activate(), pytest.raises(JaxparError, match=message):
        jax.eval_shape(lambda q, k, v: attention(q, k, v, implementation="splash"), q, k, v)


def test_splash_tiles_and_interpret_default(monkeypatch):
    tile = attention_lib.splash_tile
    assert (tile(128, 512), tile(256, 512), tile(384, 512), tile(1024, 512)) == (
        128, 256, 384, 512)
    assert tile(640, 512) == 128 and tile(1024, 100) == 128  # 640 = 5 x 128
    seen = []
    monkeypatch.setattr(attention_lib, "_splash_local",
                        lambda q, k, v, seg, **kw: seen.append(kw["interpret"]) or q)
    q, k, v, _ = _qkv(1, 128, 2, 1, 8)
    splash_attention(q, k, v)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    splash_attention(q, k, v)
    assert seen == [True, False]  # interpret mode off a TPU only


def _documents_one_by_one(q, k, v, segments, ct):
    """Outputs and (dq, dk, dv) of XLA's attention run on each document alone (one jitted
    program: op by op, every document's shapes compiled their own kernels)."""
    segments = np.asarray(segments)

    def f(q, k, v):
        outs = []
        for row in range(q.shape[0]):
            ids = segments[row]
            out = jnp.zeros_like(q[row])
            for doc in np.unique(ids):
                at = np.flatnonzero(ids == doc)
                one = attention(q[row:row + 1, at], k[row:row + 1, at], v[row:row + 1, at],
                                implementation="xla")[0]
                out = out.at[at].set(one)
            outs.append(out)
        out = jnp.stack(outs)
        return jnp.sum(out * ct), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)


@functools.cache
def _packed_documents():
    """(q, k, v, ct, segments, every document run alone) of the rows below, computed once
    for every implementation."""
    q, k, v, ct = _qkv(2, 130, 4, 2, 8)
    segments = jnp.asarray(np.stack([np.repeat([1, 2, 3], [50, 40, 40]),
                                     np.repeat([5, 9], [7, 123])]), jnp.int32)
    return q, k, v, ct, segments, _documents_one_by_one(q, k, v, segments, ct)


@pytest.mark.parametrize("impl,block", [("xla", 0), ("chunked", 8), ("chunked", 64),
                                        ("splash", 128)])
def test_packed_documents_never_attend_to_each_other(impl, block):
    """Rows packing three documents (lengths 50/40/40 and 7/123): each implementation's
    outputs and gradients equal running every document alone."""
    q, k, v, ct, segments, want = _packed_documents()

    def f(q, k, v):
        out = attention(q, k, v, implementation=impl, segments=segments,
                        **({"block": block} if block else {}))
        return jnp.sum(out * ct), out

    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _assert_same(got, want)


@pytest.mark.parametrize("kind", ["allgather", "ring"])
def test_packed_documents_stay_apart_under_context_parallelism(devices, kind):
    """The sequence split over context=4 (32 positions a device), documents crossing the
    split: the segment ids travel with the keys (gathered, or round the ring), and the
    outputs and gradients equal every document run alone."""
    from jax.sharding import PartitionSpec as P

    from jaxpar.parallel.context import context_attention

    q, k, v, ct = _qkv(2, 128, 4, 2, 8)
    segments = jnp.asarray(np.stack([np.repeat([1, 2, 3], [50, 40, 38]),
                                     np.repeat([5, 9], [7, 121])]), jnp.int32)
    want = _documents_one_by_one(q, k, v, segments, ct)
    mesh = jaxpar.make_mesh({"data": 2, "context": 4})
    spec = P("data", "context", None, None)

    def f(q, k, v):
        out = context_attention(q, k, v, jnp.arange(128), mesh=mesh, q_spec=spec,
                                kv_spec=spec, kind=kind, segments=segments)
        return jnp.sum(out * ct), out

    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _assert_same(got, want)


def test_cudnn_refuses_document_masks():
    q, k, v, _ = _qkv(1, 16, 2, 1, 8)
    with pytest.raises(JaxparError, match="'cudnn' does not take document masks"):
        attention(q, k, v, implementation="cudnn", segments=jnp.zeros((1, 16), jnp.int32))


# --- attention logit soft-capping -----------------------------------------------------------
def _capped_reference(q, k, v, *, softcap, window=0, segments=None):
    """Causal attention written out: scores scaled by 1/sqrt(head_dim), capped to
    ``softcap * tanh(scores / softcap)``, masked (causal, window, segments), softmax."""
    b, s, n, h = q.shape
    group = n // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(h)
    scores = softcap * jnp.tanh(scores / softcap)
    query, key = np.arange(s)[:, None], np.arange(s)[None, :]
    keep = (key <= query) & ((key > query - window) if window else True)
    keep = jnp.asarray(keep)[None, None]
    if segments is not None:
        keep = keep & (segments[:, None, :, None] == segments[:, None, None, :])
    probs = jax.nn.softmax(jnp.where(keep, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", probs, v)


def _capped_and(run, q, k, v, ct, **kw):
    """Outputs and (dq, dk, dv) of :func:`_capped_reference` and of ``run``, jitted."""
    def grads(fn):
        def f(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(out * ct), out
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return grads(functools.partial(_capped_reference, **kw)), grads(run)


def _two_documents(b, s):
    return jnp.asarray(np.stack([np.repeat([1, 2], [s // 3, s - s // 3])] * b), jnp.int32)


@pytest.mark.parametrize("impl,window,documents,block", [
    ("xla", 0, False, 0), ("xla", 5, True, 0),
    ("chunked", 0, False, 8), ("chunked", 5, False, 16), ("chunked", 7, True, 8)])
def test_softcap_equals_the_written_out_reference(impl, window, documents, block):
    """Scores near the cap (q, k ~ 2 N(0, 1), head_dim 16: scores ~ 4, cap 3): forward and
    gradients (the chunked backward's own ``1 - tanh^2``) equal the plain-JAX reference."""
    q, k, v, ct = _qkv()
    segments = _two_documents(q.shape[0], q.shape[1]) if documents else None
    kw = {"window": window, "segments": segments, "softcap": 3.0}
    run = functools.partial(attention, implementation=impl, **kw,
                            **({"block": block} if block else {}))
    want, got = _capped_and(run, q, k, v, ct, **kw)
    _assert_same(got, want)
    uncapped = attention(q, k, v, implementation=impl, window=window, segments=segments)
    assert not np.allclose(uncapped, want[0][1], atol=1e-2)  # the cap changes the output


def test_splash_softcap_equals_the_written_out_reference():
    """The kernel's own cap (interpret mode), with a window across tiles and documents."""
    q, k, v, ct = _qkv(1, 256, 4, 2, 8)
    kw = {"window": 50, "segments": _two_documents(1, 256), "softcap": 3.0}
    run = functools.partial(splash_attention, block=128, **kw)
    want, got = _capped_and(run, q, k, v, ct, **kw)
    _assert_same(got, want)


def test_softcap_refusals_and_auto_choice(monkeypatch):
    q, k, v, _ = _qkv(1, 16, 2, 1, 8)
    with pytest.raises(JaxparError, match="'cudnn' does not take model.attn_logit_softcap"):
        attention(q, k, v, implementation="cudnn", softcap=50.0)
    with pytest.raises(JaxparError, match="softcap=-1.0: must be 0"):
        attention(q, k, v, implementation="chunked", softcap=-1.0)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve("auto", jnp.bfloat16, softcap=50.0) == "xla"
    assert resolve("auto", jnp.bfloat16) == "cudnn"
