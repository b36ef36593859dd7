"""The planner's memory for a Gemma-2/3-shaped model against XLA:CPU: norms after each
sublayer and on queries and keys, a GeGLU MLP, a tied embedding table, alternating local
and global layers, attention and final logit soft-caps and the chunked loss, at
``remat=none`` (where those parts are saved for the backward pass; see
:func:`jaxpar.planner.activations._gemma_saved`). Calibrated like ``test_planner.py``'s dense
cases: arguments + temporaries within 10% of what XLA compiles."""

import dataclasses

import pytest

from jaxpar.analysis.hlo import memory_stats
from jaxpar.analysis.inspection import compile_step
from jaxpar.planner import activations as activations_lib
from jaxpar.planner import predict
from tests.planner.cases import make_config

GEMMA = ("vocab_size=512 d_model=64 n_layers=4 n_heads=4 n_kv_heads=2 head_dim=32 d_ff=256 "
         "post_norms=true qk_norm=true mlp_activation=gelu_tanh sliding_window=16 "
         "global_every=2 attn_logit_softcap=50.0 final_logit_softcap=30.0 "
         "tie_embeddings=true loss_chunk=16 norm_offset=1.0 embed_scale=true "
         "query_pre_attn_scalar=16")
BATCH, SEQ = 16, 64
KNOBS = "mesh.data=8 plan.precision=p=f32,c=bf16,o=f32"


def test_gemma_shaped_memory_matches_xla(devices, monkeypatch):
    config = make_config(GEMMA, BATCH, SEQ, KNOBS)
    got = memory_stats(compile_step(config).compiled)  # from shapes: nothing initialised
    want = got["argument_bytes"] + got["temp_bytes"]
    pred = predict(config, 8, backend="cpu")["memory"]
    assert pred["argument_bytes"] == pytest.approx(got["argument_bytes"], rel=0.01)
    assert pred["argument_bytes"] + pred["temp_bytes"] == pytest.approx(want, rel=0.10)
    # Without the Gemma terms the planner is short by more than the tolerance.
    monkeypatch.setattr(activations_lib, "_gemma_saved", lambda *a: 0.0)
    bare = predict(config, 8, backend="cpu")["memory"]
    assert bare["argument_bytes"] + bare["temp_bytes"] < 0.9 * want


def test_gemma_terms_only_under_remat_none():
    """The extra norms and GeGLU's intermediates are recomputed under the other policies:
    a Llama-shaped spec and its Gemma twin save the same there."""
    from jaxpar.models import TransformerConfig
    from jaxpar.planner.candidate import Candidate, local_sizes
    from jaxpar.planner.layout import layout
    from jaxpar.planner.model import from_transformer

    base = TransformerConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=32, d_ff=256)
    gemma = dataclasses.replace(base, post_norms=True, qk_norm=True,
                                mlp_activation="gelu_tanh")
    cand = Candidate.make({"data": 8})
    out = {}
    for name, cfg in (("base", base), ("gemma", gemma)):
        spec = from_transformer(cfg)
        lay = layout(spec, cand.sizes, cand.rules, cand.zero_stage)
        loc = local_sizes(spec, lay, cand, 16, 64)
        out[name] = {r: activations_lib.saved_activation_bytes(spec, loc, 64, r, 2)
                     for r in ("none", "full", "save_attention_and_mlp_outputs",
                               "dots_saveable")}
    assert out["gemma"]["none"] > out["base"]["none"]
    for remat in ("full", "dots_saveable"):
        assert out["gemma"][remat] == out["base"][remat]
    # Under save_attention_and_mlp_outputs the post-norms' backward reads the MLP's output,
    # which the Llama-shaped layer drops: one more d_model-sized tensor a token.
    kept = out["gemma"]["save_attention_and_mlp_outputs"]
    assert kept == pytest.approx(1.5 * out["base"]["save_attention_and_mlp_outputs"])
