"""``jaxpar calibrate`` (jaxpar.cli.calibrate): its checks of ``--out`` and ``--name``, and
what it prints or writes, with the measurement itself replaced (it takes seconds and is
tested in tests/planner/test_calibrate.py)."""

import pytest
import yaml

import jaxpar.cli.calibrate as command
from jaxpar.cli import main

ENTRY = {"f32_flops": 1e10, "peak_flops": 2e10, "hbm_bw": 3e10, "domain": 8,
         "measurements": {"devices": 8, "matmuls": []}}


@pytest.fixture
def measured(monkeypatch):
    """Replaces the measurement: the calls it got, as (device count, quick)."""
    calls = []

    def calibrate(devices, *, quick):
        calls.append((len(devices), quick))
        return dict(ENTRY)

    monkeypatch.setattr(command, "calibrate", calibrate)
    monkeypatch.setattr(command, "summary", lambda entry: "SUMMARY")
    return calls


def test_without_out_the_entry_is_printed_as_yaml(measured, devices, capsys):
    assert main(["calibrate", "--quick"]) == 0
    out = capsys.readouterr().out
    first, summary, blank, *entry = out.splitlines()
    assert first == "jaxpar: calibrating 8 cpu devices (cpu) (quick)..."
    assert (summary, blank) == ("SUMMARY", "")
    # Named cpuN for N CPU devices, raw measurements left out of the catalog entry.
    assert yaml.safe_load("\n".join(entry)) == {
        "cpu8": {"f32_flops": 1e10, "peak_flops": 2e10, "hbm_bw": 3e10, "domain": 8}}
    assert measured == [(8, True)]


def test_with_out_the_entry_is_written_and_named(measured, devices, tmp_path, capsys):
    out = tmp_path / "chips.yaml"
    assert main(["calibrate", "--out", str(out), "--name", "cpu-box.1"]) == 0
    assert measured == [(8, False)]
    assert yaml.safe_load(out.read_text()) == {
        "cpu-box.1": {"f32_flops": 1e10, "peak_flops": 2e10, "hbm_bw": 3e10, "domain": 8}}
    raw = tmp_path / "chips.yaml.measurements.json"
    assert raw.is_file()
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"jaxpar: wrote {out} (entry 'cpu-box.1') and {raw}; use it with jaxpar plan "
        f"--catalog {out} --chips cpu-box.1:8 ...")


@pytest.mark.parametrize("argv, message", [
    (["--out", "{tmp}"], "--out {tmp} is a folder; give a file name"),
    (["--name", "cpu 8"], "--name 'cpu 8': use lower-case letters, digits"),
    (["--name", "Cpu8"], "--name 'Cpu8': use lower-case letters"),
    (["--name", "h100"], "--name 'h100': the planner prices chips named cpu* as XLA:CPU"),
])
def test_bad_out_or_name_is_refused_before_measuring(argv, message, measured, tmp_path,
                                                      capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["calibrate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar: error: " + message.replace("{tmp}", str(tmp_path)))
    assert err.count("\n") == 1 and measured == []
