"""``jaxpar train`` (jaxpar.cli.train) as a user runs it: a fresh process, simulated devices,
files on disk; and which config a run is checked and started with. Where a test is not
about the process (a text corpus, DiLoCo's meetings and resume), its commands run in this
one (``jaxpar.cli.main``): a subprocess each cost a JAX start and a compile cache read."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

import jaxpar
from jaxpar.cli import main
from jaxpar.cli.train import checked_train_config

SMALL_RUN = ["model.d_model=32", "model.n_layers=1", "model.d_ff=64", "train.seq_len=16",
             "train.global_batch=8", "train.steps=3", "data.max_bytes=200000"]


def jaxpar_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_train_writes_metrics_and_config(tmp_path):
    out = tmp_path / "run"
    proc = jaxpar_cli("train", "--config", "configs/tiny.yaml", "--devices", "8", "--out",
                      str(out), *SMALL_RUN)
    assert proc.returncode == 0, proc.stderr
    assert "mesh fsdp=8 (8 devices)" in proc.stdout  # tiny.yaml's fsdp: -1 fills the mesh
    assert "tokens/s" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"step", "loss", "step_time_s", "tokens_per_s", "data_wait_s"} <= set(r)
        assert r["data_wait_s"] >= 0
        assert r["tokens_per_s"] > 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["d_model"] == 32 and saved["train"]["steps"] == 3


def test_train_on_a_user_text_file(devices, tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    code = main(["train", "--devices", "8", f"data.source={text}", "mesh.data=8", *SMALL_RUN])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "final loss" in out


def _train_args(**given) -> argparse.Namespace:
    args = dict(config=None, out=None, resume=False, keep_mesh=False, overrides=[])
    return argparse.Namespace(**{**args, **given})


def test_a_resumed_run_without_config_continues_under_its_saved_config(tmp_path):
    jaxpar.load_config(None, ["model.d_model=48", "train.steps=5"]).save(
        tmp_path / "config.yaml")
    resumed = checked_train_config(_train_args(out=str(tmp_path), resume=True,
                                               overrides=["train.steps=9"]))
    assert resumed.model.d_model == 48 and resumed.train.steps == 9
    # Not resuming, the folder's config.yaml is not read: the defaults.
    fresh = checked_train_config(_train_args(out=str(tmp_path)))
    assert fresh.model.d_model != 48
    # An explicit --config wins over the saved one.
    tiny = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    given = checked_train_config(_train_args(config="configs/tiny.yaml", out=str(tmp_path),
                                             resume=True))
    assert given.model.d_model == tiny["model"]["d_model"] != 48


def test_train_with_diloco_meets_and_resumes(devices, tmp_path, capsys):
    """``diloco.sync_every=2`` on data 2 x fsdp 4, with outer gradients a meeting late:
    the run says what it runs, trains 4 steps with a checkpoint at step 2, and a longer
    rerun resumes from the last one. (Overlapped meetings from the command line:
    docs/guides/slices.md; a checkpoint with a meeting in flight restored exactly:
    tests/training/test_diloco.py.)"""
    knobs = ["diloco.staleness=1"]
    said = "staleness 1), outer SGD lr 0.7 momentum 0.9 nesterov\n"
    out = tmp_path / "run"
    run = ["train", "--config", "configs/tiny.yaml", "--devices", "8", "--out", str(out),
           *SMALL_RUN, "mesh.data=2", "mesh.fsdp=4", "diloco.sync_every=2", *knobs,
           "checkpoint.every=2"]
    code = main([*run, "train.steps=4"])
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert ("diloco: 2 replicas over data, each fragment meets every 2 steps (1 fragment, "
            + said) in printed
    code = main([*run, "train.steps=6", "--resume"])
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert "resumed from" in printed + err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
