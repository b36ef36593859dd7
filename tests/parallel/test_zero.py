"""ZeRO stages: per-device model-state bytes follow the paper's arithmetic; losses do not move."""

import numpy as np
import pytest

import jaxpar
from jaxpar.analysis.hlo import memory_stats
from jaxpar.config.assembly import build_trainer
from jaxpar.parallel.zero import formula_bytes, zero_spec
from tests.helpers import loader, small_config

MIXED = "plan.precision=params=float32,compute=bfloat16,output=float32"


def trainer(*overrides):
    return build_trainer(small_config(*overrides))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_match_zero_formula(stage):
    report = trainer("mesh.data=8", f"plan.zero_stage={stage}", MIXED).memory_report(
        loader().batch(0))
    measured = report["param_bytes"] + report["grad_bytes"] + report["opt_bytes"]
    assert measured == pytest.approx(report["formula_bytes"], rel=0.05)
    assert report["formula_bytes"] == formula_bytes(stage, report["n_params"], 8)


def test_stage3_composes_with_tensor_parallelism():
    report = trainer("mesh.data=4", "mesh.tensor=2", "plan.zero_stage=3", MIXED
                     ).memory_report(loader().batch(0))
    measured = report["param_bytes"] + report["grad_bytes"] + report["opt_bytes"]
    # Norm scales are replicated over tensor, so allow the 5% the issue allows.
    assert measured == pytest.approx(formula_bytes(3, report["n_params"], 4, 2), rel=0.05)


def test_stages_train_identically():
    def run(stage):
        t = trainer("mesh.data=8", f"plan.zero_stage={stage}")
        return [t.step(loader().batch(i))["loss"] for i in range(3)]

    reference = run(0)
    for stage in (1, 2, 3):
        np.testing.assert_allclose(run(stage), reference, rtol=1e-5)


def test_indivisible_state_is_left_whole_and_reported(devices):
    mesh = jaxpar.make_mesh({"data": 8})
    spec, split = zero_spec(jaxpar.Rules([]).spec((None,), mesh), (6,), mesh, ("data",))
    assert not split and tuple(spec) == (None,)
    spec, split = zero_spec(jaxpar.Rules([]).spec((None, None), mesh), (8, 16), mesh, ("data",))
    assert split and tuple(spec) == (None, "data")  # the largest divisible dimension


def test_remat_full_lowers_compiled_temp_memory():
    def temp(remat):
        t = trainer("mesh.data=8", f"plan.remat={remat}", "model.n_layers=4")
        return memory_stats(t.lower(loader().batch(0)).compile())["temp_bytes"]

    assert temp("full") < 0.8 * temp("none")


def test_gradient_accumulation_equals_large_batch():
    big = trainer("mesh.data=8", "train.global_batch=32")
    acc = trainer("mesh.data=8", "train.global_batch=32", "plan.microbatches=4")
    data = loader(batch=32)
    for i in range(3):
        a, b = big.step(data.batch(i)), acc.step(data.batch(i))
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    np.testing.assert_allclose(np.asarray(acc.state["params"]["embed"].get_value()),
                               np.asarray(big.state["params"]["embed"].get_value()),
                               rtol=1e-4, atol=1e-6)


# --- ZeRO++ qwZ: int8 weight gathers -----------------------------------------------------
def _gathers(axes: dict, rules: str, zero: int, quantize_gather: str):
    """(collectives by kind and axes, losses of three steps) of a bf16-compute step."""
    import optax
    from flax import nnx

    from jaxpar.analysis.hlo import collective_table
    from jaxpar.models import Transformer, TransformerConfig
    from jaxpar.sharding.precision import Policy

    cfg = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=256, max_seq_len=32)
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), rules, zero_stage=zero,
                                   quantize_gather=quantize_gather,
                                   precision=Policy.parse("p=f32,c=bf16,o=f32"))
    step = jaxpar.Trainer(jaxpar.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)),
                                              plan), optax.adam(1e-2), plan)
    batch = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    rows = collective_table(step.lower(batch).compile().as_text(), plan.mesh)
    table = {(r["kind"], tuple(r["axes"])): r["bytes_per_device"] for r in rows}
    return table, [float(step.step(batch)["loss"]) for _ in range(3)]


@pytest.mark.parametrize("axes,rules,zero", [
    ({"fsdp": 8}, "fsdp", 0),
    ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp", 3),
], ids=["fsdp8", "zero3-data2-fsdp2-tensor2"])
def test_int8_weight_gathers_move_a_quarter_of_the_bytes(devices, axes, rules, zero):
    """plan.quantize_gather=int8 (ZeRO++ qwZ): the weights' all-gathers carry int8 and
    per-row scales. XLA:CPU runs bf16 matmuls in f32 and gathers the weights widened, so
    the bytes fall to under 30% of that, under 60% of a bf16 gather;
    no other collective appears, the gradient reductions are unchanged, and three steps'
    losses stay within 1e-4 of the unquantized run's."""
    plain, plain_losses = _gathers(axes, rules, zero, "none")
    quant, quant_losses = _gathers(axes, rules, zero, "int8")
    gathered = lambda t: sum(v for (kind, _), v in t.items() if kind == "all-gather")  # noqa: E731
    assert gathered(quant) < 0.3 * gathered(plain)
    assert gathered(quant) < 0.6 * gathered(plain) / 2
    assert set(quant) <= set(plain)
    assert {k: v for k, v in quant.items() if k[0] != "all-gather"} == {
        k: v for k, v in plain.items() if k[0] not in ("all-gather", "collective-permute")}
    assert max(abs(a - b) / b for a, b in zip(quant_losses, plain_losses, strict=True)) < 1e-4


def test_int8_gathers_refuse_streamed_weights():
    with pytest.raises(jaxpar.JaxparError, match="plan.quantize_gather quantizes weights on "
                                                 "the device"):
        jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 8}), "fsdp",
                                quantize_gather="int8", offload_params=True)
