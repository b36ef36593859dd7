"""``jaxpar inspect``: one compiled (never run) train step, reported as JSON and as tables."""

import contextlib
import io
import json
import sys

import pytest

import jaxpar
from jaxpar import cli
from jaxpar.analysis.inspection import compare_collectives
from tests.helpers import MESH_2X2X2

# The tiny config on a 3D fsdp_tp mesh (data=2 x fsdp=2 x tensor=2), with a short batch
# so the compile stays quick.
FAST = [*MESH_2X2X2, "train.global_batch=16", "train.seq_len=32"]


@pytest.fixture(scope="module")
def report(devices):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["inspect", "--config", "configs/tiny.yaml", "--json", *FAST]) == 0
    return json.loads(out.getvalue())


def test_json_has_every_key(report):
    assert {"params", "memory", "collectives", "flops", "predicted"} <= set(report)
    assert {"argument_bytes", "output_bytes", "temp_bytes"} <= set(report["memory"])
    assert all(report["memory"][k] > 0 for k in ("argument_bytes", "output_bytes",
                                                  "temp_bytes"))
    assert report["flops"] > 0
    for row in report["collectives"]:
        assert {"kind", "count", "bytes_per_device", "axes"} <= set(row)
        assert row["count"] > 0 and row["bytes_per_device"] > 0
    assert report["flops_detail"]["xla_cost_analysis"] > 0


def test_planner_prediction_sits_beside_each_figure(report):
    pred = report["predicted"]
    assert pred is not None, report["notes"]
    assert {"argument_bytes", "output_bytes", "temp_bytes"} <= set(pred["memory"])
    mem = report["memory"]
    assert 0.8 < pred["memory"]["argument_bytes"] / mem["argument_bytes"] < 1.25
    assert 0.8 < pred["memory"]["total_bytes"] / mem["total_bytes"] < 1.25
    assert 0.9 < report["comparison"]["predicted_flops"] / report["flops"] < 1.1
    rows = report["comparison"]["collectives"]
    measured = sum(r["bytes_per_step"] or 0 for r in rows)
    predicted = sum(r["predicted_bytes_per_step"] or 0 for r in rows)
    assert 0.85 < predicted / measured < 1.15


def test_matmul_flops_count_every_scanned_layer(report):
    # The layers run under lax.scan: XLA's cost analysis counts the loop body once, the
    # matmul count multiplies it by the trip count and lands near 6 x params x tokens.
    config = jaxpar.load_config("configs/tiny.yaml")
    tokens = 16 * 32
    six_n_t = 6 * config.model.param_count() * tokens / 8
    assert 0.9 * six_n_t < report["flops"] < 1.3 * six_n_t
    assert report["flops_detail"]["loops"] >= 2
    assert report["flops_detail"]["xla_cost_analysis"] < 0.6 * report["flops"]


def test_params_table_matches_the_model(report):
    config = jaxpar.load_config("configs/tiny.yaml")
    assert report["param_count"] == config.model.param_count()
    rows = {r["path"]: r for r in report["params"]}
    assert sum(r["bytes_per_device"] for r in rows.values()) < 4 * config.model.param_count()
    up = rows["blocks/mlp/w_up/kernel"]
    assert up["logical_axes"] == ["layers", "embed", "mlp"]
    assert up["spec"] == [None, "fsdp", "tensor"]
    assert up["bytes_per_device"] == 4 * 128 * 512 * 4 // 4
    # The argument buffers hold params, Adam's two moments and the batch: about 3x params.
    params_bytes = sum(r["bytes_per_device"] for r in rows.values())
    assert 2.5 * params_bytes < report["memory"]["argument_bytes"] < 4 * params_bytes


def test_fsdp_gathers_and_tensor_reduces(report):
    kinds = {(r["kind"], tuple(r["axes"])) for r in report["collectives"]}
    assert ("all-gather", ("fsdp",)) in kinds
    assert ("all-reduce", ("tensor",)) in kinds
    assert all(set(r["axes"]) <= {"data", "stage", "fsdp", "tensor"}
               for r in report["collectives"])


def test_compare_collectives_joins_on_kind_and_axes(devices):
    mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    measured = [{"kind": "all-reduce", "axes": ["data", "fsdp"], "count": 2,
                 "bytes_per_device": 100, "executions": 8, "bytes_per_step": 400,
                 "wire_bytes_per_step": 600}]
    predicted = [{"kind": "all-reduce", "axes": ["fsdp", "data"], "bytes_per_device": 90,
                  "count": 2, "executions": 8, "bytes_per_step": 360,
                  "wire_bytes_per_step": 540},
                 {"kind": "all-gather", "axes": ["fsdp"], "bytes_per_device": 10,
                  "count": 1, "executions": 4, "bytes_per_step": 40, "wire_bytes_per_step": 20}]
    rows = compare_collectives(measured, predicted, mesh)
    assert rows[0]["predicted_bytes_per_device"] == 90
    assert rows[0]["predicted_bytes_per_step"] == 360 and rows[0]["step_ratio"] == 0.9
    assert rows[1] == {"kind": "all-gather", "axes": ["fsdp"], "count": 0, "executions": 0,
                       "bytes_per_device": None, "bytes_per_step": None,
                       "wire_bytes_per_step": None,
                       "predicted_bytes_per_device": 10, "predicted_count": 1,
                       "predicted_bytes_per_step": 40, "predicted_executions": 4,
                       "predicted_wire_bytes_per_step": 20, "step_ratio": None}


def test_planner_failure_or_absence_leaves_a_note(monkeypatch):
    import jaxpar.planner
    from jaxpar.analysis.inspection import planner_prediction

    config = jaxpar.load_config("configs/tiny.yaml")

    def broken(config, n_devices):
        raise KeyError("no such layout")

    monkeypatch.setattr(jaxpar.planner, "predict", broken)
    pred, note = planner_prediction(config, 8)
    assert pred is None and "KeyError" in note and "no such layout" in note
    monkeypatch.setitem(sys.modules, "jaxpar.planner", None)
    pred, note = planner_prediction(config, 8)
    assert pred is None and "not available" in note
