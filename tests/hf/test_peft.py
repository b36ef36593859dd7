"""LoRA adapters in PEFT's format: PEFT itself loads them onto the transformers model (when
torch, transformers and peft are installed), and, read with the ``safetensors`` library,
each layer's ``lora_B @ lora_A`` is the update jaxpar's ``A @ B`` makes, laid out as the
Hugging Face weight it adapts."""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file

import jaxpar
from jaxpar import hf
from jaxpar.errors import JaxparError
from jaxpar.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_names, save_adapters
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.parallel.pipeline import Schedule

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
if HAVE_TORCH:  # the reference models of tests/hf/test_convert.py, and its helpers
    from tests.hf.test_convert import (  # noqa: F401  (checkpoints is a fixture)
        TOL,
        _logits,
        _plan,
        _reference,
        checkpoints,
        torch,
        transformers,
    )

CFG = TransformerConfig(vocab_size=32, d_model=8, n_layers=4, n_heads=2, n_kv_heads=1,
                        d_ff=16, max_seq_len=8)
HF_MODULES = {"blocks/attn/wq": "self_attn.q_proj", "blocks/attn/wk": "self_attn.k_proj",
              "blocks/attn/wv": "self_attn.v_proj", "blocks/attn/wo": "self_attn.o_proj",
              "blocks/mlp/w_gate": "mlp.gate_proj", "blocks/mlp/w_up": "mlp.up_proj",
              "blocks/mlp/w_down": "mlp.down_proj"}
"""jaxpar projection -> its module in a Llama layer, as PEFT names them."""


@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch and transformers")
def test_peft_loads_jaxpar_adapters(checkpoints, tmp_path):
    peft = pytest.importorskip("peft")
    folder, base_logits = checkpoints["qwen2"]
    plan = _plan(fsdp=4, tensor=2)
    model = hf.load(folder, plan=plan)
    with plan.activate():
        jaxpar.lora.apply(model, rank=4, alpha=8.0)
    # Random adapters (B is zero at init) stand in for trained ones.
    keys = iter(jax.random.split(jax.random.key(1), 100))
    for _, lp in jaxpar.lora.adapted(model):
        b = lp.lora_b.get_value()
        lp.lora_b.set_value(jax.device_put(0.5 * jax.random.normal(next(keys), b.shape),
                                           b.sharding))
    with_adapters = _logits(model, plan)
    out = hf.save_adapters(model, tmp_path / "adapters", base_model=str(folder))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                        "q_proj", "up_proj", "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, out).eval()
    got = _reference(tuned)
    np.testing.assert_allclose(got, with_adapters, atol=TOL, rtol=0)
    assert np.abs(got - base_logits).max() > 100 * TOL  # the adapters matter
    # Merged in jaxpar and saved whole: the same logits from plain transformers.
    jaxpar.lora.merge(model)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        hf.save(model, tmp_path / "merged"), dtype=torch.float32).eval()
    np.testing.assert_allclose(_reference(merged), with_adapters, atol=TOL, rtol=0)


def _randomise(model: Transformer, seed: int) -> None:
    """Random values in every adapter (B starts at zero, which would hide mistakes)."""
    rng = np.random.default_rng(seed)
    for _, lp in jaxpar.lora.adapted(model):
        for var in (lp.lora_a, lp.lora_b):
            var.set_value(jnp.asarray(rng.standard_normal(var.get_value().shape), jnp.float32))


@pytest.fixture(scope="module")
def adapted_model() -> Transformer:
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    jaxpar.lora.apply(model, rank=2, alpha=6.0)
    _randomise(model, 0)
    return model


def test_the_file_holds_each_layers_update_in_hugging_face_layout(adapted_model, tmp_path):
    out = save_adapters(adapted_model, tmp_path / "adapters", base_model="meta/llama")
    tensors = load_file(out / ADAPTER_WEIGHTS)
    names = [f"base_model.model.model.layers.{i}.{module}.lora_{x}.weight"
             for module in HF_MODULES.values() for i in range(CFG.n_layers) for x in "AB"]
    assert sorted(tensors) == sorted(names) == sorted(adapter_names(adapted_model))
    for path, lp in jaxpar.lora.adapted(adapted_model):
        a, b = np.asarray(lp.lora_a.get_value()), np.asarray(lp.lora_b.get_value())
        for i in range(CFG.n_layers):
            name = f"base_model.model.model.layers.{i}.{HF_MODULES[path]}"
            lora_a, lora_b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            # jaxpar's update of the (in..., out...) kernel, as PyTorch's (out, in) weight.
            delta = np.tensordot(a[i], b[i], axes=([-1], [0]))
            n_in = int(np.prod(a[i].shape[:-1]))
            want = delta.reshape(n_in, -1).T
            assert lora_a.shape == (2, n_in) and lora_b.shape == (want.shape[0], 2), name
            np.testing.assert_allclose(lora_b @ lora_a, want, rtol=1e-5, atol=1e-6,
                                       err_msg=name)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout",
                                   "bias", "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 6.0,
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": "meta/llama"}
    assert config["target_modules"] == sorted(m.split(".")[1] for m in HF_MODULES.values())
    assert sorted(p.name for p in out.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])


def test_stored_dtype_and_no_base_model(adapted_model, tmp_path):
    out = save_adapters(adapted_model, tmp_path / "bf16", dtype=jnp.bfloat16)
    with safe_open(str(out / ADAPTER_WEIGHTS), framework="numpy") as handle:
        stored = handle.keys()  # a list (the handle itself is not iterable)
        assert {handle.get_slice(k).get_dtype() for k in stored} == {"BF16"}
        assert handle.metadata() == {"format": "pt"}
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] is None


def test_pipelined_layers_are_written_in_layer_order(adapted_model, tmp_path):
    """Layer ``r * stages + s`` of a pipelined model sits at ``[r, s]``: its adapters are
    the plain model's reshaped, and the files are the same."""
    piped = Transformer(CFG, rngs=nnx.Rngs(0), pipeline=Schedule.for_model(4, 2))
    jaxpar.lora.apply(piped, rank=2, alpha=6.0)
    plain = dict(jaxpar.lora.adapted(adapted_model))
    for path, lp in jaxpar.lora.adapted(piped):
        for name in ("lora_a", "lora_b"):
            value = getattr(plain[path], name).get_value()
            getattr(lp, name).set_value(value.reshape(2, 2, *value.shape[1:]))
    want = load_file(save_adapters(adapted_model, tmp_path / "plain") / ADAPTER_WEIGHTS)
    got = load_file(save_adapters(piped, tmp_path / "piped") / ADAPTER_WEIGHTS)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_what_cannot_be_saved_is_refused(tmp_path):
    with pytest.raises(JaxparError, match="save_adapters writes adapters of jaxpar's "
                                          "reference decoder, not of a Linear"):
        save_adapters(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tmp_path / "x")
    bare = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    with pytest.raises(JaxparError, match="the model has no LoRA adapters to save"):
        save_adapters(bare, tmp_path / "x")
    mixed = Transformer(CFG, rngs=nnx.Rngs(0))
    jaxpar.lora.apply(mixed, target="attn/wq$", rank=2)
    jaxpar.lora.apply(mixed, target="attn/wv$", rank=4)
    with pytest.raises(JaxparError, match="adapters with different ranks, alphas or dropouts "
                                          "cannot share one PEFT adapter config"):
        save_adapters(mixed, tmp_path / "x")
    assert not (tmp_path / "x").exists()  # nothing was written
