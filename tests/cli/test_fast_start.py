"""The command starts fast: ``--help`` and argument errors never import JAX, and
``--resume`` on a finished run answers without devices, a model or a compile (timings are
in ``benchmarks/cli_start.py``; this checks what each path loads)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
from jaxpar.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit:
    status = exit.code
print(json.dumps({"status": status, "loaded": [m for m in ("jax", "flax", "orbax.checkpoint",
    "jaxpar.runs.loop", "jaxpar.training.trainer") if m in sys.modules]}))
"""


def _probe(*argv: str, cwd: Path = ROOT) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout + done.stderr


def test_help_and_a_missing_config_import_no_jax(tmp_path):
    for argv, status, said in [(["--help"], 0, "usage: jaxpar"),
                               (["train", "--max-steps", "0"], 2, "0: give at least 1"),
                               (["train", "--config", "missing.yaml"], 2,
                                "jaxpar: error: config file 'missing.yaml' does not exist"),
                               (["plan", "--help"], 0, "--global-batch")]:
        got, out = _probe(*argv)
        assert got == {"status": status, "loaded": []}, (argv, got)
        assert said in out, out


def test_resume_on_a_finished_run_builds_nothing(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "12").mkdir(parents=True)
    (run / "config.yaml").write_text("train:\n  steps: 12\n")
    (run / "finished.json").write_text('{"step": 12, "bytes": 0}')  # what a finished run writes
    got, out = _probe("train", "--out", str(run), "--resume")
    assert got["status"] == 0 and "jaxpar.runs.loop" not in got["loaded"], got
    assert "done: already at step 12 of train.steps=12; nothing to train" in out


def test_train_help_lists_every_config_key():
    """``jaxpar train --help`` ends with every section's keys and defaults (read from the
    schema, so they cannot drift)."""
    import dataclasses

    from jaxpar.config.schema import Config

    got, out = _probe("train", "--help")
    assert got["status"] == 0 and "--max-steps N" in out
    listed = out[out.index("config keys"):]
    for section in dataclasses.fields(Config):
        value = getattr(Config(), section.name)
        names = ([f.name for f in dataclasses.fields(value)]
                 if dataclasses.is_dataclass(value) else [section.name])
        for name in names:
            assert f"{name}=" in listed, (section.name, name)

