"""The planner's figures for a run config: the candidate a config describes (the free
mesh axis filled, the plan's knobs carried over), bad meshes refused by name, and the
shape of what ``predict`` returns. (How close these figures come to what XLA compiles is
checked in test_planner.py.)"""

import pytest

import jaxpar
from jaxpar.planner import BUILTIN, Machine, predict
from jaxpar.planner.prediction import candidate_from_config, spec_from_config
from tests.planner.cases import make_config

# Model A of cases.MODELS: 2 layers of d_model 64, 8 heads of 8 (4 KV heads), d_ff 128.
A_LAYER = 2 * 64 + 64 * 8 * (8 + 4 + 4) + 8 * 8 * 64 + 3 * 64 * 128
A_PARAMS = 256 * 64 + 2 * A_LAYER + 64 + 64 * 256


def test_candidate_carries_the_config_knobs():
    config = make_config("A", 16, 64, "mesh.data=-1 mesh.tensor=2 plan.zero_stage=1 "
                         "plan.remat=full plan.microbatches=2 plan.sequence_parallel=true "
                         "plan.precision=p=f32,c=bf16,o=f32 train.optimizer=sgd "
                         "pipeline.microbatches=0")
    cand = candidate_from_config(config, 8)
    assert cand.sizes == {"data": 4, "stage": 1, "fsdp": 1, "expert": 1, "context": 1,
                          "tensor": 2}  # data=-1 takes what tensor leaves
    assert (cand.zero_stage, cand.remat, cand.microbatches) == (1, "full", 2)
    assert (cand.precision, cand.optimizer, cand.sequence_parallel) == (
        "bfloat16", "sgd", True)
    assert candidate_from_config(make_config("A", 16, 64, ""), 8).precision == "float32"
    assert candidate_from_config(make_config("A", 16, 64, "mesh.data=1 mesh.fsdp=-1 "
                                             "plan.vocab_over_fsdp=true"), 8).vocab_over_fsdp


def test_slices_split_the_devices_first():
    cand = candidate_from_config(make_config("A", 16, 64, "mesh.data=-1 mesh.dcn_data=2"), 8)
    assert dict(cand.ici)["data"] == 4 and dict(cand.dcn)["data"] == 2
    assert cand.n_devices == 8


@pytest.mark.parametrize(("knobs", "message"), [
    ("mesh.data=2 mesh.tensor=2", r"mesh axes \{.*\} needs 4 devices, not 8"),
    ("mesh.data=-1 mesh.tensor=3", r"mesh axes \{.*'tensor': 3\} does not fit 8 devices"),
    ("mesh.data=-1 mesh.fsdp=-1", r"mesh axes \{.*'fsdp': -1.*\} does not fit 8 devices"),
    ("mesh.data=-1 mesh.dcn_data=3", "8 devices do not form 3 slices"),
])
def test_meshes_that_do_not_fit_the_devices(knobs, message):
    with pytest.raises(jaxpar.JaxparError, match=message):
        candidate_from_config(make_config("A", 16, 64, knobs), 8)


def test_spec_follows_the_pipeline_stages():
    config = make_config("A", 16, 64, "")
    assert spec_from_config(config).n_params == A_PARAMS
    staged = spec_from_config(config, stages=2)
    assert staged.n_params == A_PARAMS
    assert {t.names[:2] for t in staged.tensors if t.path.startswith("blocks/")} == {
        ("repeat", "stage")}


def test_prediction_for_a_config():
    config = make_config("A", 16, 64, "mesh.data=-1 mesh.tensor=2 plan.remat=full")
    got = predict(config, 8)
    assert got["n_params"] == A_PARAMS and got["backend"] == "cpu"
    assert got["mesh"]["data"] == {"size": 4, "ici": 4, "dcn": 1}
    memory = got["memory"]
    assert all(isinstance(v, int) for v in memory.values())
    assert memory["total_bytes"] == pytest.approx(memory["argument_bytes"]
                                                  + memory["temp_bytes"], abs=2)
    kinds = {(r["kind"], tuple(r["axes"])) for r in got["collectives"]}
    assert ("all-reduce", ("tensor",)) in kinds and ("all-reduce", ("data",)) in kinds
    # Per device: executed FLOPs exceed the model's by what full remat recomputes.
    assert got["flops"] > got["model_flops"] > 0 and got["step_time_s"] > 0
    # Tokens x 6 N plus attention over all 8 devices (model A's PaLM FLOPs), per device.
    matmul_params = A_PARAMS - 256 * 64 - (2 * 2 + 1) * 64  # no lookup table, no norms
    assert got["model_flops"] * 8 == pytest.approx(
        16 * 64 * (6 * matmul_params + 12 * 2 * 8 * 8 * 64))


def test_accelerator_forms_and_machines():
    config = make_config("A", 16, 64, "mesh.data=-1 plan.zero_stage=2 plan.rules=dp")
    kinds = lambda got: {r["kind"] for r in got["collectives"]}
    assert "reduce-scatter" not in kinds(predict(config, 8))  # XLA:CPU all-reduces
    on_tpu = predict(config, 8, backend="tpu", machine=Machine(BUILTIN["tpu-v5p"], 8))
    assert "reduce-scatter" in kinds(on_tpu) and on_tpu["backend"] == "tpu"
    assert on_tpu["step_time_s"] < predict(config, 8)["step_time_s"]
