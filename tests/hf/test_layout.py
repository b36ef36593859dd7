"""Where each decoder weight lives in a Hugging Face checkpoint: the list of tensors against
the model's own parameters and PyTorch's ``(out, in)`` shapes, the reshape and transpose
between the layouts checked element by element, and slices of the stored tensor that cover
exactly the part of the view a device holds."""

import dataclasses
import itertools

import numpy as np
import pytest
from flax import nnx

from jaxpar.checkpoint.reshard import flat_paths
from jaxpar.hf.layout import Tensor, layer_name, source_slices, tensors
from jaxpar.models.config import TransformerConfig
from jaxpar.models.transformer import Transformer

CFG = TransformerConfig(vocab_size=40, d_model=12, n_layers=3, n_heads=3, n_kv_heads=1,
                        head_dim=6, d_ff=20, max_seq_len=16)
VARIANTS = {"llama": {}, "qwen": dict(qkv_bias=True, qk_norm=True),
            "tied": dict(tie_embeddings=True)}


def _by_path(cfg: TransformerConfig) -> dict[str, Tensor]:
    return {t.path: t for t in tensors(cfg)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_model_parameter_has_one_tensor_of_its_shape(variant):
    cfg = dataclasses.replace(CFG, **VARIANTS[variant])
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = {k: v.shape for k, v in flat_paths(nnx.state(model, nnx.Param)).items()}
    listed = _by_path(cfg)
    assert len(listed) == len(tensors(cfg))  # no path twice
    assert set(listed) == set(params)
    for path, t in listed.items():
        want = (cfg.n_layers, *t.jaxpar_shape) if t.per_layer else t.jaxpar_shape
        assert params[path] == want, path
        assert int(np.prod(t.shape)) == int(np.prod(t.view)), path


def test_names_and_pytorch_shapes():
    d, h, n, k, f, v = 12, 6, 3, 1, 20, 40
    want = [
        ("model.embed_tokens.weight", (v, d)),
        ("model.layers.{i}.input_layernorm.weight", (d,)),
        ("model.layers.{i}.self_attn.q_proj.weight", (n * h, d)),
        ("model.layers.{i}.self_attn.q_proj.bias", (n * h,)),
        ("model.layers.{i}.self_attn.k_proj.weight", (k * h, d)),
        ("model.layers.{i}.self_attn.k_proj.bias", (k * h,)),
        ("model.layers.{i}.self_attn.v_proj.weight", (k * h, d)),
        ("model.layers.{i}.self_attn.v_proj.bias", (k * h,)),
        ("model.layers.{i}.self_attn.o_proj.weight", (d, n * h)),
        ("model.layers.{i}.self_attn.q_norm.weight", (h,)),
        ("model.layers.{i}.self_attn.k_norm.weight", (h,)),
        ("model.layers.{i}.post_attention_layernorm.weight", (d,)),
        ("model.layers.{i}.mlp.gate_proj.weight", (f, d)),
        ("model.layers.{i}.mlp.up_proj.weight", (f, d)),
        ("model.layers.{i}.mlp.down_proj.weight", (d, f)),
        ("model.norm.weight", (d,)),
        ("lm_head.weight", (v, d)),
    ]
    got = [(t.name, t.shape) for t in tensors(dataclasses.replace(CFG, **VARIANTS["qwen"]))]
    assert got == want
    tied = [t.name for t in tensors(dataclasses.replace(CFG, tie_embeddings=True))]
    assert "lm_head.weight" not in tied and len(tied) == 11
    per_layer = {t.name.startswith("model.layers.") for t in tensors(CFG)}
    assert per_layer == {True, False}
    assert all(t.per_layer == t.name.startswith("model.layers.") for t in tensors(CFG))


def test_layer_name():
    q = _by_path(CFG)["blocks/attn/wq/kernel"]
    assert layer_name(q, 2) == "model.layers.2.self_attn.q_proj.weight"
    assert layer_name(_by_path(CFG)["embed"], 5) == "model.embed_tokens.weight"


def _stored(t: Tensor) -> np.ndarray:
    return np.arange(np.prod(t.shape), dtype=np.float32).reshape(t.shape)


def test_the_transforms_element_by_element():
    """PyTorch's ``y = x @ W.T``: a stored ``(out, in)`` row is one output; jaxpar's kernels
    are ``(in, out)`` with the heads dimension major in the flattened ``out``/``in``."""
    cfg = dataclasses.replace(CFG, qkv_bias=True)
    t = _by_path(cfg)
    h = cfg.head_dim
    q = _stored(t["blocks/attn/wq/kernel"])
    jq = t["blocks/attn/wq/kernel"].to_jaxpar(q)
    o = _stored(t["blocks/attn/wo/kernel"])
    jo = t["blocks/attn/wo/kernel"].to_jaxpar(o)
    for x, head, j in itertools.product(range(cfg.d_model), range(cfg.n_heads), range(h)):
        assert jq[x, head, j] == q[head * h + j, x]
        assert jo[head, j, x] == o[x, head * h + j]
    bias = _stored(t["blocks/attn/wk/bias"])
    np.testing.assert_array_equal(t["blocks/attn/wk/bias"].to_jaxpar(bias),
                                  bias.reshape(cfg.n_kv_heads, h))
    for path in ("blocks/mlp/w_up/kernel", "blocks/mlp/w_down/kernel", "lm_head/kernel"):
        w = _stored(t[path])
        np.testing.assert_array_equal(t[path].to_jaxpar(w), w.T, err_msg=path)
    for path in ("embed", "final_norm/scale", "blocks/attn_norm/scale"):
        w = _stored(t[path])
        np.testing.assert_array_equal(t[path].to_jaxpar(w), w, err_msg=path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_to_hf_undoes_to_jaxpar(variant):
    for t in tensors(dataclasses.replace(CFG, **VARIANTS[variant])):
        stored = np.random.default_rng(0).standard_normal(t.shape).astype(np.float32)
        there = t.to_jaxpar(stored)
        assert there.shape == t.jaxpar_shape
        back = t.to_hf(there)
        assert back.flags["C_CONTIGUOUS"]
        np.testing.assert_array_equal(back, stored, err_msg=t.path)


def _all_slices(size: int):
    return [slice(a, b) for a in range(size) for b in range(a + 1, size + 1)]


@pytest.mark.parametrize("path", ["blocks/attn/wq/kernel", "blocks/attn/wo/kernel",
                                  "blocks/attn/wk/bias", "blocks/mlp/w_down/kernel", "embed"])
def test_source_slices_cover_exactly_the_view_part(path):
    t = _by_path(dataclasses.replace(CFG, qkv_bias=True))[path]
    stored = _stored(t)
    view = stored.reshape(t.view)
    rng = np.random.default_rng(1)
    options = [_all_slices(size) for size in t.view]
    for _ in range(60):
        index = tuple(opt[rng.integers(len(opt))] for opt in options)
        slices, finish = source_slices(t, index)
        slab = stored[slices]
        np.testing.assert_array_equal(finish(slab), view[index], err_msg=str(index))
        assert slab.size <= stored.size


def test_only_the_rows_of_the_wanted_heads_are_read():
    t = _by_path(CFG)["blocks/attn/wq/kernel"]   # stored (heads * 6, 12), view (3, 6, 12)
    slices, _ = source_slices(t, (slice(1, 3), slice(0, 6), slice(4, 8)))
    assert slices == (slice(6, 18), slice(4, 8))
    o = _by_path(CFG)["blocks/attn/wo/kernel"]   # stored (12, heads * 6), view (12, 3, 6)
    slices, finish = source_slices(o, (slice(0, 12), slice(2, 3), slice(0, 6)))
    assert slices == (slice(0, 12), slice(12, 18))
    # A split of head_dim (not the leading view dim of its group) reads the whole heads.
    slices, finish = source_slices(o, (slice(0, 12), slice(1, 2), slice(2, 4)))
    assert slices == (slice(0, 12), slice(6, 12))
    stored = _stored(o)
    np.testing.assert_array_equal(finish(stored[slices]),
                                  stored.reshape(o.view)[:, 1:2, 2:4])


def test_a_view_that_does_not_split_the_shape_is_refused():
    bad = Tensor("w", "w", (6, 4), (4, 6), (1, 0), False)
    with pytest.raises(ValueError, match=r"view \(4, 6\) does not split shape \(6, 4\)"):
        source_slices(bad, (slice(0, 4), slice(0, 6)))


FAMILY_LAYOUTS = {
    "Phi3ForCausalLM": {},
    "MixtralForCausalLM": dict(n_experts=4, expert_capacity=0.0),
    "Qwen2MoeForCausalLM": dict(n_experts=4, expert_d_ff=8, n_shared_experts=2,
                                shared_expert_gate=True, qkv_bias=True),
    "Gemma2ForCausalLM": dict(post_norms=True, norm_offset=1.0, embed_scale=True),
}


@pytest.mark.parametrize("arch", list(FAMILY_LAYOUTS))
def test_every_parameter_of_the_new_families_has_its_tensor(arch):
    cfg = dataclasses.replace(CFG, **FAMILY_LAYOUTS[arch])
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = {k: v.shape for k, v in flat_paths(nnx.state(model, nnx.Param)).items()}
    listed = {t.path: t for t in tensors(cfg, arch)}
    assert set(listed) == set(params)
    for path, t in listed.items():
        want = (cfg.n_layers, *t.jaxpar_shape) if t.per_layer else t.jaxpar_shape
        assert params[path] == want, path
        assert int(np.prod(t.shape)) * max(t.experts, 1) == int(np.prod(t.view)), path


def test_fused_parts_read_only_their_rows():
    """Phi-3's qkv_proj holds q, k and v one after the other: each part's slices are its
    own rows of the stored tensor, and cover exactly the part of the view asked for."""
    by_path = {t.path: t for t in tensors(CFG, "Phi3ForCausalLM")}
    q, k, v = (by_path[f"blocks/attn/w{p}/kernel"] for p in "qkv")
    assert (q.rows, k.rows, v.rows) == ((0, 18, 30), (18, 24, 30), (24, 30, 30))
    assert q.stored_shape == k.stored_shape == (30, 12)
    fused = np.random.default_rng(0).standard_normal((30, 12)).astype(np.float32)
    for t in (q, k, v):
        part = fused[t.rows[0]:t.rows[1]]
        for index in [tuple(slice(0, n) for n in t.view),
                      (slice(t.view[0] - 1, t.view[0]), slice(0, 6), slice(3, 9))]:
            slices, finish = source_slices(t, index)
            assert t.rows[0] <= slices[0].start and slices[0].stop <= t.rows[1]
            np.testing.assert_array_equal(finish(fused[slices]),
                                          part.reshape(t.view)[index])


def test_per_expert_tensors_are_one_expert_each():
    cfg = dataclasses.replace(CFG, n_experts=4)
    w = {t.path: t for t in tensors(cfg, "MixtralForCausalLM")}["blocks/mlp/w_down/kernel"]
    assert (w.name, w.shape, w.experts) == (
        "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", (12, 20), 4)
    assert layer_name(w, 1, 3) == "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    one = w.expert()
    assert (one.view, one.perm, one.jaxpar_shape) == ((12, 20), (1, 0), (20, 12))
    with pytest.raises(ValueError, match="read per expert"):
        source_slices(w, tuple(slice(0, n) for n in w.view))
