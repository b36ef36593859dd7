"""Frozen-base storage: int8 quantization held to a NumPy absmax quantizer and to Flax's own
layers running the dequantized kernel, bfloat16 storage of matrices only, and the bytes
each dtype takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.adapters import quant
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.sharding.annotations import logical_names
from jaxpar.sharding.paths import path_str

TINY = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                         d_ff=24, max_seq_len=16)


def normal(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def np_quantize(w: np.ndarray, in_axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric absmax int8, one scale per slice along ``in_axes``."""
    scale = np.abs(w).max(axis=in_axes, keepdims=True) / 127.0
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale


def named(init_names):
    return nnx.with_partitioning(nnx.initializers.normal(1.0), init_names)


def layers() -> dict[str, nnx.Module]:
    """One of each projection kind, with biases and logical names."""
    with nnx.use_eager_sharding(False):
        return {
            "linear": nnx.Linear(6, 5, kernel_init=named(("embed", "mlp")),
                                 bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0)),
            "linear_general": nnx.LinearGeneral(
                (3, 4), 5, axis=(-2, -1), kernel_init=named(("heads", None, "embed")),
                bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(1)),
            "einsum": nnx.Einsum("bse,enh->bsnh", (6, 2, 3), (2, 3),
                                 kernel_init=named(("embed", "heads", None)),
                                 bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(2)),
        }


INPUTS = {"linear": (2, 4, 6), "linear_general": (2, 4, 3, 4), "einsum": (2, 4, 6)}
IN_AXES = {"linear": (0,), "linear_general": (0, 1), "einsum": (0,)}
SCALE_NAMES = {"linear": (None, "mlp"), "linear_general": (None, None, "embed"),
               "einsum": (None, "heads", None)}


# --- quantize_int8 ---------------------------------------------------------------------------


def test_quantize_int8_matches_numpy_absmax():
    w = normal((3, 8, 5))
    q, scale = quant.quantize_int8(jnp.asarray(w), (1,))
    want_q, want_scale = np_quantize(w, (1,))
    assert q.dtype == jnp.int8 and scale.shape == (3, 1, 5)
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
    np.testing.assert_array_equal(q, want_q)
    # Each slice's largest entry maps to +-127, and the rounding error is half a step.
    assert np.all(np.abs(np.asarray(q)).max(axis=1) == 127)
    assert np.all(np.abs(np.asarray(q) * np.asarray(scale) - w) <= np.asarray(scale) / 2 + 1e-7)


def test_an_all_zero_slice_quantizes_to_exact_zeros():
    w = np.zeros((4, 2), np.float32)
    w[:, 1] = [0.5, -1.0, 0.25, 0.0]
    q, scale = quant.quantize_int8(jnp.asarray(w), (0,))
    np.testing.assert_array_equal(q, [[0, 64], [0, -127], [0, 32], [0, 0]])
    back = np.asarray(q, np.float32) * np.asarray(scale)
    assert np.all(np.isfinite(back))
    np.testing.assert_array_equal(back[:, 0], 0.0)
    assert np.all(np.asarray(scale) > 0)  # a positive scale: no 0/0 on the way


# --- QuantizedProjection ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(INPUTS))
def test_quantized_layer_runs_the_dequantized_kernel(kind):
    layer = layers()[kind]
    w = np.asarray(layer.kernel[...])
    q = quant.QuantizedProjection(layer)
    assert q.kind == kind and q.is_linear == (kind == "linear")
    want_q, want_scale = np_quantize(w, IN_AXES[kind])
    np.testing.assert_array_equal(q.kernel[...], want_q)
    np.testing.assert_allclose(q.scale[...], want_scale, rtol=1e-6)
    np.testing.assert_allclose(q.dequantize(), want_q * want_scale, rtol=1e-6)
    # The reference: Flax's own layer with its kernel replaced by the dequantized one.
    reference = nnx.clone(layer)
    reference.kernel.set_value(jnp.asarray(want_q * want_scale))
    x = jnp.asarray(normal(INPUTS[kind], seed=3))
    np.testing.assert_allclose(q(x), reference(x), rtol=1e-5, atol=1e-5)
    err = float(jnp.abs(q(x) - layer(x)).max() / jnp.abs(layer(x)).max())
    assert 0 < err < 0.05, err


@pytest.mark.parametrize("kind", list(INPUTS))
def test_quantized_kernel_keeps_names_and_its_scale_drops_the_input_ones(kind):
    layer = layers()[kind]
    q = quant.QuantizedProjection(layer)
    assert isinstance(q.kernel, quant.QuantizedKernel) and not isinstance(q.kernel, nnx.Param)
    assert isinstance(q.scale, quant.QuantScale)
    assert logical_names(q.kernel) == logical_names(layer.kernel, layer.kernel.ndim)
    assert logical_names(q.scale) == SCALE_NAMES[kind]
    assert q.bias is layer.bias


