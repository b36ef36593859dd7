"""The decoder's config: derived sizes, parameter counts held to the built model and to
hand arithmetic, the MLP activations, and every check with the field it names."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.models.config import MLP_ACTIVATIONS

SIZES = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
             max_seq_len=16)
BASE = TransformerConfig(**SIZES)
MOE = dict(n_experts=4, experts_per_token=2, expert_d_ff=8, n_shared_experts=1)


def built_param_count(cfg: TransformerConfig) -> int:
    """Parameters of the model itself (abstract: nothing is computed)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(math.prod(v.get_value().shape)
               for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_head_dim_defaults_to_d_model_over_heads():
    assert BASE.head_dim == 4
    assert dataclasses.replace(BASE, head_dim=6).head_dim == 6
    assert TransformerConfig(d_model=64, n_heads=8, n_kv_heads=8).head_dim == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.d_model = 32


def test_param_count_by_hand():
    # d=16, head_dim=4: q and o 16*4*4 each, k and v 16*2*4 each; MLP 3*16*24; two norms.
    per_layer = 2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 24 + 2 * 16
    embed, final_norm, head = 32 * 16, 16, 16 * 32
    assert BASE.param_count() == embed + 2 * per_layer + final_norm + head == 4944
    assert dataclasses.replace(BASE, tie_embeddings=True).param_count() == 4944 - head


@pytest.mark.parametrize("changes", [
    {},
    {"tie_embeddings": True},
    {"qkv_bias": True, "qk_norm": True, "head_dim": 6},
    {"n_kv_heads": 4, "n_layers": 3},
    MOE,
    {**MOE, "expert_d_ff": 0, "n_shared_experts": 0, "experts_per_token": 1},
])
def test_param_count_equals_the_built_model(changes):
    cfg = dataclasses.replace(BASE, **changes)
    assert cfg.param_count() == built_param_count(cfg)


def test_active_params_leave_out_idle_experts():
    assert BASE.active_param_count() == BASE.param_count()
    cfg = dataclasses.replace(BASE, **MOE)
    assert cfg.moe_d_ff == 8 and dataclasses.replace(cfg, expert_d_ff=0).moe_d_ff == 24
    # Each token skips 4 - 2 routed experts per layer: gate, up and down of 16 x 8 each.
    idle = 2 * (4 - 2) * 3 * 16 * 8
    assert cfg.active_param_count() == cfg.param_count() - idle
    top1 = dataclasses.replace(cfg, experts_per_token=1)
    assert top1.param_count() - top1.active_param_count() == 2 * 3 * 3 * 16 * 8


def test_mlp_activations_match_their_formulas():
    x = np.linspace(-4, 4, 41)
    erf = np.vectorize(math.erf)
    want = {
        "silu": x / (1 + np.exp(-x)),
        "gelu": 0.5 * x * (1 + erf(x / math.sqrt(2))),
        "gelu_tanh": 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    }
    assert set(MLP_ACTIVATIONS) == set(want)
    for name, ref in want.items():
        got = MLP_ACTIVATIONS[name](jnp.asarray(x, jnp.float32))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("changes,message", [
    ({"vocab_size": 0}, "model.vocab_size=0: must be at least 1"),
    ({"n_layers": -1}, "model.n_layers=-1: must be at least 1"),
    ({"rope_theta": 0.0}, "model.rope_theta=0.0: must be positive"),
    ({"init_std": -0.1}, "model.init_std=-0.1: must be positive"),
    ({"rope_scaling": "yarn"}, "model.rope_scaling='yarn': choose one of ['none', 'linear', "
                               "'llama3']"),
    ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 4.0},
     "model.rope_high_freq_factor=4.0 must be greater than model.rope_low_freq_factor=4.0"),
    ({"mlp_activation": "relu"}, "model.mlp_activation='relu': choose one of ['silu'"),
    ({"attention": "flash"}, "model.attention='flash': choose one of ['auto'"),
    ({"attention_block": 0}, "model.attention_block=0: must be at least 1"),
    ({"loss_chunk": -1}, "model.loss_chunk=-1: must be 0 (full logits)"),
    ({"n_experts": -1}, "model.n_experts, model.n_shared_experts and model.expert_d_ff must "
                        "not be negative"),
    ({"n_experts": 4, "experts_per_token": 5},
     "model.experts_per_token=5: must be between 1 and model.n_experts=4"),
    ({"n_experts": 4, "experts_per_token": 0}, "model.experts_per_token=0"),
    ({"router_aux_loss": -1.0}, "model.expert_capacity, model.router_aux_loss and "
                                "model.router_z_loss must not be negative"),
    ({"sliding_window": -2}, "model.sliding_window=-2: must be 0 (off)"),
    ({"global_every": -1, "sliding_window": 4}, "model.global_every=-1: must be 0 (off)"),
    ({"global_every": 2}, "model.global_every=2 needs model.sliding_window > 0"),
    ({"attn_logit_softcap": -50.0}, "model.attn_logit_softcap=-50.0: must be 0 (off) or "
                                    "positive"),
    ({"attn_logit_softcap": 50.0, "attention": "cudnn"},
     "model.attn_logit_softcap=50.0 with model.attention='cudnn'"),
    ({"head_dim": -4}, "model.head_dim=-4: must be positive"),
    ({"d_model": 18}, "model.d_model=18 is not divisible by model.n_heads=4; set "
                      "model.head_dim explicitly"),
    ({"n_kv_heads": 3}, "model.n_heads=4 must be a multiple of model.n_kv_heads=3"),
    ({"head_dim": 5}, "head_dim=5 must be even for rotary embeddings"),
    ({"d_model": 20}, "head_dim=5 must be even"),
])
def test_bad_values_name_the_field(changes, message):
    with pytest.raises(jaxpar.JaxparError) as err:
        TransformerConfig(**{**SIZES, **changes})
    assert str(err.value).startswith(message), str(err.value)


def test_values_at_the_edges_are_accepted():
    cfg = dataclasses.replace(BASE, loss_chunk=0, sliding_window=0, expert_capacity=0.0,
                              rope_scaling="llama3", rope_low_freq_factor=1.0,
                              rope_high_freq_factor=1.5, n_experts=2, experts_per_token=2)
    assert cfg.n_experts == cfg.experts_per_token == 2
    # Without experts, experts_per_token is not checked.
    assert dataclasses.replace(BASE, experts_per_token=9).n_experts == 0


@pytest.mark.parametrize("every,windows", [
    (0, [4, 4, 4, 4, 4, 4]),
    (2, [4, 0, 4, 0, 4, 0]),  # Gemma 2: layer 0 local, layer 1 global
    (6, [4, 4, 4, 4, 4, 0]),  # Gemma 3: five local layers, then a global one
])
def test_layer_windows_of_the_local_global_pattern(every, windows):
    cfg = dataclasses.replace(BASE, n_layers=6, sliding_window=4, global_every=every,
                              attn_logit_softcap=50.0)
    assert [cfg.layer_window(i) for i in range(cfg.n_layers)] == windows
