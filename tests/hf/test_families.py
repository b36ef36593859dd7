"""Hugging Face ``config.json`` <-> the decoder's config, on plain dicts (no transformers):
each family's keys read into the fields they mean, defaults as transformers has them, both
RoPE spellings, every option the decoder cannot express named, overrides checked against
the checkpoint's config, and configs written back that read the same."""

import dataclasses
import json

import pytest

from jaxpar.errors import JaxparError
from jaxpar.hf.families import (
    ARCHITECTURES,
    RUNTIME_FIELDS,
    architecture_of,
    check_overrides,
    family_of,
    merge_model,
    read_config,
    runtime_fields,
    to_hf,
    to_jaxpar,
)
from jaxpar.models.config import TransformerConfig

BASE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4}


def hf(arch: str = "LlamaForCausalLM", **changes) -> dict:
    return {"architectures": [arch], **BASE, **changes}


def test_llama_sizes_and_defaults():
    cfg, arch = to_jaxpar(hf(num_key_value_heads=2, max_position_embeddings=512,
                             rms_norm_eps=1e-5, rope_theta=500000.0))
    assert arch == "LlamaForCausalLM"
    assert (cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.n_layers) == (96, 64, 128, 2)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.max_seq_len, cfg.norm_eps, cfg.rope_theta) == (512, 1e-5, 500000.0)
    assert (cfg.tie_embeddings, cfg.mlp_activation, cfg.rope_scaling) == (False, "silu", "none")
    # What a config leaves out takes transformers' defaults.
    bare, _ = to_jaxpar(hf())
    assert (bare.n_kv_heads, bare.head_dim, bare.max_seq_len) == (4, 16, 2048)
    assert (bare.norm_eps, bare.rope_theta) == (1e-6, 10000.0)


def test_each_family_sets_its_own_options():
    qwen2, _ = to_jaxpar(hf("Qwen2ForCausalLM"))
    assert qwen2.qkv_bias and not qwen2.qk_norm
    qwen3, _ = to_jaxpar(hf("Qwen3ForCausalLM", head_dim=24))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 24
    mistral, _ = to_jaxpar(hf("MistralForCausalLM", sliding_window=32))
    assert mistral.sliding_window == 32
    assert to_jaxpar(hf("MistralForCausalLM", sliding_window=None))[0].sliding_window == 0
    # Only Mistral reads sliding_window (Llama configs of some versions carry the key).
    assert to_jaxpar(hf(sliding_window=32))[0].sliding_window == 0
    gemma, _ = to_jaxpar(hf("GemmaForCausalLM", hidden_activation="gelu_pytorch_tanh",
                            hidden_act="gelu"))
    assert (gemma.norm_offset, gemma.embed_scale, gemma.tie_embeddings) == (1.0, True, True)
    assert gemma.mlp_activation == "gelu_tanh"  # hidden_activation wins over hidden_act
    assert not to_jaxpar(hf("GemmaForCausalLM", tie_word_embeddings=False))[0].tie_embeddings


@pytest.mark.parametrize("act, want", [("silu", "silu"), ("swish", "silu"),
                                       ("gelu_new", "gelu_tanh"), ("gelu_fast", "gelu_tanh"),
                                       ("gelu", "gelu")])
def test_activation_names(act, want):
    assert to_jaxpar(hf(hidden_act=act))[0].mlp_activation == want


def test_architecture_from_model_type_or_list():
    assert architecture_of({"model_type": "qwen2"}) == "Qwen2ForCausalLM"
    assert architecture_of({"architectures": [], "model_type": "gemma"}) == "GemmaForCausalLM"
    assert architecture_of({"architectures": ["MistralForCausalLM", "x"]}) == (
        "MistralForCausalLM")
    with pytest.raises(JaxparError, match=r"f.json: architectures='Llama' must be a list"):
        architecture_of({"architectures": "Llama"}, "f.json")
    with pytest.raises(JaxparError, match=r"architecture 'gpt2' is not supported; jaxpar "
                                          r"reads LlamaForCausalLM, MistralForCausalLM"):
        architecture_of({"model_type": "gpt2"})
    with pytest.raises(JaxparError, match=r"architecture 'unknown' is not supported"):
        architecture_of({})


