"""Gemma 2 and Gemma 3 (text) in and out of Hugging Face against ``transformers``: tiny
random models with their own options set away from the usual values so that a mistake in
any shows: norms after each sublayer, attention and final logit soft-capping,
``query_pre_attn_scalar`` other than ``head_dim``, sliding and global layers alternating
(``layer_types``), and for Gemma 3 the QK norm, a separate RoPE base for the local layers
and linear RoPE scaling on the global ones. Logits on a padded batch within 1e-5, greedy
generation equal, the export read back by transformers bit-exact, the layer patterns the
decoder cannot express named."""

import dataclasses
import json
import shutil

import pytest
from flax import nnx

import jaxpar
from jaxpar import hf
from jaxpar.errors import JaxparError
from tests.hf import reference as ref_lib

pytest.importorskip("torch")
pytest.importorskip("transformers")

FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                    query_pre_attn_scalar=24)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=24,
                    tie_word_embeddings=False,
                    rope_parameters={
                        "full_attention": {"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 1000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """family -> its saved reference model."""
    root = tmp_path_factory.mktemp("gemma")
    return {name: ref_lib.make_reference(root / name, config, model, **options)
            for name, (config, model, options) in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gemma_logits_and_generation_match_transformers(gemma, family):
    ref = gemma[family]
    model = hf.load(ref.folder)
    cfg = model.config
    assert (cfg.post_norms, cfg.sliding_window, cfg.global_every) == (True, 4, 2)
    assert cfg.query_pre_attn_scalar == 24
    if family == "gemma3":
        assert (cfg.qk_norm, cfg.rope_local_theta, cfg.rope_theta) == (True, 50.0, 1000.0)
        assert (cfg.rope_scaling, cfg.rope_factor) == ("linear", 2.0)
    else:
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (5.0, 3.0)
    error = ref_lib.max_error(model, ref)
    print(f"{family}: max logit error {error:.2e}")
    assert error < ref_lib.TOL
    assert ref_lib.jaxpar_generate(model) == ref.generated


@pytest.mark.parametrize("family, change", [
    ("gemma2", dict(final_logit_softcap=0.0)), ("gemma2", dict(attn_logit_softcap=0.0)),
    ("gemma2", dict(query_pre_attn_scalar=0.0)), ("gemma2", dict(global_every=0)),
    ("gemma3", dict(rope_local_theta=0.0)),
])
def test_the_gemma_comparison_can_fail(gemma, family, change):
    """Each Gemma 2 / 3 option changes the logits by far more than the tolerance."""
    ref = gemma[family]
    loaded = hf.load(ref.folder)
    model = jaxpar.models.Transformer(dataclasses.replace(loaded.config, **change),
                                      rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(loaded, nnx.Param))
    assert ref_lib.max_error(model, ref) > 100 * ref_lib.TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gemma_loads_sharded(gemma, family):
    import jax
    import jax.numpy as jnp
    import numpy as np

    ref = gemma[family]
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(dict(fsdp=4, tensor=2)), "fsdp_tp")
    model = hf.load(ref.folder, plan=plan)
    with plan.activate():
        logits = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ref_lib.IDS)))
    assert np.abs(logits * ref_lib.MASK[..., None] - ref.logits).max() < ref_lib.TOL


def test_gemma_round_trips_through_transformers(gemma, tmp_path):
    for family, ref in gemma.items():
        model = hf.load(ref.folder)
        ref_lib.check_round_trip(ref, model, tmp_path / family)
        # Saved without naming the architecture, the options choose it.
        again = hf.save(model, tmp_path / f"{family}-default")
        assert json.loads((again / "config.json").read_text())["architectures"] == [
            ref.architecture]


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["full_attention", "sliding_attention"]),
     "layer_types=['full_attention', 'sliding_attention'] is not supported (jaxpar's decoder "
     "makes every N-th layer global, the others local)"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1e4}}),
     "rope_parameters.sliding_attention="),
])
def test_gemma_options_jaxpar_cannot_express_are_named(gemma, tmp_path, changes, message):
    folder = tmp_path / "edited"
    shutil.copytree(gemma["gemma3"].folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(JaxparError) as err:
        hf.load(folder)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gemma_lora_exports_for_peft(gemma, family, tmp_path):
    pytest.importorskip("peft")
    model = hf.load(gemma[family].folder)
    jaxpar.lora.apply(model, rank=4, alpha=8.0)  # attention and MLP
    error = ref_lib.check_peft(gemma[family], model, tmp_path / "adapters")
    print(f"{family} + PEFT: max logit error {error:.2e}")
