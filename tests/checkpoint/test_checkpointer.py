"""Checkpoints: exact resume after SIGKILL (mid-run and mid-save) and after Ctrl-C (once or
twice during a save) or SIGTERM (preemption), restoring under other
plans (device count, mesh, ZeRO stage, pipeline layout), corrupt and mismatched
checkpoints, and init_from for a LoRA fine-tune."""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.checkpoint.checkpointer import (
    SAVE_DELAY_ENV,
    Checkpointer,
    CheckpointWarning,
    CorruptCheckpoint,
    flat_paths,
)
from jaxpar.config.assembly import build_trainer
from jaxpar.models import Transformer
from jaxpar.parallel.pipeline import Schedule
from jaxpar.runs.loop import train
from jaxpar.training.optimizer import make_optimizer
from jaxpar.training.trainer import Trainer
from tests.helpers import MESH_2X2X2, SMALL, loader, small_config

# The run the CLI tests use: the small model on a 2 x 2 x 2 mesh.
MODEL = [f"model.{k}={v}" for k, v in vars(SMALL).items()]
RUN = [*MODEL, *MESH_2X2X2, "train.seq_len=32", "train.global_batch=16", "train.steps=16",
       "train.warmup_steps=2", "data.max_bytes=200000", "checkpoint.every=4",
       "checkpoint.keep=3"]


def run_config(*extra: str) -> jaxpar.Config:
    return jaxpar.load_config("configs/tiny.yaml", [*RUN, *extra])


def losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicated steps in {path}: {steps}"
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of RUN: its folder and its losses by step."""
    out = tmp_path_factory.mktemp("reference")
    trainer, history = train(run_config(), out, progress=False)
    assert [m["step"] for m in history] == list(range(1, 17))
    return out, {m["step"]: m["loss"] for m in history}, trainer


# --- SIGKILL mid-save and mid-run, then exact resume (via the CLI) ------------------------
def _start(out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", "--config", "configs/tiny.yaml",
           "--devices", "8", "--out", str(out), *extra, *RUN]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _wait_until(proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    """Poll ``ready()`` while the run is alive (failing if it ends or times out first)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"run ended before the signal: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting to signal"
        time.sleep(0.01)


def _kill_when(proc: subprocess.Popen, ready) -> None:
    _wait_until(proc, ready)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_sigkill_mid_save_and_mid_run_then_exact_resume(tmp_path, reference, capsys):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    names = lambda: {p.name for p in ckpts.iterdir()} if ckpts.is_dir() else set()

    # 1. Every save sleeps 2 s before its last file: kill while step 8 is being saved.
    proc = _start(out, env={SAVE_DELAY_ENV: "2"})
    _kill_when(proc, lambda: "4" in names() and any(n.startswith("8.") for n in names()))
    assert "8" not in names(), "a save cut short by SIGKILL looks complete"
    with Checkpointer(ckpts) as ckpt:
        assert ckpt.steps() == [4]

    # 2. Resume from step 4, kill during training soon after the first new step (the
    #    resumed run rewrites metrics.jsonl without the steps after 4, then appends).
    metrics = out / "metrics.jsonl"
    inode = metrics.stat().st_ino
    proc = _start(out, "--resume")
    _kill_when(proc, lambda: metrics.exists() and metrics.stat().st_ino != inode
               and 5 in _steps(metrics))
    stdout = proc.stdout.read()
    assert f"resumed from {ckpts / '4'} (step 4 of 16)" in stdout
    with Checkpointer(ckpts) as ckpt:
        last = max(ckpt.steps())

    # 3. Resume again and finish (in this process: nothing here is about the process):
    #    no step repeated in metrics.jsonl, losses bitwise equal.
    stdout = _resume_and_check(out, capsys, reference)
    assert f"resumed from {ckpts / str(last)}" in stdout
    with Checkpointer(ckpts) as ckpt:
        assert ckpt.steps() == [8, 12, 16]  # keep=3

    # A fresh run into a folder with checkpoints refuses rather than overwrite them.
    with pytest.raises(jaxpar.JaxparError, match="already holds checkpoints.*--resume"):
        train(run_config(), out, progress=False)


def _steps(path: Path) -> set[int]:
    steps = set()
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError, KeyError):
            steps.add(json.loads(line)["step"])
    return steps


# --- Ctrl-C and SIGTERM: stop cleanly, lose nothing requested ---------------------------
_STOPPED = re.compile(r"stopped after step (\d+); the newest checkpoint is step (\d+)")


def _signal_when(proc: subprocess.Popen, ready, sig: int, *, then: str | None = None
                 ) -> tuple:
    """Send ``sig`` once ``ready()`` (and again once stdout shows ``then``); returns the
    run's (status, stdout, stderr)."""
    _wait_until(proc, ready)
    proc.send_signal(sig)
    seen = ""
    if then is not None:
        while then not in seen:
            line = proc.stdout.readline()
            assert line, f"run ended before {then!r}: {seen}"
            seen += line
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, seen + out, err