@pytest.mark.parametrize("kind", list(INPUTS))
def test_to_float_gives_back_the_layer_kind(kind):
    layer = layers()[kind]
    q = quant.QuantizedProjection(layer)
    back = q.to_float()
    assert type(back) is type(layer)
    assert back.kernel[...].dtype == jnp.float32 and back.kernel.shape == layer.kernel.shape
    np.testing.assert_array_equal(back.kernel[...], q.dequantize())
    assert logical_names(back.kernel) == logical_names(q.kernel)
    x = jnp.asarray(normal(INPUTS[kind], seed=4))
    np.testing.assert_allclose(back(x), q(x), rtol=1e-5, atol=1e-5)
    if kind == "linear_general":
        assert (back.in_features, back.out_features, back.axis) == ((3, 4), (5,), (-2, -1))
    # Rebuilt around another kernel (zeros): only the bias is left.
    other = quant.rebuild_projection(q, jnp.zeros(layer.kernel.shape))
    y = np.asarray(other(x))
    np.testing.assert_array_equal(y, np.broadcast_to(np.asarray(layer.bias[...]), y.shape))


def test_a_stacked_kernel_gets_stacked_scales():
    # An attention output projection stacked over two layers, as nnx.vmap builds it.
    with nnx.use_eager_sharding(False):
        wo = nnx.Einsum("bsnh,nhe->bse", (4, 3, 16), rngs=nnx.Rngs(0))
        w = normal((2, 4, 3, 16), seed=5)
        wo.kernel = nnx.Param(jnp.asarray(w), out_sharding=("layers", "heads", "head_dim",
                                                            "embed"))
    q = quant.QuantizedProjection(wo)
    want_q, want_scale = np_quantize(w, (1, 2))
    assert q.scale.shape == (2, 1, 1, 16)
    np.testing.assert_allclose(q.scale[...], want_scale, rtol=1e-6)
    np.testing.assert_array_equal(q.kernel[...], want_q)
    assert logical_names(q.scale) == ("layers", None, None, "embed")


def test_projection_spec_of_each_kind_and_of_no_projection():
    got = {kind: quant.projection_spec(layer).equation for kind, layer in layers().items()}
    assert got == {"linear": "...i,io->...o", "linear_general": "...ab,abc->...c",
                   "einsum": "bse,enh->bsnh"}
    q = quant.QuantizedProjection(layers()["einsum"])
    assert quant.projection_spec(q).equation == "bse,enh->bsnh"
    with pytest.raises(jaxpar.JaxparError, match=r"Conv is not a projection \(nnx.Linear, "
                                                 r"nnx.LinearGeneral or nnx.Einsum\)"):
        quant.projection_spec(nnx.Conv(2, 2, kernel_size=(3,), rngs=nnx.Rngs(0)))
    late = nnx.Einsum("ab,bc->ac", (4, 3), rngs=nnx.Rngs(0))
    late.einsum_str = None  # the equation comes with each call
    with pytest.raises(jaxpar.JaxparError, match="equation is given at call time"):
        quant.projection_spec(late)


def test_is_tracing():
    assert not quant.is_tracing(jnp.ones(2))
    seen = []
    jax.jit(lambda x: seen.append(quant.is_tracing(x)) or x)(jnp.ones(2))
    assert seen == [True]


# --- converting a whole model ------------------------------------------------------------------


