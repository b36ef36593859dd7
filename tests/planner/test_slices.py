"""The cross-slice report: synchronous training's DCN traffic against DiLoCo's meetings,
by the formulas of :mod:`jaxpar.planner.slices`, and the recommendation it makes."""

import dataclasses
import subprocess
import sys

import pytest

from jaxpar.models import TransformerConfig
from jaxpar.planner import BUILTIN, Candidate, estimate
from jaxpar.planner.catalog import Machine
from jaxpar.planner.slices import options, recommend, report

MODEL = TransformerConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16,
                          n_kv_heads=8, d_ff=7168, max_seq_len=2048)
ICI = {"data": 1, "fsdp": 16, "tensor": 4}


def _estimate(machine: Machine, slices: int):
    cand = Candidate.make(ICI, {"data": slices} if slices > 1 else None, zero_stage=0,
                          remat="full")
    return estimate(MODEL, cand, chips=machine, global_batch=64 * slices, seq=2048)


def test_one_slice_sends_nothing_across():
    machine = Machine(BUILTIN["tpu-v5e"], 64, 1)
    (sync,) = options(_estimate(machine, 1), machine, MODEL.param_count())
    assert sync.dcn_bytes == sync.dcn_s == sync.exposed_s == 0
    assert recommend([sync])[0] is sync


def test_sync_reduces_gradients_across_and_diloco_meets_every_h_steps():
    """Four slices: synchronous training all-reduces each step's gradients (bf16, split
    over the 64 devices of a slice) over the DCN; DiLoCo sends a meeting's float32
    outer gradient (2 (s-1)/s of it on the wire) once every H steps and holds 8 bytes
    a local parameter more."""
    machine = Machine(BUILTIN["tpu-v5e"], 256, 4)
    est = _estimate(machine, 4)
    opts = options(est, machine, MODEL.param_count())
    sync, diloco = opts[0], {o.sync_every: o for o in opts[1:]}
    local = MODEL.param_count() / 64
    wire = 2 * 3 / 4 * 4 * local
    assert sync.dcn_bytes == pytest.approx(wire / 2, rel=0.05)  # bf16 gradients a step
    assert sync.exposed_s > 0
    for h, o in diloco.items():
        assert o.dcn_bytes == pytest.approx(wire / h, rel=1e-6)
        assert o.extra_bytes == pytest.approx(8 * local)
        assert o.step_time_s == pytest.approx(est.step_time_s - sync.exposed_s
                                              + o.dcn_s, rel=1e-6)
    assert diloco[10].dcn_s == pytest.approx(10 * diloco[100].dcn_s)


def test_slow_networks_get_diloco_fast_ones_stay_synchronous():
    """A v5e's 50 Gbps a chip across slices: the synchronous step of this 1B model at 64
    sequences a slice waits 15% of its time for the DCN, DiLoCo H=10 2.7%; on a network
    20x faster synchronous training stays."""
    chip = BUILTIN["tpu-v5e"]
    slow = Machine(chip, 256, 4)
    fast = Machine(dataclasses.replace(chip, dcn_bw=chip.dcn_bw * 20), 256, 4)
    n = MODEL.param_count()
    best, why = recommend(options(_estimate(fast, 4), fast, n))
    assert best.method == "synchronous" and why.startswith("synchronous: its step waits")
    best, why = recommend(options(_estimate(slow, 4), slow, n))
    assert best.method == "diloco" and best.dcn_share <= 0.05
    assert why.startswith(f"DiLoCo H={best.sync_every}: synchronous waits")
    text = report(_estimate(slow, 4), slow, n)
    assert "across 4 slices (data over DCN)" in text and "recommended: DiLoCo" in text
    # A plan that spans the slices with another axis than data: the header says which.
    over_fsdp = dataclasses.replace(_estimate(slow, 4), candidate=dataclasses.replace(
        _estimate(slow, 4).candidate, dcn=(("fsdp", 4),)))
    assert "across 4 slices (fsdp over DCN)" in report(over_fsdp, slow, n)


def test_jaxpar_plan_reports_across_slices():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli", "plan", "--model", "configs/tiny.yaml",
         "--chips", "tpu-v5e:16", "--slices", "2", "--global-batch", "32", "--seq", "128",
         "--top", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "across 2 slices (data over DCN), per device and step:" in proc.stdout
    assert "DiLoCo H=10" in proc.stdout and "recommended:" in proc.stdout


def test_hpz_row_gathers_across_slices_once_a_step():
    """ZeRO-3 over four slices gathers every layer's weights across the DCN forward and
    backward; hpZ gathers them once a step and reduces the gradients inside the slice
    first: fewer DCN bytes, for the in-slice copy's memory."""
    machine = Machine(BUILTIN["tpu-v5e"], 256, 4)

    def zero3(hpz: bool):
        cand = Candidate.make(ICI, {"data": 4}, zero_stage=3, remat="full", hpz=hpz)
        return estimate(MODEL, cand, chips=machine, global_batch=256, seq=2048)

    plain, hpz = zero3(False), zero3(True)
    opts = options(plain, machine, MODEL.param_count(), hpz=hpz)
    sync, with_hpz = opts[0], opts[1]
    assert with_hpz.method == "hpz"
    assert with_hpz.dcn_bytes < 0.8 * sync.dcn_bytes and with_hpz.dcn_s < sync.dcn_s
    assert with_hpz.extra_bytes > 0
    assert "sync + hpZ" in report(plain, machine, MODEL.param_count(), hpz=hpz)
