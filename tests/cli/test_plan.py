"""``jaxpar plan``'s output and checks (jaxpar.cli.plan): the plan table and the step
breakdown against expected text from hand-made rows, and the axis-size lists."""

import pytest

from jaxpar.cli import main
from jaxpar.cli.plan import _allowed, _mesh_text, breakdown_text, table
from jaxpar.errors import JaxparError

GIB = 2**30
PLAN = ["plan", "--model", "configs/tiny.yaml", "--chips", "cpu:8", "--global-batch", "8",
        "--seq", "128"]


def _axis(ici: int, dcn: int = 1) -> dict:
    return {"size": ici * dcn, "ici": ici, "dcn": dcn}


BEST = {"mesh": {"data": _axis(1, 2), "fsdp": _axis(8), "tensor": _axis(1)},
        "sequence_parallel": True, "context_attention": None, "zero_stage": 3,
        "remat": "full", "microbatches": 2, "pipeline_microbatches": None,
        "memory_per_device_bytes": 30 * GIB, "hbm_bytes": 80 * GIB, "fits": True,
        "step_time_s": 1.25, "tflops_per_device": 412.4, "mfu": 0.4167,
        "reason": "the fastest that fits",
        "breakdown": {"compute: matmul": 0.75, "optimizer update": 0.125,
                      "all-gather (fsdp)": 0.25, "pipeline bubble": 0.125}}
WORST = {"mesh": {"data": _axis(1), "fsdp": _axis(1)}, "sequence_parallel": False,
         "context_attention": "ring", "zero_stage": 0, "remat": "none", "microbatches": 1,
         "pipeline_microbatches": 4, "pipeline_schedule": "1f1b",
         "memory_per_device_bytes": 100 * GIB,
         "hbm_bytes": 80 * GIB, "fits": False, "step_time_s": 0.5, "tflops_per_device": 9.6,
         "mfu": 0.05, "reason": "-", "breakdown": {}}


def test_mesh_text_shows_the_axes_used_as_ici_times_dcn():
    assert _mesh_text(BEST["mesh"]) == "data=1*2 fsdp=8"
    assert _mesh_text(WORST["mesh"]) == "single"
    assert _mesh_text({"tensor": _axis(4, 2), "stage": _axis(2)}) == "tensor=4*2 stage=2"


def test_breakdown_lists_the_largest_parts_then_the_rest():
    name = "{:48}".format
    assert breakdown_text(BEST, top=2).splitlines() == [
        "where #1's step goes (1.250 s):",
        f"  {name('compute: matmul')}    0.7500 s   60.0%",
        f"  {name('all-gather (fsdp)')}    0.2500 s   20.0%",
        f"  {name('(the rest)')}    0.2500 s   20.0%",  # bubble + optimizer
        "  MFU 41.7% = model FLOPs / (step x peak), from the times above",
    ]
    assert len(breakdown_text(BEST).splitlines()) == 6  # every part, no rest line


def test_plan_table_matches_the_expected_text():
    text = table([BEST, WORST], "plan: header line")
    # Columns are left-aligned to their widest cell, two spaces apart.
    assert text.splitlines()[:5] == [
        "plan: header line",
        "#  mesh (ici*dcn)   sp   cp attn  zero  remat  mb  pipeline  mem GiB     fits  step s  "
        "TFLOP/s  MFU  ",
        "-  ---------------  ---  -------  ----  -----  --  --------  ----------  ----  ------  "
        "-------  -----",
        "1  data=1*2 fsdp=8  yes  -        3     full   2   -         30.0/80.0   yes   1.250   "
        "412      41.7%",
        "2  single           -    ring     0     none   1   4 1f1b    100.0/80.0  NO    0.500   "
        "10       5.0% ",
    ]
    assert text.splitlines()[5] == "why #1: the fastest that fits"
    assert text.endswith(breakdown_text(BEST))


def test_a_table_without_plans_is_its_header_and_columns():
    assert table([], "nothing").splitlines()[0] == "nothing"
    assert len(table([], "nothing").splitlines()) == 3  # header, columns, rule


def test_no_layout_at_all_is_one_line(capsys):
    # The planner finds no layout at all for a global batch of 3 x seq 7 on 8 chips.
    # (With --json the same input ends in the one-line error, as it should.)
    assert main(["plan", "--model", "configs/tiny.yaml", "--chips", "cpu:8",
                 "--global-batch", "3", "--seq", "7"]) == 2
    assert "(no layout works)" in capsys.readouterr().err


def test_axis_size_lists():
    assert _allowed(None) is None
    assert _allowed(4) == (4,)
    assert _allowed("8") == (8,)
    assert _allowed("1,2, 4") == (1, 2, 4)
    for bad in ("", "0,2", "2,-1", "a,b", "2;4"):
        with pytest.raises(JaxparError, match="axis sizes must be positive integers"):
            _allowed(bad)


