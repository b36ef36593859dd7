"""A full disk mid-run, on a real small file system (a tmpfs; skipped where this machine
cannot mount one): the run ends in one line naming the folder and the free space, and the
checkpoints saved before stay whole and resumable."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import pytest

from jaxpar.checkpoint.checkpointer import Checkpointer, CheckpointSaveFailed, read_only
from tests.checkpoint.test_checkpointer import build

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.d_model=32", "model.n_layers=1", "model.d_ff=64", "train.seq_len=16",
        "train.global_batch=8", "data.max_bytes=100000", "checkpoint.every=1",
        "checkpoint.keep=10"]


@contextlib.contextmanager
def small_disk(parent: Path, size: str):
    """A tmpfs of ``size`` mounted under ``parent`` (skips the test where mounting fails)."""
    point = parent / f"disk-{uuid.uuid4().hex[:6]}"
    point.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                           capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a small file system here: {mount.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jaxpar.cli", "train", "--config", "configs/tiny.yaml",
           "--devices", "8", "--out", str(out), *TINY, *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _messages(stderr: str) -> list[str]:
    """stderr without the progress bar's redraws."""
    return [line.split("\r")[-1] for line in stderr.splitlines()
            if line.split("\r")[-1].strip() and not line.split("\r")[-1].startswith("train:")]


def test_a_full_disk_ends_the_run_in_one_line_and_keeps_earlier_checkpoints(tmp_path):
    with small_disk(tmp_path, "2m") as disk:
        run = _train(disk / "run", "train.steps=10")
        lines = _messages(run.stderr)
        assert run.returncode == 2, run.stderr[-3000:]
        assert "Traceback" not in run.stderr, run.stderr[-3000:]
        assert len(lines) == 1, lines
        # How many checkpoints fit depends on how compactly orbax wrote them: at least one.
        found = re.match(rf"jaxpar: error: saving checkpoint (\d+) into {disk}/run/"
                         r"checkpoints failed: .* free there\)?; checkpoints \[([\d, ]+)\] are "
                         r"intact", lines[0])
        assert found, lines[0]
        failed, kept = int(found.group(1)), [int(x) for x in found.group(2).split(", ")]
        assert failed <= 10 and kept == list(range(1, failed))
        # What was saved before is whole: the newest one reads back.
        reader = read_only(disk / "run")
        try:
            assert reader.steps() == kept
            assert reader.meta(kept[-1])["step"] == kept[-1]
        finally:
            reader.close()


def test_a_save_refused_in_the_background_is_one_error(tmp_path, monkeypatch, capfd):
    """The space check passes (faked), the write itself hits the full disk: the error still
    comes as one CheckpointSaveFailed, and orbax's logs of it are not shown."""
    monkeypatch.setattr("jaxpar.checkpoint.checkpointer.free_bytes", lambda path: 1 << 40)
    trainer = build({"data": 1}, devices=jax.devices()[:1])
    with small_disk(tmp_path, "64k") as disk:
        ckpt = Checkpointer(disk / "checkpoints", every=1)
        capfd.readouterr()
        with pytest.raises(CheckpointSaveFailed, match=r"saving checkpoint 0 into .* failed: "
                           r"no space left on device \(.* free there\); no checkpoint was "
                           r"saved before it"):
            ckpt.save(trainer, force=True)
            ckpt.wait()
        ckpt.close()
        err = capfd.readouterr().err
        assert "Traceback" not in err and "ERROR:absl" not in err, err[-3000:]


def _await_in_a_loop_that_closes() -> None:
    """A TensorStore write finishing after the event loop awaiting it closed (what orbax's
    sibling writes do when one write of a save fails)."""
    import asyncio
    import time

    import tensorstore as ts

    promise, future = ts.Promise.new()
    loop = asyncio.new_event_loop()

    async def wait():
        return await future

    task = loop.create_task(wait())
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()
    promise.set_result(0)
    time.sleep(0.1)
    del task


def test_writes_finishing_after_a_failed_save_print_nothing(tmp_path, monkeypatch):
    """Python reports such late wake-ups as unraisable errors (a traceback on stderr); a
    Checkpointer drops exactly those and passes other unraisable errors on."""
    import gc
    import sys

    seen: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(repr(u.exc_value)))
    Checkpointer(tmp_path / "checkpoints", every=1).close()
    _await_in_a_loop_that_closes()

    class Loud:
        def __del__(self):
            raise ValueError("not ours")

    Loud()
    gc.collect()
    assert seen == ["ValueError('not ours')"]
