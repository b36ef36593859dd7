"""LoRA on any projection: nnx.LinearGeneral (all of nnx.MultiHeadAttention), nnx.Einsum,
attribute reads through the wrapper, and errors for matched modules LoRA cannot adapt.

The models are plain Flax NNX, written as a user would (no jaxpar calls inside).
"""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import jaxpar
from jaxpar.adapters import lora, quant
from jaxpar.sharding.partitioning import logical_names
from jaxpar.sharding.paths import path_str

D, HEADS, FF_GROUPS, FF = 32, 4, 2, 16
BATCH, SEQ, RANK = 8, 4, 2
TARGET = r"attn|up$|down$|mix$"  # "attn" also matches the attention container itself
PROJ = ("attn/query", "attn/key", "attn/value", "attn/out", "up", "down", "mix")


class Block(nnx.Module):
    """Attention + a LinearGeneral MLP + an Einsum, annotated the way Flax allows: the
    attention kernels get two names for three dimensions (trailing one unnamed)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.15)
        part = lambda names: nnx.with_partitioning(init, names)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=D, qkv_features=D, decode=False,
            kernel_init=part(("embed", "heads")), bias_init=nnx.initializers.normal(0.1),
            rngs=rngs)
        self.up = nnx.LinearGeneral(D, (FF_GROUPS, FF), kernel_init=part(("embed", None, "mlp")),
                                    bias_init=nnx.initializers.normal(0.1), rngs=rngs)
        self.down = nnx.LinearGeneral((FF_GROUPS, FF), D, axis=(-2, -1),
                                      kernel_init=part((None, "mlp", "embed")), rngs=rngs)
        self.mix = nnx.Einsum("bsd,de->bse", (D, D), (D,), kernel_init=part(("embed", "mlp")),
                              rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + self.attn(x)
        h = h + self.down(jax.nn.gelu(self.up(h)))
        return self.mix(h)


def make_block() -> Block:
    with nnx.use_eager_sharding(False):
        return Block(nnx.Rngs(0))


def inputs(seed: int = 0, shape: tuple[int, ...] = (BATCH, SEQ, D)) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def randomize_b(model: nnx.Module, seed: int = 1, std: float = 0.2) -> None:
    rng = np.random.default_rng(seed)
    for _, m in lora.adapted(model):
        m.lora_b.set_value(jnp.asarray(rng.normal(0, std, m.lora_b.shape), jnp.float32))


def by_hand(lp: lora.LoraProjection, x: np.ndarray, n_in: int) -> np.ndarray:
    """``x @ A @ B * alpha / rank`` with the last ``n_in`` input axes flattened."""
    a = np.asarray(lp.lora_a[...]).reshape(-1, lp.rank)
    b = np.asarray(lp.lora_b[...]).reshape(lp.rank, -1)
    flat = x.reshape(*x.shape[:x.ndim - n_in], -1)
    return (flat @ a @ b) * lp.alpha / lp.rank


def test_fresh_adapters_give_base_outputs_and_delta_is_the_low_rank_update():
    x = inputs()
    base = make_block()
    ref = base(x)
    model = lora.apply(nnx.clone(base), target=TARGET, rank=RANK, alpha=4.0)
    assert sorted(p for p, _ in lora.adapted(model)) == sorted(PROJ)
    np.testing.assert_array_equal(model(x), ref)  # B = 0: exactly the base model

    ad = dict(lora.adapted(model))
    q, o = ad["attn/query"], ad["attn/out"]
    assert q.lora_a.shape == (D, RANK) and q.lora_b.shape == (RANK, HEADS, D // HEADS)
    assert o.lora_a.shape == (HEADS, D // HEADS, RANK) and o.lora_b.shape == (RANK, D)
    # names shorter than the kernel are padded with None; adapters inherit them
    assert logical_names(q.lora_a) == ("embed", "lora_rank")
    assert logical_names(q.lora_b) == ("lora_rank", "heads", None)
    assert logical_names(o.lora_a) == ("embed", "heads", "lora_rank")

    randomize_b(model)
    xn = np.asarray(x)
    heads_in = xn.reshape(BATCH, SEQ, HEADS, D // HEADS)
    ff_in = xn.reshape(BATCH, SEQ, FF_GROUPS, FF)
    for name, arg, n_in, out_shape in [
        ("attn/query", xn, 1, (BATCH, SEQ, HEADS, D // HEADS)),
        ("attn/out", heads_in, 2, (BATCH, SEQ, D)),  # contracts the input's last two axes
        ("up", xn, 1, (BATCH, SEQ, FF_GROUPS, FF)),
        ("down", ff_in, 2, (BATCH, SEQ, D)),
        ("mix", xn, 1, (BATCH, SEQ, D)),
    ]:
        lp = ad[name]
        got = np.asarray(lp(jnp.asarray(arg)) - lp.base(jnp.asarray(arg)))
        want = by_hand(lp, arg, n_in).reshape(out_shape)
        assert np.abs(want).max() > 0.05, name
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(lp.delta(jnp.asarray(arg))), want, atol=1e-5,
                                   rtol=1e-5, err_msg=name)

    adapted_out = model(x)
    assert not np.allclose(adapted_out, ref, atol=1e-3)
    merged = lora.merge(nnx.clone(model))
    assert not lora.adapted(merged)
    assert type(merged.attn.out) is nnx.LinearGeneral and type(merged.mix) is nnx.Einsum
    assert merged.attn.out.kernel.shape == base.attn.out.kernel.shape
    np.testing.assert_allclose(merged(x), adapted_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw,x_shape", [
    ({"in_features": 6, "out_features": (2, 3)}, (2, 3, 6)),
    ({"in_features": (3, 6), "out_features": 5, "axis": (-2, -1)}, (2, 4, 3, 6)),
    ({"in_features": (4, 6), "out_features": 5, "axis": (-1, -3)}, (2, 4, 3, 6)),
    ({"in_features": 2, "out_features": 5, "axis": 0}, (2, 7, 3)),
    ({"in_features": 3, "out_features": (5,), "axis": 1, "batch_axis": {0: 2}}, (2, 3, 4, 7)),
])
def test_linear_general_axes_float_and_int8(kw, x_shape):
    x = inputs(3, x_shape)
    layer = nnx.LinearGeneral(**kw, bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(0))
    ref = layer(x)
    spec = quant.projection_spec(layer)
    bias = layer.bias[...].reshape(
        ref.shape[:len(kw.get("batch_axis", {}))] + (1,) * (ref.ndim - layer.bias.ndim)
        + tuple(layer.out_features))
    np.testing.assert_allclose(jnp.einsum(spec.equation, x, layer.kernel[...]) + bias, ref,
                               atol=1e-5, rtol=1e-5)
    for base_dtype in ("float32", "int8"):
        model = lora.apply(nnx.Sequential(nnx.clone(layer)), target=".", rank=RANK,
                           base_dtype=base_dtype)
        fresh = model(x)
        if base_dtype == "float32":
            np.testing.assert_array_equal(fresh, ref)
        else:
            assert isinstance(model.layers[0].base, quant.QuantizedProjection)
            err = float(jnp.abs(fresh - ref).max() / jnp.abs(ref).max())
            assert 0 < err < 0.05, err
        randomize_b(model)
        unmerged = model(x)
        assert not np.allclose(unmerged, fresh, atol=1e-3)
        merged = lora.merge(model)
        assert type(merged.layers[0]) is nnx.LinearGeneral
        assert merged.layers[0].kernel.shape == layer.kernel.shape
        np.testing.assert_allclose(merged(x), unmerged, atol=1e-5, rtol=1e-5)


def test_int8_attention_base_merges():
    x = inputs()
    base = make_block()
    ref = base(x)
    model = lora.apply(nnx.clone(base), target=TARGET, rank=RANK, base_dtype="int8")
    q = dict(lora.adapted(model))["attn/query"].base
    assert isinstance(q, quant.QuantizedProjection) and q.kind == "linear_general"
    assert q.kernel[...].dtype == jnp.int8 and q.scale.shape == (1, HEADS, D // HEADS)
    assert logical_names(q.kernel) == ("embed", "heads", None)
    err = float(jnp.abs(model(x) - ref).max() / jnp.abs(ref).max())
    assert 0 < err < 0.05, err
    randomize_b(model)
    unmerged = model(x)
    merged = lora.merge(model)
    assert type(merged.attn.query) is nnx.LinearGeneral
    assert merged.attn.query.kernel[...].dtype == jnp.float32
    np.testing.assert_allclose(merged(x), unmerged, atol=1e-4, rtol=1e-4)


def test_training_on_a_mesh_changes_only_adapters(devices):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp")
    model = jaxpar.init_sharded(lambda: lora.apply(make_block(), target=TARGET, rank=RANK),
                                plan)
    sp = {path_str(p): tuple(v.get_value().sharding.spec)
          for p, v in nnx.to_flat_state(nnx.state(model))}
    assert sp["attn/query/lora_a"][:1] == ("fsdp",)
    assert sp["attn/query/lora_b"][:2] == (None, "tensor")
    assert sp["attn/out/lora_a"][:2] == ("fsdp", "tensor")
    assert sp["down/lora_a"][:2] == (None, "tensor")
    before = jax.tree.map(np.asarray, nnx.state(model))
    target = inputs(7)

    def loss_fn(m, batch):
        return jnp.mean((m(batch) - target) ** 2)

    trainer = jaxpar.Trainer(model, optax.adam(1e-2), plan, trainable=nnx.LoRAParam,
                             loss_fn=loss_fn)
    losses = [trainer.step(np.asarray(inputs()))["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    after = nnx.to_flat_state(jax.tree.map(np.asarray, nnx.state(trainer.model)))
    changed = []
    for (path, b), (_, a) in zip(nnx.to_flat_state(before), after, strict=True):
        if not np.array_equal(b.get_value(), a.get_value()):
            changed.append(path_str(path))
            assert type(b) is nnx.LoRAParam, path_str(path)
    assert {p.rsplit("/", 1)[0] for p in changed} == set(PROJ)


class Reader(nnx.Module):
    """Model code that reads attributes of its projections at call time."""

    def __init__(self, rngs: nnx.Rngs):
        self.proj = nnx.Linear(8, 6, rngs=rngs)
        self.gen = nnx.LinearGeneral(8, (2, 3), use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        assert self.proj.use_bias and self.proj.in_features == 8
        width = self.proj.kernel.shape[-1]
        y = self.proj(x).reshape(*x.shape[:-1], width // 2, 2).sum(-1)
        g = self.gen(x).reshape(*x.shape[:-1], math.prod(self.gen.out_features))
        return y * self.proj.bias[...][: width // 2] + g.sum(-1, keepdims=True)


def test_wrapped_layer_attributes_read_through():
    x = inputs(0, (4, 8))
    base = Reader(nnx.Rngs(0))
    ref = base(x)
    model = lora.apply(nnx.clone(base), target=".", rank=RANK)
    lp = model.proj
    assert isinstance(lp, lora.LoraProjection) and isinstance(model.gen, lora.LoraProjection)
    assert lp.kernel is lp.base.kernel and lp.out_features == 6
    assert model.gen.axis == (-1,) and model.gen.batch_axis == {}
    assert lp.rank == RANK  # its own attributes come first
    for missing in ("no_such_attribute", "_private", "__deepcopy_hook__"):
        with pytest.raises(AttributeError):
            getattr(lp, missing)
    np.testing.assert_array_equal(model(x), ref)
    graphdef, state = nnx.split(model)
    jitted = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))
    np.testing.assert_allclose(jitted(state, x), ref, atol=1e-6)
    randomize_b(model)
    np.testing.assert_allclose(jitted(nnx.state(model), x), model(x), atol=1e-5)
    copied = copy.deepcopy(model)  # copying / graph traversal never see forwarded names
    np.testing.assert_array_equal(copied(x), model(x))
    model.eval()
    assert lp.deterministic and "deterministic" not in vars(lp.base)


class Custom(nnx.Module):
    """Holds parameters itself (one in a list), but is no projection."""

    def __init__(self, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.normal()(rngs.params(), (8, 8)))
        self.extra = nnx.List([nnx.Param(jnp.ones((8,)))])

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...] + self.extra[0][...]


class Mixed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.conv = nnx.Conv(8, 8, kernel_size=(3,), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
                                           rngs=rngs)
        self.custom = Custom(rngs)
        self.head = nnx.Linear(8, 16, rngs=rngs)


def test_matched_modules_that_cannot_be_adapted_are_errors():
    def attempt(target: str) -> Mixed:
        model = Mixed(nnx.Rngs(0))
        lora.apply(model, target=target, rank=RANK)
        return model

    with pytest.raises(jaxpar.JaxparError) as info:
        attempt(r"conv|embed")
    msg = str(info.value)
    assert "conv (flax.nnx.nn.linear.Conv)" in msg and "embed (flax.nnx.nn.linear.Embed)" in msg
    assert "Adaptable paths" in msg and "'head'" in msg and "'attn/query'" in msg
    with pytest.raises(jaxpar.JaxparError, match=r"custom \(.*Custom\)"):
        attempt("custom")
    # everything: each unadaptable holder is listed, the attention container is not, and
    # the model is left untouched
    model = Mixed(nnx.Rngs(0))
    with pytest.raises(jaxpar.JaxparError) as info:
        lora.apply(model, target=".", rank=RANK)
    listed = str(info.value).split("Adaptable paths")[0]
    assert all(f"{n} (" in listed for n in ("embed", "conv", "custom"))
    assert "attn (" not in listed and "head (" not in listed
    assert not lora.adapted(model)
    # a regex matching the attention container and its projections adapts the projections
    model = attempt("attn")
    assert sorted(p for p, _ in lora.adapted(model)) == [
        "attn/key", "attn/out", "attn/query", "attn/value"]
    assert [p for p, _ in lora.adapted(attempt("head|attn/out"))] == ["attn/out", "head"]


def test_partition_spec_and_short_metadata():
    with nnx.use_eager_sharding(False):
        layer = nnx.Linear(8, 4, kernel_metadata={"out_sharding": PartitionSpec("embed")},
                           rngs=nnx.Rngs(0))
        gen = nnx.LinearGeneral(8, (2, 4), kernel_metadata={
            "out_sharding": PartitionSpec(None, ("heads", "kv_heads"))}, rngs=nnx.Rngs(0))
    assert jaxpar.logical_names(layer.kernel, 2) == ("embed", None)
    model = lora.apply(nnx.Sequential(layer, gen), target=".", rank=RANK)
    lp, lg = model.layers
    assert logical_names(lp.lora_a) == ("embed", "lora_rank")
    assert logical_names(lp.lora_b) == ("lora_rank", None)
    assert logical_names(lg.lora_b) == ("lora_rank", ("heads", "kv_heads"), None)
    q = lora.apply(nnx.Sequential(nnx.clone(layer)), target=".", base_dtype="int8")
    assert logical_names(q.layers[0].base.kernel) == ("embed", None)
    bf = quant.convert_frozen(nnx.Sequential(nnx.clone(layer)), "bfloat16")
    assert bf.layers[0].kernel[...].dtype == jnp.bfloat16  # a matrix despite one name


def test_a_target_matching_a_layer_lora_cannot_adapt_says_how_to_narrow_it():
    class EmbedAndProject(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(16, 8, rngs=rngs)
            self.proj = nnx.Linear(8, 8, rngs=rngs)

    model = EmbedAndProject(nnx.Rngs(0))
    with pytest.raises(jaxpar.JaxparError, match=r"embed \(flax.*anchor it with '\$'"):
        lora.apply(model, "embed|proj", rank=2)
    with pytest.raises(jaxpar.JaxparError, match=r"embed \(flax.*; leave them out of the regex\. "
                                          r"Adaptable paths: \['proj'\]"):
        lora.apply(model, "embed$", rank=2)