def test_rope_in_either_spelling():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    old, _ = to_jaxpar(hf(rope_theta=500000.0, rope_scaling=llama3))
    new, _ = to_jaxpar(hf(rope_parameters={**llama3, "rope_theta": 500000.0}))
    assert old == new
    assert (new.rope_scaling, new.rope_factor, new.rope_theta) == ("llama3", 8.0, 500000.0)
    assert (new.rope_low_freq_factor, new.rope_high_freq_factor,
            new.rope_original_max_len) == (1.0, 4.0, 8192)
    linear, _ = to_jaxpar(hf(rope_scaling={"type": "linear", "factor": 2.0}))
    assert (linear.rope_scaling, linear.rope_factor) == ("linear", 2.0)
    default, _ = to_jaxpar(hf(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert (default.rope_scaling, default.rope_theta) == ("none", 1e6)


@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling="linear"), "rope_scaling='linear' must be a mapping (or null)"),
    (dict(rope_parameters=[1]), "rope_parameters=[1] must be a mapping"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope type 'yarn' is not supported (jaxpar has default, linear and llama3)"),
    (dict(rope_parameters={"rope_type": "linear"}),
     "rope_parameters of type 'linear' has no 'factor'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "rope_scaling of type 'llama3' has no 'low_freq_factor' (type 'llama3' needs factor, "
     "low_freq_factor, high_freq_factor, original_max_position_embeddings)"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}),
     "rope_scaling.factor=0 must be a positive number"),
    (dict(rope_theta=-1), "rope_theta=-1 must be a positive number"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 1.5}),
     "rope_scaling.original_max_position_embeddings=1.5 must be a positive whole number"),
    (dict(attention_bias=True), "attention_bias=True is not supported by jaxpar's decoder"),
    (dict(mlp_bias=True), "mlp_bias=True is not supported"),
    (dict(pretraining_tp=2), "pretraining_tp=2 is not supported"),
    (dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True is not"),
    (dict(hidden_act="relu"), "hidden_act='relu' is not supported (jaxpar has silu, swish"),
    (dict(hidden_act=None), "hidden_act=None is not supported"),
    (dict(head_dim=15), "head_dim=15 must be even (rotary embeddings rotate pairs"),
    (dict(max_position_embeddings=0), "max_position_embeddings=0 must be a positive whole"),
    (dict(num_key_value_heads=True), "num_key_value_heads=True must be a positive whole"),
    (dict(intermediate_size=None), "intermediate_size=null must be a positive whole number"),
    (dict(quantization_config={"quant_method": "awq"}),
     "quantization_config (quant_method 'awq'): jaxpar reads unquantized float"),
])
def test_what_the_decoder_cannot_express_is_named(changes, message):
    with pytest.raises(JaxparError) as err:
        to_jaxpar(hf(**changes), "m/config.json")
    assert str(err.value).startswith(f"m/config.json: {message}"), str(err.value)


def test_missing_sizes_and_non_objects():
    config = hf()
    del config["hidden_size"]
    with pytest.raises(JaxparError, match=r"^c: missing 'hidden_size'$"):
        to_jaxpar(config, "c")
    with pytest.raises(JaxparError, match=r"^c: holds a JSON str, not the object of keys"):
        to_jaxpar("LlamaForCausalLM", "c")


