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
                               (["train", "--help"], 0, "--max-steps N"),
                               (["train", "--config", "missing.yaml"], 2,
                                "jaxpar: error: config file 'missing.yaml' does not exist"),
                               (["train", "--max-steps", "0"], 2, "0: give at least 1")]:
        got, out = _probe(*argv)
        assert got == {"status": status, "loaded": []}, (argv, got)
        assert said in out, out


def test_resume_on_a_finished_run_builds_nothing(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "12").mkdir(parents=True)
    (run / "config.yaml").write_text("train:\n  steps: 12\n")
    got, out = _probe("train", "--out", str(run), "--resume")
    assert got["status"] == 0 and "jaxpar.runs.loop" not in got["loaded"], got
    assert "done: already at step 12 of train.steps=12; nothing to train" in out
