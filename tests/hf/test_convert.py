"""Hugging Face checkpoints against the reference implementation: tiny random models of each
supported family built and saved by ``transformers`` (PyTorch CPU), loaded by
``jaxpar.hf.load`` on one device, sharded (fsdp 4 x tensor 2) and pipelined; logits
compared with transformers' own. Saving goes back through transformers (PEFT adapters are
tested in ``tests/hf/test_peft.py``, with this module's reference models)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import jaxpar
from jaxpar import hf
from jaxpar.errors import JaxparError
from tests.hf.reference import random_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             initializer_range=0.2)  # large weights: attention far from uniform
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "llama31": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=LLAMA31_ROPE)),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                          tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
}
IDS = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 12))
LEFT_MASK = np.ones_like(IDS)
LEFT_MASK[1, :4] = 0
LEFT_IDS = np.where(LEFT_MASK, np.roll(IDS, 4, axis=1), 0)
"""The batch as batched generation pads it: the second row 8 tokens after 4 pads."""
TOL = 1e-4


def _reference(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def make_hf_model(folder, family: str, **overrides):
    """A random transformers model of ``family`` saved to ``folder``; returns it."""
    config_cls, model_cls, extra = FAMILIES[family]
    model = random_model(config_cls, model_cls, **{**SIZES, **extra, **overrides})
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (folder, transformers logits)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        model = make_hf_model(root / family, family)
        out[family] = (root / family, _reference(model))
    return out


@pytest.fixture(scope="module")
def left_padded(checkpoints):
    """family -> transformers' logits on the left-padded batch, positions counted from
    each row's first token as ``generate`` counts them (pads zeroed)."""
    positions = torch.tensor(np.maximum(np.cumsum(LEFT_MASK, axis=1) - 1, 0))
    out = {}
    for family, (folder, _) in checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
        with torch.no_grad():
            out[family] = model(torch.tensor(LEFT_IDS), attention_mask=torch.tensor(
                LEFT_MASK), position_ids=positions).logits.numpy() * LEFT_MASK[..., None]
    return out


def _logits(model, plan=None) -> np.ndarray:
    if plan is None:
        return np.asarray(model(jnp.asarray(IDS)))
    with plan.activate():
        return np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(IDS)))


def _plan(**axes):
    return jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), "fsdp_tp")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_load_matches_transformers(checkpoints, left_padded, family):
    folder, want = checkpoints[family]
    one = hf.load(folder)
    np.testing.assert_allclose(_logits(one), want, atol=TOL, rtol=0)
    # Left padding: the attention mask as segment ids (pads and row apart, positions
    # from the row's first token).
    left = np.asarray(one(jnp.asarray(LEFT_IDS), segment_ids=jnp.asarray(LEFT_MASK)))
    np.testing.assert_allclose(left * LEFT_MASK[..., None], left_padded[family], atol=TOL,
                               rtol=0)
    plan = _plan(fsdp=4, tensor=2)
    model = hf.load(folder, plan=plan)
    wq = model.blocks.attn.wq.kernel.get_value()
    want_sharding = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(
        None, "fsdp", "tensor", None))  # (layers, embed, heads, head_dim)
    assert wq.sharding.is_equivalent_to(want_sharding, wq.ndim)
    np.testing.assert_allclose(_logits(model, plan), want, atol=TOL, rtol=0)


def test_load_into_a_pipeline_plan(checkpoints):
    folder, want = checkpoints["llama31"]
    plan = _plan(stage=2, fsdp=2, tensor=2)
    model = hf.load(folder, plan=plan)
    assert model.blocks.attn.wq.kernel.get_value().shape[:2] == (1, 2)  # (repeat, stage)
    np.testing.assert_allclose(_logits(model, plan), want, atol=TOL, rtol=0)


def test_the_comparison_can_fail(checkpoints):
    """RoPE scaling, the sliding window and Gemma's norm offset each change the logits by
    far more than the tolerance, so a mistake in any would show."""
    for family, field, value in (("llama31", "rope_scaling", "none"),
                                 ("mistral", "sliding_window", 0),
                                 ("gemma", "norm_offset", 0.0)):
        folder, want = checkpoints[family]
        loaded = hf.load(folder)
        cfg = dataclasses.replace(loaded.config, **{field: value})
        model = jaxpar.models.Transformer(cfg, rngs=nnx.Rngs(0))
        nnx.update(model, nnx.state(loaded, nnx.Param))
        assert np.abs(_logits(model) - want).max() > 100 * TOL, family


def test_save_round_trips_through_transformers(checkpoints, tmp_path):
    for family in ("llama31", "qwen2", "qwen3", "gemma", "mistral"):
        folder, want = checkpoints[family]
        model = hf.load(folder, plan=_plan(fsdp=4, tensor=2))
        out = hf.save(model, tmp_path / family)
        original, saved = load_file(folder / "model.safetensors"), load_file(
            out / "model.safetensors")
        original.pop("lm_head.weight", None) if model.config.tie_embeddings else None
        assert sorted(saved) == sorted(original)
        for name, value in original.items():
            np.testing.assert_array_equal(saved[name], value, err_msg=name)
        back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
        assert type(back).__name__ == json.loads((folder / "config.json").read_text())[
            "architectures"][0]
        np.testing.assert_allclose(_reference(back), want, atol=TOL, rtol=0)


def test_sharded_save_writes_an_index_transformers_reads(checkpoints, tmp_path):
    folder, want = checkpoints["qwen3"]
    model = hf.load(folder)
    out = hf.save(model, tmp_path / "sharded", max_shard_bytes=40_000, dtype=jnp.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert all((out / f).stat().st_size <= 40_000 + 10_000 for f in files[:-1])
    # Loaded back (bf16 stored, read as float32) by jaxpar and by transformers alike.
    again = _logits(hf.load(out))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    np.testing.assert_allclose(_reference(back.eval()), again, atol=TOL, rtol=0)
    assert np.abs(again - want).max() < 0.5  # bf16 rounding of the weights only
    # Saving again unsharded removes the old shards and index.
    hf.save(model, out)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def _edit_config(folder, **changes):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_unsupported_models_are_named(checkpoints, tmp_path):
    import shutil

    folder, _ = checkpoints["llama31"]
    cases = [
        (dict(architectures=["GPT2LMHeadModel"]), "architecture 'GPT2LMHeadModel' is not "
                                                  "supported"),
        (dict(attention_bias=True), "attention_bias=True is not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
         "rope type 'yarn' is not supported"),
        (dict(hidden_act="relu"), "hidden_act='relu' is not supported"),
        (dict(num_hidden_layers=3), "'model.layers.2.input_layernorm.weight' and 8 more "
                                    "missing"),
        (dict(intermediate_size=100), "has shape (128, 64), the config implies (100, 64)"),
    ]
    for changes, message in cases:
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(folder, copy)
        _edit_config(copy, **changes)
        with pytest.raises(JaxparError, match=None) as err:
            hf.load(copy)
        assert message in str(err.value), (changes, str(err.value))
    with pytest.raises(JaxparError, match="no config.json"):
        hf.load(tmp_path)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(JaxparError, match="no model.safetensors"):
        hf.load(tmp_path)