def test_read_config(tmp_path):
    with pytest.raises(JaxparError, match="not a Hugging Face model folder"):
        read_config(tmp_path / "nowhere")
    with pytest.raises(JaxparError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(JaxparError, match=r"config.json: not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf("Qwen2ForCausalLM")))
    cfg, arch = read_config(tmp_path)
    assert arch == "Qwen2ForCausalLM" and cfg.qkv_bias and cfg.d_model == 64


SMALL = TransformerConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          d_ff=128, max_seq_len=128, norm_eps=1e-6)
VARIANTS = {
    "LlamaForCausalLM": dict(rope_scaling="llama3", rope_factor=8.0,
                             rope_original_max_len=64),
    "MistralForCausalLM": dict(sliding_window=16),
    "Qwen2ForCausalLM": dict(qkv_bias=True, tie_embeddings=True),
    "Qwen3ForCausalLM": dict(qk_norm=True, head_dim=24, rope_scaling="linear", rope_factor=2.0),
    "GemmaForCausalLM": dict(norm_offset=1.0, embed_scale=True, tie_embeddings=True,
                             mlp_activation="gelu_tanh"),
}


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_written_configs_read_back_the_same(arch):
    cfg = dataclasses.replace(SMALL, **VARIANTS[arch], loss_chunk=8, attention="xla")
    assert family_of(cfg) == arch
    written = to_hf(cfg, dtype="bfloat16")
    assert written["architectures"] == [arch]
    assert written["model_type"] == ARCHITECTURES[arch]
    assert (written["hidden_size"], written["intermediate_size"], written["num_hidden_layers"],
            written["num_attention_heads"], written["num_key_value_heads"],
            written["head_dim"], written["torch_dtype"]) == (
        64, 128, 2, 4, 2, cfg.head_dim, "bfloat16")
    back, back_arch = to_jaxpar(json.loads(json.dumps(written)))
    assert back_arch == arch
    # Everything but how to compute comes back.
    assert back == dataclasses.replace(cfg, **runtime_fields(back))


def test_written_family_keys():
    gemma = to_hf(dataclasses.replace(SMALL, **VARIANTS["GemmaForCausalLM"]))
    assert gemma["hidden_activation"] == gemma["hidden_act"] == "gelu_pytorch_tanh"
    llama = to_hf(dataclasses.replace(SMALL, **VARIANTS["LlamaForCausalLM"]))
    assert llama["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}
    assert llama["attention_bias"] is False and "sliding_window" not in llama
    qwen2 = to_hf(dataclasses.replace(SMALL, qkv_bias=True))
    assert qwen2["use_sliding_window"] is False and qwen2["max_window_layers"] == 2
    assert to_hf(SMALL, "MistralForCausalLM")["sliding_window"] is None


@pytest.mark.parametrize("changes, architecture, message", [
    (dict(n_experts=4, experts_per_token=2), "LlamaForCausalLM",
     "model.n_experts=4: LlamaForCausalLM has no experts; a mixture of experts is saved as "
     "one of MixtralForCausalLM"),
    ({}, "GPT2LMHeadModel", "architecture 'GPT2LMHeadModel' is not supported; choose one"),
    (dict(qkv_bias=True, qk_norm=True), None, "no Hugging Face architecture has this "
                                              "decoder's combination of options: "
                                              "Qwen3ForCausalLM cannot express qkv_bias"),
    (dict(qk_norm=True, sliding_window=8), None, "Qwen3ForCausalLM cannot express "
                                                 "sliding_window"),
    (dict(norm_offset=1.0), None, "a model with norm_offset or embed_scale is saved as Gemma"),
    (dict(norm_offset=1.0, embed_scale=True, rope_scaling="llama3", rope_factor=8.0), None,
     "GemmaForCausalLM cannot express rope_scaling=llama3"),
    (dict(qkv_bias=True), "LlamaForCausalLM", "LlamaForCausalLM cannot express this decoder "
                                              "config exactly"),
    (dict(norm_offset=1.0, embed_scale=True), "LlamaForCausalLM", "cannot express this"),
])
def test_configs_no_family_expresses_are_refused(changes, architecture, message):
    with pytest.raises(JaxparError, match=None) as err:
        to_hf(dataclasses.replace(SMALL, **changes), architecture)
    assert message in str(err.value), str(err.value)


def test_check_overrides():
    base, _ = to_jaxpar(hf(num_key_value_heads=2))
    given = {"max_seq_len": 64, "loss_chunk": 4, "d_model": 64, "head_dim": 0, "qk_norm": False}
    assert check_overrides(base, given, "c.json") == {"max_seq_len": 64, "loss_chunk": 4}
    with pytest.raises(JaxparError, match=r"^model.d_model=32 conflicts with hidden_size=64 "
                                          r"in c.json; the model's shape and kind come from "
                                          r"the checkpoint \(only model.init_std, "):
        check_overrides(base, {"d_model": 32}, "c.json")
    with pytest.raises(JaxparError, match=r"^model.tie_embeddings=true conflicts with "
                                          r"tie_word_embeddings=false in c.json"):
        check_overrides(base, {"tie_embeddings": True}, "c.json")
    with pytest.raises(JaxparError, match=r"^model.qk_norm=true conflicts with "
                                          r"model.qk_norm=false of the model c.json describes"):
        check_overrides(base, {"qk_norm": True}, "c.json")
    with pytest.raises(JaxparError, match=r"^model.head_dim=8 conflicts with head_dim=16"):
        check_overrides(base, {"head_dim": 8}, "c.json")
    with pytest.raises(JaxparError, match=r"^model.bogus: the model is the one c.json "
                                          r"describes \(jaxpar's decoder\), which has no such"):
        check_overrides(base, {"bogus": 1}, "c.json")


def test_merge_model_keeps_how_to_compute_and_compatible_overrides():
    base, _ = to_jaxpar(hf(num_key_value_heads=2, max_position_embeddings=512))
    yaml_model = TransformerConfig(attention="chunked", loss_chunk=16, max_seq_len=256,
                                   init_std=0.5)
    merged = merge_model(base, yaml_model)
    assert runtime_fields(merged) == runtime_fields(yaml_model)
    assert merged.max_seq_len == 512  # the YAML's default is not an override
    assert dataclasses.replace(merged, **runtime_fields(base)) == base
    given = merge_model(base, yaml_model, given=["max_seq_len"])
    assert given.max_seq_len == 256
    # Merging a merged model again changes nothing, its max_seq_len included.
    assert merge_model(base, given) == given
    with pytest.raises(JaxparError, match=r"^model.d_ff=256 conflicts with "
                                          r"intermediate_size=128 in config.json"):
        merge_model(base, yaml_model, given=["d_ff"])
    assert set(RUNTIME_FIELDS) == {"init_std", "attention", "attention_block", "loss_chunk"}


@pytest.mark.parametrize("options", [dict(attn_logit_softcap=50.0),
                                     dict(sliding_window=16, global_every=2)])
def test_gemma2_options_are_not_saved_as_another_family(options):
    with pytest.raises(JaxparError, match="is saved as Gemma 2 or 3, which need norm_offset=1, "
                                          "embed_scale=true and post_norms=true together"):
        family_of(dataclasses.replace(SMALL, **options))
    gemma = dict(norm_offset=1.0, embed_scale=True, post_norms=True)
    assert family_of(dataclasses.replace(SMALL, **options, **gemma)) == "Gemma2ForCausalLM"
    assert family_of(dataclasses.replace(SMALL, **options, **gemma, qk_norm=True)) == (
        "Gemma3ForCausalLM")