def _resume_and_check(out: Path, capsys, reference) -> str:
    """Finish the run with ``jaxpar train --resume`` in this process (the resume is not about
    a process; the interrupted runs were real ones): every step logged once and losses equal
    the uninterrupted run's. Returns what the run printed."""
    from jaxpar.cli import main

    capsys.readouterr()
    status = main(["train", "--config", "configs/tiny.yaml", "--out", str(out), "--resume",
                   *RUN])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    got = losses(out / "metrics.jsonl")
    assert sorted(got) == list(range(1, 17))
    assert got == reference[1], "losses after resume differ from the uninterrupted run"
    return captured.out


def test_ctrl_c_during_a_save_finishes_it(tmp_path, reference, capsys):
    """Ctrl-C twice (the second while the run waits) while checkpoint 4 is being written:
    the run says so after the first, finishes that checkpoint and exits 130 without a
    traceback; --resume loses no step that had a checkpoint requested. (A single press
    takes the same path up to the wait; the stop-on-signal mechanics of one press are
    tests/runs/test_interrupts.py's.)"""
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    in_flight = lambda: ckpts.is_dir() and any(".orbax-checkpoint-tmp" in p.name
                                               for p in ckpts.iterdir())
    proc = _start(out, env={SAVE_DELAY_ENV: "3"})
    status, stdout, stderr = _signal_when(
        proc, in_flight, signal.SIGINT, then="before exiting")
    assert status == 130, stderr
    assert "Traceback" not in stderr + stdout
    assert "Ctrl-C received: stopping after the current step" in stdout
    assert re.search(r"finishing checkpoint \d+ before exiting", stdout), stdout
    assert re.search(r"still finishing checkpoint \d+; .* waiting for it", stdout), stdout
    stopped, newest = map(int, _STOPPED.search(stderr.strip().splitlines()[-1]).groups())
    with Checkpointer(ckpts) as ckpt:
        assert ckpt.steps()[-1] == newest
    # The newest checkpoint is the last one the run asked for (every 4 steps).
    assert newest == stopped // 4 * 4 and newest >= 4
    assert not [p for p in ckpts.iterdir() if "tmp" in p.name], "a half checkpoint was left"
    _resume_and_check(out, capsys, reference)


def test_a_save_being_waited_for_stays_in_flight(tmp_path, monkeypatch):
    """The second Ctrl-C's handler asks what the run is finishing while the run waits for
    the save. Orbax can report no save in progress before its finalization ends. While
    ``wait`` blocks, the save it waits for is the one in flight (a CI run once printed
    "stopping after the current step" here instead of "still finishing checkpoint 4")."""
    with Checkpointer(tmp_path / "ckpts") as ckpt:
        asked = []
        monkeypatch.setattr(ckpt._manager, "is_saving_in_progress", lambda: False)
        monkeypatch.setattr(ckpt._manager, "wait_until_finished",
                            lambda: asked.append(ckpt.in_flight()))
        ckpt.wait(4)
        assert asked == [4] and ckpt.in_flight() is None


# --- restoring under other plans ----------------------------------------------------------
def build(axes: dict, zero: int = 0, devices=None, cfg=SMALL) -> Trainer:
    mesh = jaxpar.make_mesh(axes, devices=devices)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", zero_stage=zero)
    stages = mesh.shape["stage"]
    sched = Schedule.for_model(cfg.n_layers, stages) if stages > 1 else None
    model = jaxpar.init_sharded(
        lambda: Transformer(cfg, rngs=nnx.Rngs(0), pipeline=sched), plan)
    return Trainer(model, make_optimizer(small_config().train), plan)


@pytest.fixture(scope="module")
def fsdp8_checkpoint(tmp_path_factory):
    """Checkpoints at steps 1 and 2 of a ZeRO-1 FSDP run over 8 devices (saved by direct
    calls: ``every`` only governs ``due()``, a loop's ``when_due=True``)."""
    directory = tmp_path_factory.mktemp("fsdp8") / "checkpoints"
    trainer = build({"fsdp": 8}, zero=1)
    data = loader()
    with Checkpointer(directory, every=100) as ckpt:
        for step in range(2):
            trainer.step(data.batch(step))
            assert ckpt.save(trainer, when_due=True) is None  # step 1, 2: not due
            assert ckpt.save(trainer) is not None  # a direct call saves now
        assert ckpt.steps() == [1, 2]
    return directory, trainer, {k: np.asarray(v) for k, v in flat_paths(trainer.state).items()}


