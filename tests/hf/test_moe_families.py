"""Mixtral, Qwen3-MoE and Qwen2-MoE in and out of Hugging Face against ``transformers``:
tiny random models onto jaxpar's mixture-of-experts layers. The routing is
transformers': softmax over the experts, the top ``num_experts_per_tok``, renormalised
only with ``norm_topk_prob`` (Mixtral always), and Qwen2-MoE's shared expert weighted by
its sigmoid gate. transformers drops no token, so a loaded model is dropless
(``expert_capacity=0``); the capacity path is compared too, with a capacity factor of
``n_experts / experts_per_token``, which gives every expert a slot for every token of
the sequence, so nothing is dropped either. Logits on a padded batch within 1e-5, greedy
generation equal, the export read back by transformers bit-exact; a jaxpar MoE model
exports too; the MoE keys jaxpar cannot express are named."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar import hf
from jaxpar.errors import JaxparError
from jaxpar.models.config import TransformerConfig
from tests.hf import reference as ref_lib

pytest.importorskip("torch")
pytest.importorskip("transformers")

FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True)),
    "qwen3_moe_unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=False)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64)),
}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """family -> its saved reference model."""
    root = tmp_path_factory.mktemp("moe")
    return {name: ref_lib.make_reference(root / name, config, model, **options)
            for name, (config, model, options) in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_logits_and_generation_match_transformers(moe, family):
    ref = moe[family]
    model = hf.load(ref.folder)
    cfg = model.config
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_capacity) == (4, 2, 0.0)
    assert cfg.renormalize_gates == (family != "qwen3_moe_unnormalised" and
                                     family != "qwen2_moe")
    assert cfg.shared_expert_gate == (family == "qwen2_moe")
    error = ref_lib.max_error(model, ref)
    print(f"{family}: max logit error {error:.2e}")
    assert error < ref_lib.TOL
    assert ref_lib.jaxpar_generate(model) == ref.generated


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_capacity_path_that_drops_nothing_matches(moe, family):
    """The capacity path, with capacity factor n_experts / k (every expert can take every
    token of the sequence: nothing is dropped), computes the same logits."""
    ref = moe[family]
    loaded = hf.load(ref.folder)
    cfg = dataclasses.replace(loaded.config, expert_capacity=4 / 2)
    model = jaxpar.models.Transformer(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(loaded, nnx.Param))
    assert ref_lib.max_error(model, ref) < ref_lib.TOL


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_moe_loads_sharded_over_experts(moe, family):
    ref = moe[family]
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(dict(fsdp=2, expert=2, tensor=2)),
                                   "fsdp_tp")
    model = hf.load(ref.folder, plan=plan)
    w_gate = model.blocks.mlp.w_gate.kernel.get_value()  # (layers, expert, embed, mlp)
    assert "expert" in str(w_gate.sharding.spec)
    import jax
    import jax.numpy as jnp

    with plan.activate():
        logits = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ref_lib.IDS)))
    assert np.abs(logits * ref_lib.MASK[..., None] - ref.logits).max() < ref_lib.TOL


def test_moe_round_trips_through_transformers(moe, tmp_path):
    for family, ref in moe.items():
        ref_lib.check_round_trip(ref, hf.load(ref.folder), tmp_path / family)


@pytest.mark.parametrize("options, arch", [
    (dict(), "MixtralForCausalLM"),
    (dict(qk_norm=True, renormalize_gates=False, expert_d_ff=32), "Qwen3MoeForCausalLM"),
    (dict(n_shared_experts=2, shared_expert_gate=True, qkv_bias=True, expert_d_ff=32),
     "Qwen2MoeForCausalLM"),
])
def test_jaxpar_moe_models_export_to_transformers(tmp_path, options, arch):
    import torch
    import transformers

    cfg = TransformerConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=96, max_seq_len=64, n_experts=4, experts_per_token=2,
                            expert_capacity=0.0, init_std=0.1, **options)
    model = jaxpar.models.Transformer(cfg, rngs=nnx.Rngs(3))
    out = hf.save(model, tmp_path / "moe")
    assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        want = back(torch.tensor(ref_lib.IDS)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ref_lib.IDS)), want, atol=ref_lib.TOL, rtol=0)


@pytest.mark.parametrize("family, changes, message", [
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers=[1] is not supported"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=48),
     "shared_expert_intermediate_size=48 is not supported"),
])
def test_moe_options_jaxpar_cannot_express_are_named(moe, tmp_path, family, changes, message):
    folder = tmp_path / "edited"
    shutil.copytree(moe[family].folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(JaxparError) as err:
        hf.load(folder)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_moe_comparison_can_fail(moe):
    """Renormalising the top-k gates where transformers does not (and dropping tokens for
    lack of capacity) changes the logits by far more than the tolerance."""
    ref = moe["qwen3_moe_unnormalised"]
    loaded = hf.load(ref.folder)
    for change in (dict(renormalize_gates=True), dict(expert_capacity=0.5)):
        model = jaxpar.models.Transformer(dataclasses.replace(loaded.config, **change),
                                          rngs=nnx.Rngs(0))
        nnx.update(model, nnx.state(loaded, nnx.Param))
        assert ref_lib.max_error(model, ref) > 100 * ref_lib.TOL, change


def test_a_moe_run_exports_from_the_command_line(tmp_path):
    """``jaxpar export`` of a mixture-of-experts run (trained with a capacity factor)
    writes a Mixtral folder: its weights are the run's, and transformers computes what the
    dropless jaxpar model of that folder computes."""
    import jax
    import torch
    import transformers

    from jaxpar.checkpoint.checkpointer import Checkpointer
    from jaxpar.cli import main
    from jaxpar.config.assembly import assemble
    from jaxpar.config.schema import load_config
    from jaxpar.runs.generate import load_run_model

    run = tmp_path / "run"
    config = load_config(None, ["model.d_model=32", "model.n_layers=1", "model.d_ff=64",
                                "model.n_experts=4", "model.init_std=0.1", "mesh.data=1",
                                "mesh.fsdp=-1"])
    trainer = assemble(config, devices=jax.devices()[:1]).trainer
    with Checkpointer(run / "checkpoints", every=1, keep=1) as checkpointer:
        checkpointer.save(trainer, config=config, force=True)
    assert main(["export", "--run", str(run), "--to-hf", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "MixtralForCausalLM"]
    exported, (trained, _) = hf.load(out), load_run_model(run)
    assert trained.config.expert_capacity == 1.25 and exported.config.expert_capacity == 0
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(trained, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(exported, nnx.Param)),
                                 strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                      err_msg=str(path))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = ref_lib.IDS % trained.config.vocab_size
    with torch.no_grad():
        want = back(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(exported(ids)), want, atol=ref_lib.TOL, rtol=0)


def test_moe_saved_in_bf16_shards_reads_back(moe, tmp_path):
    """Per-expert tensors spread over several safetensors files, stored as bf16: jaxpar
    and transformers read the folder alike."""
    import jax.numpy as jnp
    import torch
    import transformers

    model = hf.load(moe["qwen3_moe"].folder)
    out = hf.save(model, tmp_path / "sharded", max_shard_bytes=40_000, dtype=jnp.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index["weight_map"]
    again = hf.load(out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(ref_lib.jaxpar_logits(again), ref_lib.hf_logits(back),
                               atol=ref_lib.TOL, rtol=0)


def test_moe_lora_on_attention_exports_for_peft_and_on_experts_is_refused(moe, tmp_path):
    pytest.importorskip("peft")
    ref = moe["qwen2_moe"]
    model = hf.load(ref.folder)
    jaxpar.lora.apply(model, target="attn/w[qkvo]$", rank=4, alpha=8.0)
    ref_lib.check_peft(ref, model, tmp_path / "attention")
    experts = hf.load(ref.folder)
    jaxpar.lora.apply(experts, rank=4, alpha=8.0)  # the default target: experts too
    with pytest.raises(JaxparError, match=r"^adapter on blocks/mlp/w_(gate|up|down): PEFT has "
                                          r"no module for it \(the experts, apart in "
                                          r"Qwen2MoeForCausalLM module model.layers.\{i\}.mlp."
                                          r"experts.\{j\}"):
        hf.save_adapters(experts, tmp_path / "experts")


def test_moe_converts_from_the_command_line_with_a_capacity(moe, tmp_path):
    """``jaxpar convert`` of a MoE folder: dropless by default, and a capacity factor may
    be set as an override (here one that drops nothing: the logits stay transformers')."""
    from jaxpar.cli import main
    from jaxpar.runs.generate import load_run_model

    ref = moe["qwen2_moe"]
    for capacity in (None, 2.0):
        run = tmp_path / f"run-{capacity}"
        extra = [] if capacity is None else [f"model.expert_capacity={capacity}"]
        assert main(["convert", "--from-hf", str(ref.folder), "--out", str(run), *extra]) == 0
        model, _ = load_run_model(run)
        assert model.config.expert_capacity == (capacity or 0.0)
        assert ref_lib.max_error(model, ref) < ref_lib.TOL
