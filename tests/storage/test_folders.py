"""Output folders under faults, with real processes: an export killed midway leaves the
earlier export loadable by ``transformers``; a second ``jaxpar train`` on a busy run folder
is refused in one line and the first run finishes untouched; stale locks are taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxpar.errors import JaxparError
from jaxpar.storage.folders import LOCK_NAME, FolderLock, staged_folder
from jaxpar.storage.safetensors_io import EXPORT_DELAY_ENV

ROOT = Path(__file__).resolve().parents[2]


def export(target: Path | str, seed: int) -> None:
    """A small model's weights exported to ``target`` by :func:`jaxpar.hf.save`."""
    from flax import nnx

    from jaxpar import hf
    from jaxpar.models import Transformer, TransformerConfig

    cfg = TransformerConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=64, max_seq_len=64)
    hf.save(Transformer(cfg, rngs=nnx.Rngs(seed)), target)


EXPORT = """
import sys
from tests.storage.test_folders import export
export(sys.argv[1], int(sys.argv[2]))
"""
"""The export that is killed midway runs in a process of its own (:func:`export`)."""


def _export(target: Path, seed: int, delay: float) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               **{EXPORT_DELAY_ENV: str(delay)})
    return subprocess.Popen([sys.executable, "-c", EXPORT, str(target), str(seed)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _hf_logits(folder: Path) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 7, 9, 2]])).logits.numpy()


def test_an_export_killed_midway_leaves_the_earlier_one(tmp_path):
    """The first and third exports run in this process; the second, killed, in its own."""
    target = tmp_path / "export"
    export(target, seed=0)
    (target / "README.md").write_text("my notes")  # a file of the user's own
    before = _hf_logits(target)

    second = _export(target, seed=1, delay=60)
    staging = lambda: list(tmp_path.glob(".export.jaxpar-staging-*/model.safetensors"))
    deadline = time.time() + 300
    while not staging() and second.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert staging(), "the second export never wrote its shard"
    second.send_signal(signal.SIGKILL)
    second.wait()
    np.testing.assert_array_equal(_hf_logits(target), before)  # the earlier export, whole

    export(target, seed=1)
    after = _hf_logits(target)
    assert not np.allclose(after, before)  # the new weights, loadable
    assert (target / "README.md").read_text() == "my notes"
    assert not list(tmp_path.glob(".export.jaxpar-*"))  # the killed one's leftovers are gone


def _train(out: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "jaxpar.cli", "train", "--config", "configs/tiny.yaml",
         "--devices", "8", "--out", str(out), "model.d_model=32", "model.n_layers=1",
         "model.d_ff=64", "train.seq_len=16", "train.global_batch=8", "train.steps=12",
         "train.eval_every=0", "checkpoint.every=6", "data.max_bytes=200000", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_writer_is_refused_and_the_first_run_is_untouched(tmp_path):
    """The first run is held (SIGSTOP) while the second tries the folder, so it is still
    running then however fast its small model trains; it goes on after (SIGCONT)."""
    out = tmp_path / "run"
    first = _train(out)
    deadline = time.time() + 300
    while not (out / LOCK_NAME).exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert (out / LOCK_NAME).exists(), first.stderr.read()
    first.send_signal(signal.SIGSTOP)
    try:
        second = _train(out, "--resume")
        _, err = second.communicate(timeout=300)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2, err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and "is in use by jaxpar train" in lines[0], err
    assert f"pid {first.pid}" in lines[0]
    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert not (out / LOCK_NAME).exists()  # released at the end


def test_a_stale_lock_is_taken_over_and_a_live_one_is_not(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                "command": "jaxpar train", "started": "yesterday"}))
    said = []
    with FolderLock(lock, "jaxpar train", say=said.append):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert "taking over the lock of jaxpar train" in said[0] and str(dead.pid) in said[0]
        with pytest.raises(JaxparError, match=rf"in use by jaxpar train \(pid {os.getpid()}"):
            FolderLock(lock, "jaxpar export").acquire()
    assert not lock.exists()


def test_a_failed_staged_write_leaves_the_folder_as_it_was(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("old")
    (target / "model.safetensors").write_text("old weights")
    with pytest.raises(RuntimeError), staged_folder(target) as staging:
        (staging / "config.json").write_text("new")
        raise RuntimeError("disk full")
    assert (target / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with staged_folder(target) as staging:  # a sharded write replaces the single file
        (staging / "model-00001-of-00002.safetensors").write_text("a")
        (staging / "config.json").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["config.json",
                                                         "model-00001-of-00002.safetensors"]


def test_an_output_file_is_new_or_forced_and_written_whole(tmp_path):
    """check_new_output / write_file: an existing file needs force, a device file
    (/dev/null) is neither refused nor replaced by a rename, a write leaves no temp file."""
    from jaxpar.storage.folders import check_new_output, write_file

    target = tmp_path / "step.hlo"
    check_new_output(target, "--dump-hlo", force=False)
    write_file(target, "one")
    with pytest.raises(JaxparError, match="exists; pass --force"):
        check_new_output(target, "--dump-hlo", force=False)
    check_new_output(target, "--dump-hlo", force=True)
    write_file(target, b"two")
    assert target.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["step.hlo"]
    check_new_output("/dev/null", "--dump-hlo", force=False)
    write_file("/dev/null", "gone")
    assert Path("/dev/null").exists() and not Path("/dev/null").is_file()