@pytest.mark.parametrize("axes, zero, n_devices", [
    ({"tensor": 4}, 0, 4),                            # 8 -> 4 devices, FSDP -> Megatron TP
    ({"data": 8}, 3, 8),                              # ZeRO 1 -> ZeRO 3
    ({"stage": 2, "fsdp": 2, "tensor": 2}, 1, 8),     # -> pipeline (repeat, stage) layout
])
def test_restore_under_another_plan(fsdp8_checkpoint, axes, zero, n_devices):
    directory, source, saved = fsdp8_checkpoint
    target = build(axes, zero, devices=jax.devices()[:n_devices])
    wanted = {k: v.sharding for k, v in flat_paths(target.state).items()}
    with Checkpointer(directory) as ckpt:
        meta = ckpt.restore(target)
    assert meta["step"] == 2 and meta["data"]["position"] == 2
    assert meta["mesh"]["fsdp"] == 8 and target.step_count == 2
    got = flat_paths(target.state)
    assert set(got) == set(saved)
    for key, value in got.items():
        assert value.sharding == wanted[key], key  # read straight into the new layout
        assert np.array_equal(np.asarray(value).reshape(saved[key].shape), saved[key]), key
    if axes == {"tensor": 4}:  # and it trains on: the next step matches the source's
        batch = loader().batch(2)
        np.testing.assert_allclose(target.step(batch)["loss"], source.step(batch)["loss"],
                                   rtol=1e-5)


def test_corrupt_checkpoint_falls_back_and_shape_mismatch_is_listed(fsdp8_checkpoint,
                                                                   tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(fsdp8_checkpoint[0], directory)
    data_files = [p for p in (directory / "2" / "state").rglob("*") if p.is_file()
                  and p.parent.name == "d"]
    biggest = max(data_files, key=lambda p: p.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size // 2)

    trainer = build({"fsdp": 8}, zero=1)
    ckpt = Checkpointer(directory)
    with pytest.raises(CorruptCheckpoint, match=f"checkpoint {directory / '2'} is corrupt"):
        ckpt.restore(trainer, step=2)
    with pytest.warns(CheckpointWarning, match="is corrupt or truncated"):
        meta = ckpt.restore(trainer)
    assert meta["step"] == 1 and trainer.step_count == 1
    assert (directory / "corrupt-2" / "state").is_dir()  # kept aside, not deleted
    assert ckpt.steps() == [1]
    ckpt.close()

    wider = build({"fsdp": 8}, cfg=dataclasses.replace(SMALL, d_ff=192))
    with (pytest.raises(jaxpar.JaxparError, match="does not match the config") as err,
          Checkpointer(fsdp8_checkpoint[0]) as ckpt):
        ckpt.restore(wider)
    msg = str(err.value)
    assert "params/blocks/mlp/w_up/kernel: checkpoint (2, 64, 128), expected (2, 64, 192)" in msg
    assert "opt_state/1/0/mu/blocks/mlp/w_down/kernel" in msg


def test_cli_reports_a_corrupt_checkpoint_in_one_line(reference, tmp_path, capsys):
    """`jaxpar train --resume` over a truncated newest checkpoint: one warning line naming it
    (not jaxpar's source line), then the run resumes from the one before."""
    from jaxpar.cli import main

    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    state = out / "checkpoints" / "16" / "state"
    biggest = max((p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"),
                  key=lambda p: p.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size // 2)
    status = main(["train", "--config", "configs/tiny.yaml", "--out", str(out), "--resume",
                   *RUN])
    err = capsys.readouterr().err
    assert status == 0, err
    warned = [line for line in err.splitlines() if "corrupt or truncated" in line]
    assert len(warned) == 1 and warned[0].startswith(
        f"jaxpar: warning: checkpoint {out / 'checkpoints' / '16'} is corrupt or truncated")
    assert "warnings.warn" not in err and "Traceback" not in err
    assert losses(out / "metrics.jsonl") == reference[1]  # steps 13-16 trained again, equal


# --- init_from: a LoRA fine-tune of a trained run -----------------------------------------
def test_init_from_finetunes_lora_only(reference, tmp_path):
    base_dir, _, base_trainer = reference
    cfg = jaxpar.load_config("configs/tiny-lora.yaml", [
        *RUN, "train.steps=3", f"init_from={base_dir / 'checkpoints'}"])
    trainer, history = train(cfg, tmp_path / "lora", progress=False)
    assert [m["step"] for m in history] == [1, 2, 3]  # step 0, fresh optimizer
    # tiny-lora.yaml evaluates the held-out tail of the corpus (here at the last step).
    assert "eval_loss" not in history[0] and 0 < history[-1]["eval_loss"] < 10
    base = {k: np.asarray(v) for k, v in flat_paths(base_trainer.state["params"]).items()}
    frozen = {k.replace("/base/", "/"): np.asarray(v)
              for k, v in flat_paths(trainer.state["frozen"]).items()}
    assert set(base) == set(frozen)
    for key in base:  # the trained weights, loaded and left untouched by the fine-tune
        assert np.array_equal(frozen[key], base[key]), key
    adapters = flat_paths(trainer.state["params"])
    assert adapters and all("lora_" in k for k in adapters)
    assert any(np.abs(np.asarray(v)).max() > 0 for k, v in adapters.items()
               if k.endswith("lora_b"))  # B starts at zero and trained

    bad = jaxpar.load_config("configs/tiny-lora.yaml", [
        *RUN, "model.d_model=32", f"init_from={base_dir / 'checkpoints'}"])
    with pytest.raises(jaxpar.JaxparError, match="init_from checkpoint .* does not match "
                       "the config: shape mismatch at .*embed: checkpoint"):
        build_trainer(bad)