def abstract(convert) -> nnx.Module:
    """The small reference model after ``convert(model)``, built and converted abstractly
    (shapes and dtypes only: what is converted to what, not the numbers)."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: convert(Transformer(TINY, rngs=nnx.Rngs(0))))


def model_dtypes(model) -> dict[str, str]:
    return {path_str(p): str(v.get_value().dtype)
            for p, v in nnx.to_flat_state(nnx.state(model))}


def test_bfloat16_stores_matrices_only():
    before = model_dtypes(abstract(lambda m: m))
    returned = []
    skip = lambda path, var: path[0] == "lm_head"
    after = model_dtypes(abstract(
        lambda m: returned.append(quant.convert_frozen(m, "bfloat16", skip=skip) is m) or m))
    assert returned == [True]
    # Stacked norm scales (layers, embed) are vectors per layer: kept.
    assert after["blocks/attn_norm/scale"] == after["final_norm/scale"] == "float32"
    assert after["blocks/attn/wq/kernel"] == after["blocks/mlp/w_down/kernel"] == "bfloat16"
    assert after["embed"] == "bfloat16"
    assert after["lm_head/kernel"] == "float32"  # skipped
    assert {p for p in before if before[p] != after[p]} == {
        "embed", *(f"blocks/{n}/kernel" for n in ("attn/wq", "attn/wk", "attn/wv", "attn/wo",
                                                  "mlp/w_gate", "mlp/w_up", "mlp/w_down"))}


def test_bfloat16_leaves_lora_params_and_float32_leaves_everything():
    with nnx.use_eager_sharding(False):
        model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    model.adapter = nnx.LoRAParam(jnp.ones((4, 2)))
    before = jax.tree.map(np.asarray, nnx.state(model))
    assert quant.convert_frozen(model, "float32") is model
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model), before)
    quant.convert_frozen(model, "bfloat16")
    assert model.adapter[...].dtype == jnp.float32
    assert model.layers[0].kernel[...].dtype == jnp.bfloat16
    assert model.layers[0].bias[...].dtype == jnp.float32


def test_int8_replaces_projections_only_and_can_run_twice():
    seen = {}

    def convert(model):
        quant.convert_frozen(model, "int8", skip=lambda path, var: path_str(path)[:2] == "lm")
        seen["kinds"] = {path_str(p): type(m).__name__ for p, m in quant.projections(model)}
        wq = model.blocks.attn.wq
        quant.convert_frozen(model, "int8")  # converts the head, leaves the rest as it was
        seen["kept"] = model.blocks.attn.wq is wq
        return model

    model = abstract(convert)
    assert seen["kinds"] == {**{f"blocks/{n}": "QuantizedProjection"
                                for n in ("attn/wq", "attn/wk", "attn/wv", "attn/wo",
                                          "mlp/w_gate", "mlp/w_up", "mlp/w_down")},
                             "lm_head": "Linear"}
    assert seen["kept"] and isinstance(model.lm_head, quant.QuantizedProjection)
    dtypes = model_dtypes(model)
    assert dtypes["embed"] == dtypes["blocks/attn_norm/scale"] == "float32"
    assert dtypes["blocks/mlp/w_up/kernel"] == dtypes["lm_head/kernel"] == "int8"
    # (layers, embed, mlp): one scale per layer and output column.
    assert model.blocks.mlp.w_up.scale.shape == (2, 1, 24)


def test_unknown_base_dtype_is_named():
    with pytest.raises(jaxpar.JaxparError, match=r"unknown base_dtype 'int4'; choose one of "
                                                 r"\('float32', 'bfloat16', 'int8'\)"):
        quant.convert_frozen(nnx.Sequential(), "int4")


def test_describe_storage_counts_bytes_by_dtype():
    model = nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 2, use_bias=False,
                                                                          rngs=nnx.Rngs(1)))
    # Kernels 12 + 6 floats, one bias of 3: 21 x 4 bytes.
    assert quant.describe_storage(model) == {"float32": 84}
    quant.convert_frozen(model, "int8")
    # int8 kernels 12 + 6 bytes; float32 scales (1, 3) and (1, 2) and the bias: 8 x 4 bytes.
    assert quant.describe_storage(model) == {"int8": 18, "float32": 32}


def test_llm_int8_keeps_outlier_features_exact_where_row_wise_int8_loses_them():
    """Activations with a few feature columns 20x larger than the rest (the emergent
    outliers of LLM.int8): row-wise int8 quantization of the input loses the small
    features next to them; LLM.int8 multiplies the outlier columns in floats and the rest
    in int8 (an int32-accumulated einsum on int8 operands), several times closer
    to the float projection (4x on this draw)."""
    from jaxpar.adapters.quant import QuantizedProjection, llm_int8

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 16, 64)).astype(np.float32)
    x[..., [3, 40]] *= 60.0
    layer = nnx.Einsum("bse,enh->bsnh", (64, 4, 8), rngs=nnx.Rngs(0))
    want = np.asarray(layer(x))

    class Holder(nnx.Module):
        def __init__(self):
            self.proj = nnx.Einsum("bse,enh->bsnh", (64, 4, 8), rngs=nnx.Rngs(0))

    plain = Holder()
    from jaxpar.adapters.quant import convert_frozen
    convert_frozen(plain, "int8")
    mixed = llm_int8(Holder())
    assert isinstance(mixed.proj, QuantizedProjection) and mixed.proj.outlier_threshold == 6.0

    def row_wise(proj, x):  # what LLM.int8 improves on: every column quantized per row
        s = np.abs(x).max(axis=-1, keepdims=True) / 127
        return proj(np.round(x / s) * s)

    err = lambda got: np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want)  # noqa: E731
    assert err(mixed.proj(x)) < 0.02
    assert err(row_wise(plain.proj, x)) > 3 * err(mixed.proj(x))
    text = jax.jit(lambda m, x: m.proj(x)).lower(mixed, x).as_text()
    assert "xi8>, tensor<" in text and "-> tensor<4x16x4x8xi32>" in text
