"""Phi-3 (mini) in and out of Hugging Face against ``transformers``: a tiny random
``Phi3ForCausalLM`` whose fused ``qkv_proj`` and ``gate_up_proj`` jaxpar splits into its
own projections on load and fuses again on export; logits on a padded batch within
1e-5, greedy generation equal, the export read back by transformers with identical
logits and bit-exact tensors, and the Phi-3 options jaxpar cannot express named."""

import json
import shutil

import numpy as np
import pytest

from jaxpar import hf
from jaxpar.errors import JaxparError
from tests.hf import reference as ref_lib

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """The saved Phi-3 models: plain, with a sliding window, and with rotary embeddings on
    half of each head (``partial_rotary_factor``, as Phi-4-mini has)."""
    root = tmp_path_factory.mktemp("phi3")
    return {"plain": ref_lib.make_reference(root / "plain", "Phi3Config", "Phi3ForCausalLM"),
            "window": ref_lib.make_reference(root / "window", "Phi3Config",
                                             "Phi3ForCausalLM", sliding_window=4),
            "partial": ref_lib.make_reference(root / "partial", "Phi3Config",
                                              "Phi3ForCausalLM", partial_rotary_factor=0.5)}


@pytest.mark.parametrize("variant", ["plain", "window", "partial"])
def test_phi3_logits_and_generation_match_transformers(phi3, variant):
    ref = phi3[variant]
    model = hf.load(ref.folder)
    assert model.config.sliding_window == (4 if variant == "window" else 0)
    assert model.config.rotary_dim == (8 if variant == "partial" else 0)
    error = ref_lib.max_error(model, ref)
    print(f"phi3 {variant}: max logit error {error:.2e}")
    assert error < ref_lib.TOL
    assert ref_lib.jaxpar_generate(model) == ref.generated


def test_phi3_fused_projections_are_split_exactly(phi3):
    from safetensors.numpy import load_file

    ref = phi3["plain"]
    model = hf.load(ref.folder)
    stored = load_file(ref.folder / "model.safetensors")
    qkv = stored["model.layers.1.self_attn.qkv_proj.weight"]  # (q + k + v rows, d_model)
    wk = np.asarray(model.blocks.attn.wk.kernel.get_value()[1])  # (d_model, kv_heads, head)
    np.testing.assert_array_equal(wk.reshape(64, -1).T, qkv[64:96])
    gate_up = stored["model.layers.0.mlp.gate_up_proj.weight"]
    np.testing.assert_array_equal(np.asarray(model.blocks.mlp.w_up.kernel.get_value()[0]).T,
                                  gate_up[96:])


def test_phi3_round_trips_through_transformers(phi3, tmp_path):
    for variant, ref in phi3.items():
        ref_lib.check_round_trip(ref, hf.load(ref.folder), tmp_path / variant)


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                           "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}),
     "rope type 'longrope' is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                           "partial_rotary_factor": 0.3125}),
     "rope_parameters.partial_rotary_factor=0.3125 is not supported (it must rotate an even "
     "number of head_dim=16's dimensions)"),
])
def test_phi3_options_jaxpar_cannot_express_are_named(phi3, tmp_path, changes, message):
    folder = tmp_path / "edited"
    shutil.copytree(phi3["plain"].folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(JaxparError) as err:
        hf.load(folder)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_phi3_loads_sharded_and_pipelined(phi3):
    """Each device reads its rows of the fused tensors (heads and MLP columns split over
    tensor, layers over stages): the logits stay transformers'."""
    import jax
    import jax.numpy as jnp

    import jaxpar

    ref = phi3["window"]
    for axes in (dict(fsdp=4, tensor=2), dict(stage=2, fsdp=2, tensor=2)):
        plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), "fsdp_tp")
        model = hf.load(ref.folder, plan=plan)
        with plan.activate():
            logits = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ref_lib.IDS)))
        error = np.abs(logits * ref_lib.MASK[..., None] - ref.logits).max()
        assert error < ref_lib.TOL, axes


def test_phi3_lora_exports_for_peft_where_a_module_is_its_own(phi3, tmp_path):
    """Adapters on o_proj and down_proj are Phi-3 modules of their own; an adapter on q, k,
    v, gate or up would be one part of a fused module, which PEFT cannot adapt alone."""
    pytest.importorskip("peft")
    import jaxpar

    ref = phi3["plain"]
    model = hf.load(ref.folder)
    jaxpar.lora.apply(model, target="(attn/wo|mlp/w_down)$", rank=4, alpha=8.0)
    ref_lib.check_peft(ref, model, tmp_path / "own", architecture="Phi3ForCausalLM")
    fused = hf.load(ref.folder)
    jaxpar.lora.apply(fused, rank=4, alpha=8.0)
    with pytest.raises(JaxparError, match=r"^adapter on blocks/(attn/w[qkv]|mlp/w_(gate|up)): "
                                          r"PEFT has no module for it \(one part of the fused "
                                          r"Phi3ForCausalLM module model.layers.\{i\}.(self_attn"
                                          r".qkv_proj|mlp.gate_up_proj)\)"):
        hf.save_adapters(fused, tmp_path / "fused", architecture="Phi3ForCausalLM")


def test_a_run_from_phi3_exports_as_phi3(phi3, tmp_path):
    """``jaxpar convert`` then ``jaxpar export``: the run started from a Phi-3 folder is
    written back as Phi-3 (its fused tensors bit-exact), not as the Llama its options also
    describe."""
    from jaxpar.cli import main

    ref = phi3["plain"]
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["convert", "--from-hf", str(ref.folder), "--out", str(run)]) == 0
    assert main(["export", "--run", str(run), "--to-hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "Phi3ForCausalLM"]
    from safetensors.numpy import load_file

    original, saved = load_file(ref.folder / "model.safetensors"), load_file(
        out / "model.safetensors")
    assert sorted(saved) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)


@pytest.mark.parametrize("variant, change", [("window", dict(sliding_window=0)),
                                             ("partial", dict(rotary_dim=0))])
def test_the_phi3_comparison_can_fail(phi3, variant, change):
    """The window and the partial rotation each move the logits by far more than the
    tolerance."""
    import dataclasses

    from flax import nnx

    import jaxpar

    loaded = hf.load(phi3[variant].folder)
    model = jaxpar.models.Transformer(dataclasses.replace(loaded.config, **change),
                                      rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(loaded, nnx.Param))
    assert ref_lib.max_error(model, phi3[variant]) > 100 * ref_lib.TOL
