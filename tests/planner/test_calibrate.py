"""``jaxpar calibrate``: a quick calibration of the 8 simulated CPU devices writes a
catalog entry that ``load_catalog`` reads and ``jaxpar plan --catalog`` uses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.planner.calibrate import (
    _steps_and_wire,
    fit_collectives,
    write_entry,
)
from jaxpar.planner.catalog import load_catalog, parse_chips
from tests.conftest import UNOPTIMISED

ROOT = Path(__file__).resolve().parents[2]


CALIBRATE = """
import json, jax
jax.config.update("jax_num_cpu_devices", 8)
from jaxpar.planner.calibrate import calibrate
print(json.dumps(calibrate(jax.devices(), quick=True)))
"""


@pytest.fixture(scope="module")
def entry():
    """A quick calibration measured in a process of its own: the tests' XLA flags turn code
    optimisation off (tests/conftest.py), which would measure code no run executes."""
    flags = os.environ.get("XLA_FLAGS", "").replace(UNOPTIMISED, "").strip()
    proc = subprocess.run([sys.executable, "-c", CALIBRATE], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "XLA_FLAGS": flags,
                                                      "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_quick_calibration_is_plausible(entry):
    assert 1e8 < entry["f32_flops"] < 1e13
    assert 1e8 < entry["peak_flops"] < 1e13
    assert 1e8 < entry["hbm_bw"] < 1e13
    assert 1e6 < entry["ici_bw"] < 1e13
    assert 0 < entry["ici_latency_s"] < 0.1
    assert entry["domain"] == 8 and entry["overlap"] == 0 and entry["torus_dims"] == 0
    assert entry["matmul_tile"] >= 1 and 0 <= entry["op_overhead_s"] < 0.1
    # XLA:CPU stores and reloads a scan's saved activations far below its streaming rate.
    # 0: saving measured no dearer than recomputing (measure_saved says so under noise)
    assert 0 <= entry["saved_bw"] < entry["hbm_bw"]
    m = entry["measurements"]
    # The bytes it saves are what JAX keeps: two arrays a layer beside the carry both
    # variants keep (read from jax.vjp's residuals, not assumed).
    saved = m["saved_activations"]
    assert saved["saved_bytes"] == 2 * 4 * saved["elements"] * saved["layers"]
    assert m["devices"] == 8 and m["matmuls"] and m["collectives"]
    assert {r["kind"] for r in m["collectives"]} == {
        "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"}
    assert {r["axis_size"] for r in m["collectives"]} == {2, 4, 8}


def test_written_entry_loads_and_plans(entry, tmp_path, capsys):
    out = tmp_path / "chip.yaml"
    raw = write_entry(entry, "cpu8", out)
    chip = load_catalog(out)["cpu8"]
    assert chip.f32_flops == pytest.approx(entry["f32_flops"])
    assert json.loads(raw.read_text())["devices"] == 8
    machine = parse_chips("cpu8:8", catalog=out)
    assert machine.chip.hbm_bw == pytest.approx(entry["hbm_bw"])
    code = main(["plan", "--model", "configs/tiny.yaml", "--chips", "cpu8:8", "--catalog",
                 str(out), "--global-batch", "16", "--seq", "128", "--top", "2"])
    assert code == 0
    assert "8 x cpu8" in capsys.readouterr().out


def test_collective_fit_recovers_latency_and_bandwidth():
    lat, bw = 3e-5, 2e9
    rows = []
    for kind in ("all-gather", "all-reduce", "collective-permute"):
        for n in (2, 4, 8):
            for size in (1e4, 1e6, 1e7):
                steps, wire = _steps_and_wire(kind, n, size)
                rows.append({"kind": kind, "axis_size": n, "payload_bytes": size,
                             "seconds": steps * lat + wire / bw})
    got_lat, got_bw = fit_collectives(rows)
    assert got_lat == pytest.approx(lat, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)


@pytest.mark.parametrize("argv, text", [
    (["calibrate", "--out", "/no/such/folder/chip.yaml"], "does not exist"),
    (["calibrate", "--name", "Bad Name!"], "--name"),
])
def test_bad_input_is_one_line(argv, text, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1


def test_zero_devices_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--devices", "0"])
    assert exc.value.code == 2
