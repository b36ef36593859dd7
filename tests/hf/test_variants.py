"""The options of Phi-3, the mixtures of experts and Gemma 2 / 3 on plain config dicts (no
transformers): each family's keys read into the decoder fields they mean, configs written
back read the same, and every key the decoder cannot express named in one line."""

import dataclasses
import json

import pytest

from jaxpar.errors import JaxparError
from jaxpar.hf.families import family_of, runtime_fields, to_hf, to_jaxpar
from jaxpar.models.config import TransformerConfig

BASE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4}
SMALL = TransformerConfig(vocab_size=96, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                          d_ff=128, max_seq_len=128, norm_eps=1e-6)
GEMMA = dict(norm_offset=1.0, embed_scale=True, post_norms=True, tie_embeddings=True,
             mlp_activation="gelu_tanh")
VARIANTS = {
    "Phi3ForCausalLM": dict(sliding_window=16, rotary_dim=12),
    "MixtralForCausalLM": dict(n_experts=8, experts_per_token=2, expert_capacity=0.0),
    "Qwen3MoeForCausalLM": dict(n_experts=8, experts_per_token=2, expert_d_ff=32,
                                expert_capacity=0.0, qk_norm=True, renormalize_gates=False),
    "Qwen2MoeForCausalLM": dict(n_experts=8, experts_per_token=4, expert_d_ff=32,
                                expert_capacity=0.0, n_shared_experts=4,
                                shared_expert_gate=True, qkv_bias=True),
    "Gemma2ForCausalLM": dict(**GEMMA, attn_logit_softcap=50.0, final_logit_softcap=30.0,
                              query_pre_attn_scalar=24.0, sliding_window=16, global_every=2),
    "Gemma3ForCausalLM": dict(**GEMMA, qk_norm=True, sliding_window=16, global_every=6,
                              rope_theta=1e6, rope_local_theta=1e4, rope_scaling="linear",
                              rope_factor=8.0),
}


def hf(arch: str, **changes) -> dict:
    return {"architectures": [arch], **BASE, **changes}


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_written_configs_read_back_the_same(arch):
    cfg = dataclasses.replace(SMALL, **VARIANTS[arch])
    assert family_of(cfg) == arch
    written = to_hf(cfg, arch)
    assert written["architectures"] == [arch]
    back, back_arch = to_jaxpar(json.loads(json.dumps(written)))
    assert back_arch == arch
    assert back == dataclasses.replace(cfg, **runtime_fields(back))


def test_family_keys_read():
    mixtral, _ = to_jaxpar(hf("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2,
                              router_aux_loss_coef=0.02))
    assert (mixtral.n_experts, mixtral.experts_per_token, mixtral.moe_d_ff) == (8, 2, 128)
    assert (mixtral.expert_capacity, mixtral.router_aux_loss) == (0.0, 0.02)
    assert mixtral.renormalize_gates
    qwen2, _ = to_jaxpar(hf("Qwen2MoeForCausalLM", num_experts=8, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64))
    assert (qwen2.n_shared_experts, qwen2.shared_expert_gate, qwen2.qkv_bias) == (2, True, True)
    assert not qwen2.renormalize_gates  # norm_topk_prob's default
    gemma2, _ = to_jaxpar(hf("Gemma2ForCausalLM", sliding_window=16, head_dim=16,
                             query_pre_attn_scalar=16, attn_logit_softcapping=None))
    assert (gemma2.global_every, gemma2.query_pre_attn_scalar, gemma2.attn_logit_softcap) == (
        2, 0.0, 0.0)  # no layer_types: alternating; the usual scale is stored as 0
    gemma3, _ = to_jaxpar(hf("Gemma3ForCausalLM", sliding_window=16, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.global_every) == (1e6, 1e4, 6)
    old, _ = to_jaxpar(hf("Gemma3ForCausalLM", sliding_window=16, rope_theta=1e6,
                          rope_local_base_freq=1e4))
    assert old == gemma3


@pytest.mark.parametrize("arch, changes, message", [
    ("LlamaForCausalLM", dict(partial_rotary_factor=0.75),
     "partial_rotary_factor=0.75 is not supported (LlamaForCausalLM rotates whole heads)"),
    ("Phi3ForCausalLM", dict(rope_scaling={"type": "longrope", "short_factor": [1.0]}),
     "rope type 'longrope' is not supported"),
    ("MixtralForCausalLM", {}, "no number of experts (num_local_experts / num_experts)"),
    ("Qwen3MoeForCausalLM", dict(num_experts=4), "missing 'moe_intermediate_size'"),
    ("Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=32,
                                 norm_topk_prob="yes"), "norm_topk_prob='yes' must be true"),
    ("Qwen2MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=32),
     "shared_expert_intermediate_size=None is not supported"),
    ("Gemma2ForCausalLM", dict(sliding_window=16, layer_types=["full_attention"]),
     "layer_types=['full_attention'] must list 'sliding_attention' or 'full_attention' for "
     "each of the 4 layers"),
    ("Gemma2ForCausalLM", dict(sliding_window=16, attn_logit_softcapping=-1),
     "attn_logit_softcapping=-1 must be a positive number"),
])
def test_what_the_decoder_cannot_express_is_named(arch, changes, message):
    with pytest.raises(JaxparError) as err:
        to_jaxpar(hf(arch, **changes), "c.json")
    assert message in str(err.value) and str(err.value).startswith("c.json: ")


@pytest.mark.parametrize("changes, message", [
    (dict(n_experts=4, qkv_bias=True), "MixtralForCausalLM cannot express qkv_bias"),
    (dict(n_experts=4, shared_expert_gate=False, n_shared_experts=1),
     "Qwen2MoeForCausalLM cannot express this decoder config exactly"),
    (dict(final_logit_softcap=30.0), "is saved as Gemma 2 or 3"),
])
def test_configs_no_family_expresses_are_refused(changes, message):
    with pytest.raises(JaxparError) as err:
        to_hf(dataclasses.replace(SMALL, **changes))
    assert message in str(err.value), str(err.value)