@pytest.mark.parametrize("extra, message", [
    (["--top", "0"], "--top 0: must be at least 1"),
    (["--slices", "0"], "--slices 0: must be at least 1"),
    (["--verify", "-1"], "--verify -1: must be 0 or more (the number of plans to compile)"),
    (["--context", "1,x"], "axis sizes must be positive integers separated by commas, got "
                           "'1,x'"),
])
def test_bad_numbers_are_one_line(extra, message, capsys, tmp_path):
    assert main([*PLAN, *extra, "--write", str(tmp_path / "plan.yaml")]) == 2
    err = capsys.readouterr().err
    assert err == f"jaxpar: error: {message}\n"
    assert not (tmp_path / "plan.yaml").exists()


def test_a_reader_that_stops_early_ends_the_plan_quietly(capsys, monkeypatch):
    """``jaxpar plan ... | head``: the closed pipe is exit 141 and no traceback."""
    import sys

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main([*PLAN, "--top", "1"]) == 141
    assert capsys.readouterr().err == ""


def test_write_refuses_an_existing_file_unless_forced(tmp_path, capsys):
    target = tmp_path / "plan.yaml"
    target.write_text("keep: me\n")
    args = ["plan", "--model", "configs/tiny.yaml", "--chips", "cpu:8", "--global-batch", "8",
            "--seq", "128", "--top", "1", "--write", str(target)]
    assert main(args) == 2
    assert "exists; pass --force to replace it" in capsys.readouterr().err
    assert target.read_text() == "keep: me\n"
    assert main([*args, "--force"]) == 0
    assert "mesh:" in target.read_text()


def test_plan_prints_a_factory_models_traced_activations(tmp_path, capsys):
    # A user's LlamaLike: the activations #1 needs come from its traced step (nonzero),
    # the figure StepTracer gives for #1's rows a device; no step time is claimed.
    import re

    import jaxpar
    from jaxpar.planner.traced import StepTracer

    yaml = tmp_path / "llama.yaml"
    yaml.write_text("model:\n  factory: tests.user_models:llama_like\n  vocab_size: 64\n"
                    "  kwargs: {d: 32, heads: 4, kv_heads: 2, ff: 64, layers: 2}\n")
    assert main(["plan", "--model", str(yaml), "--chips", "cpu:8", "--global-batch", "8",
                 "--seq", "32", "--top", "1"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[3].split()  # the table's row #1
    sizes = dict(a.split("=") for a in first[1:] if "=" in a)
    row = re.search(r"^1 .*?(none|full|dots_with_no_batch_dims_saveable|"
                    r"save_attention_and_mlp_outputs)\s+(\d+)\s", out, re.M)
    remat, mb = row[1], int(row[2])
    rows = 8 // (int(sizes.get("data", 1)) * int(sizes.get("fsdp", 1)) * mb)
    got = re.search(r"activations of #1: ([\d.]+) MiB a device", out)
    assert got and float(got[1]) > 0
    want = StepTracer(jaxpar.load_config(str(yaml))).activations(remat, "bfloat16", rows, 32)
    assert float(got[1]) == pytest.approx(want.temp_bytes / 2**20, abs=0.05)
    assert "not a prediction of its step" in out


def test_verify_drops_what_the_compiler_refuses_and_ranks_tight_plans_last(monkeypatch):
    """``--verify 3`` on four plans: the compiler (stood in for: its answers given) fits
    the first at 99% of HBM (tight), the second at 60%, refuses the third; the fourth is
    not compiled. Kept: the second, then the tight first, then the unverified fourth."""
    import argparse
    from types import SimpleNamespace

    from jaxpar.analysis import inspection, targets
    from jaxpar.cli import plan as plan_cli

    hbm = 32 * GIB
    answers = iter([0.99 * hbm, 0.60 * hbm, None])

    def compile_step(config, target):
        total = next(answers)
        if total is None:
            raise inspection.StepDoesNotFit("no", temp_bytes=40 * GIB, hbm_bytes=hbm)
        return total

    def step_report(total):
        return {"memory": {"total_bytes": total, "hbm_bytes": hbm, "fits": total <= hbm,
                           "tight": inspection.is_tight(total, hbm)}}

    monkeypatch.setattr(inspection, "compile_step", compile_step)
    monkeypatch.setattr(inspection, "step_report", step_report)
    monkeypatch.setattr(targets, "tpu_target", lambda name, slices: name)
    monkeypatch.setattr(plan_cli, "run_config", lambda *a: None)
    machine = SimpleNamespace(chip=SimpleNamespace(name="tpu-v6e"), per_slice=4, slices=1)
    rows = [{"memory_per_device_bytes": 26 * GIB, "n": i} for i in range(4)]
    plans, kept = plan_cli.verified(list("abcd"), rows, None, machine, argparse.Namespace(
        verify=3, chips="tpu-v6e:4", global_batch=8, seq=128))
    assert plans == ["b", "a", "d"]
    assert [(r["n"], r.get("tight")) for r in kept] == [(1, False), (0, True), (3, None)]
