"""``jaxpar inspect`` (jaxpar.cli.inspection): the report as tables or JSON, what it is given,
and a bad config key as one line with exit status 2."""

import json
import subprocess
import sys

import pytest

from jaxpar import cli
from jaxpar.analysis.report import render_inspection
from tests.analysis.test_inspection import FAST


def test_human_tables_print(devices, capsys):
    tiny = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", *FAST]
    assert cli.main(["inspect", "--config", "configs/tiny.yaml", *tiny]) == 0
    out = capsys.readouterr().out
    assert "mesh data=2 x fsdp=2 x tensor=2 (8 devices)" in out
    for heading in ("Parameters:", "Memory per device", "Collectives per device and step",
                    "matmul FLOPs (every loop trip)", "pred/meas", "blocks/mlp/w_up/kernel"):
        assert heading in out
    assert "all-reduce  tensor" in out


def test_offloaded_state_is_reported_in_host_memory(devices, capsys):
    tiny = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", *FAST,
            "plan.offload_optimizer=1", "plan.offload_params=true"]
    assert cli.main(["inspect", "--config", "configs/tiny.yaml", *tiny]) == 0
    out = capsys.readouterr().out
    assert "optimizer offload 1, weights streamed from host" in out
    for row in ("device arguments", "host arguments", "host total"):
        assert row in out


def test_bad_config_key_is_one_line_and_exit_2(devices, capsys):
    code = cli.main(["inspect", "--config", "configs/tiny.yaml", "--devices", "8",
                     "plan.rulez=tp"])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("jaxpar: error: unknown config key "
                                               "'plan.rulez'; did you mean 'plan.rules'?")


def test_peak_buffers_are_xlas_own_account_of_the_steps_memory():
    """``--peak-buffers``: XLA's memory-usage report of the step, its total the compiled
    step's memory (arguments and temporaries, XLA:CPU) and its slots largest first."""
    proc = subprocess.run([sys.executable, "-m", "jaxpar.cli", "inspect", "--config",
                           "configs/tiny.yaml", "--devices", "8", "--peak-buffers", "3",
                           "--json", "model.n_layers=1", *FAST],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    peak, memory = report["peak_buffers"], report["memory"]
    assert peak["total_bytes"] == pytest.approx(memory["total_bytes"], rel=1e-3)
    sizes = [b["bytes"] for b in peak["buffers"]]
    assert len(sizes) == 3 and sizes == sorted(sizes, reverse=True) and sizes[0] > 0
    assert all("[" in b["shapes"] for b in peak["buffers"])


REPORT = {
    "header": {"config": "defaults", "n_devices": 8, "platform": "cpu", "mesh": "data=8",
               "plan": "rules fsdp", "global_batch": 8, "seq_len": 16, "compile_s": 0.5},
    "param_count": 10, "params": [], "memory": {}, "predicted": None,
    "comparison": {"collectives": []}, "flops": 1.0,
}


def test_the_command_hands_the_config_over_and_prints_json_or_tables(monkeypatch, capsys):
    """compile_step and step_report (compiling a step) are replaced: what the command
    passes them and prints is checked, fast."""
    from jaxpar.analysis import inspection

    seen = []

    def fake_report(step, *, source):
        seen.append((step, source))
        return REPORT

    monkeypatch.setattr(inspection, "compile_step", lambda config, target: config)
    monkeypatch.setattr(inspection, "step_report", fake_report)
    assert cli.main(["inspect", "--json", "train.steps=7"]) == 0
    assert json.loads(capsys.readouterr().out) == REPORT
    (config, source), = seen
    assert source == "defaults" and config.train.steps == 7  # no --config: the defaults
    assert cli.main(["inspect", "--config", "configs/tiny.yaml"]) == 0
    assert capsys.readouterr().out == render_inspection(REPORT) + "\n"
    assert seen[1][1] == "configs/tiny.yaml"


def test_a_1f1b_pipeline_reports_its_ticks_and_bubble(devices, capsys):
    tiny = ["model.n_layers=8", "model.d_model=32", "model.d_ff=64", "train.global_batch=16",
            "train.seq_len=32", "mesh.stage=4",
            "mesh.data=2", "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2"]
    assert cli.main(["inspect", "--config", "configs/tiny.yaml", *tiny]) == 0
    out = capsys.readouterr().out
    assert "pipeline interleaved_1f1b: S=4 stages x R=2 repeats, M=4 microbatches" in out
    # One measure named the same on both lines: idle stage-ticks over all of them (the
    # counted ticks agree with the formula's 3/11); Megatron's idle over busy beside it.
    assert "bubble 27.3%," in out
    assert ("timeline: 22 ticks, 6 idle on each stage (bubble 27.3% of stage-ticks, as "
            "counted; 37.5% of busy time, Megatron's measure), at most 8 stage inputs "
            "held") in out
    # The microbatches are split over data by hand: the weight gradients are summed over
    # it once a step (runs 1), not in each of the 22 ticks; every collective is the
    # planner's, the input gradient's and the head's reductions over the stages included.
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines()
            if line.startswith("  all-reduce") or line.startswith("  collective-permute")}
    assert rows[("all-reduce", "data")][2:4] == ["1", "1"]
    assert rows[("all-reduce", "data,")][3:5] == ["1", "1"]  # over data and stage
    assert rows[("collective-permute", "stage")][3] == "44"  # 2 a tick
    total = next(line for line in out.splitlines() if line.startswith("  total  "))
    assert total.split()[-1] == "1.00"


def test_quantized_plans_are_named_in_the_header(devices, capsys):
    tiny = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", *FAST,
            "plan.quantize=int8", "plan.quantize_gather=int8"]
    assert cli.main(["inspect", "--config", "configs/tiny.yaml", *tiny]) == 0
    out = capsys.readouterr().out
    assert "int8 matmuls, int8 weight gathers" in out
