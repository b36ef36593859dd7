"""Multi-process runs: ``jaxpar launch`` of 2 and then 3 processes (gloo) resuming one run
against one process with 8 devices, and the launcher's handling of failures and bad
arguments: the command lines and environments it gives its processes (jaxpar.cli.launch).
How processes are run and stopped (run_all) is tested in tests/runs/test_distributed.py."""

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxpar
import jaxpar.cli.launch as launch
from jaxpar.checkpoint.checkpointer import Checkpointer, flat_paths
from jaxpar.cli.launch import command
from jaxpar.config.assembly import build_trainer
from jaxpar.runs.distributed import initialize, run_all
from jaxpar.runs.loop import train
from tests.helpers import without_cache


def _launch_args(*cmd: str) -> argparse.Namespace:
    return argparse.Namespace(processes=2, devices_per_process=4, port=0, replicas=None, restart=0,
                              command_args=list(cmd))


def test_launch_and_initialize_errors(monkeypatch):
    for name in ("JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID",
                 "JAXPAR_DISTRIBUTED", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(jaxpar.JaxparError, match="needs a command after --"):
        command(_launch_args("--"))
    with pytest.raises(jaxpar.JaxparError, match="runs 'train'"):
        command(_launch_args("--", "inspect"))
    with pytest.raises(jaxpar.JaxparError, match="missing --coordinator, --process-id"):
        initialize(num_processes=2)
    monkeypatch.setenv("JAXPAR_NUM_PROCESSES", "two")
    with pytest.raises(jaxpar.JaxparError, match="JAXPAR_NUM_PROCESSES='two'"):
        initialize()
    monkeypatch.delenv("JAXPAR_NUM_PROCESSES")
    with pytest.raises(jaxpar.JaxparError, match="--process-id 2 is not in"):
        initialize("127.0.0.1:1234", 2, 2)
    assert initialize() is False  # a plain single-process run


INJECT = """
import sys
import jaxpar.runs.loop
from jaxpar.errors import JaxparError
def train(*args, **kwargs):
    raise JaxparError("data.source 'shard-1.txt': a bad input only process 1 sees")
jaxpar.runs.loop.train = train
from jaxpar.cli.child import child_main
child_main(sys.argv[1:])
"""
"""Process 1's command: ``jaxpar train`` whose training fails at once, after the
processes have joined (process 0 goes on, into a collective that process 1 never joins)."""


def test_launch_names_the_process_that_failed_first(monkeypatch, capsys):
    made = launch.child_processes

    def child_processes(cmd, processes, port):
        commands, envs = made(cmd, processes, port)
        assert commands[1][1:3] == ["-m", "jaxpar.cli.child"]
        commands[1] = [sys.executable, "-c", INJECT, *commands[1][3:]]
        return commands, [without_cache(env) for env in envs]

    monkeypatch.setattr(launch, "child_processes", child_processes)
    monkeypatch.setattr(launch, "run_all", functools.partial(run_all, grace_s=1))
    args = argparse.Namespace(processes=2, devices_per_process=1, port=0, replicas=None,
                              restart=0, command_args=[
        "--", "train", "--config", "configs/tiny.yaml", "model.d_model=32",
        "model.n_layers=1", "model.d_ff=64", "train.seq_len=16", "train.global_batch=8",
        "train.steps=2", "data.max_bytes=100000"])
    start = time.monotonic()
    code = command(args)
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 2, out[-3000:] + err
    assert "[1] jaxpar: error: data.source 'shard-1.txt'" in out
    assert err == ("jaxpar launch: process 1 failed first (exit status 2): jaxpar: error: "
                   "data.source 'shard-1.txt': a bad input only process 1 sees; stopped "
                   "the others\n"), err
    # Process 1 exits at once (not at the end of process 0's 30 s collective timeout).
    assert took < 25, took


CHILD = ["train", "--config", "configs/tiny.yaml", "model.d_model=32", "model.n_layers=1",
         "model.d_ff=64", "train.seq_len=16", "train.global_batch=8", "train.steps=2"]


def test_child_processes_share_a_coordinator_and_number_themselves():
    commands, envs = launch.child_processes(["train", "x=1"], 3, 4321)
    assert commands == [[sys.executable, "-m", "jaxpar.cli.child", "train", "x=1"]] * 3
    for i, env in enumerate(envs):
        assert env["JAXPAR_COORDINATOR"] == "127.0.0.1:4321"
        assert env["JAXPAR_NUM_PROCESSES"] == "3" and env["JAXPAR_PROCESS_ID"] == str(i)
        assert env["JAX_PLATFORMS"] == "cpu" and env["PYTHONUNBUFFERED"] == "1"
        assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is kept


def test_the_command_starts_the_checked_child_with_its_devices(monkeypatch):
    """run_all is replaced: the processes launch would start, and its exit status."""
    started = []

    def fake_run_all(commands, envs):
        started.append((commands, envs))
        return 5

    monkeypatch.setattr(launch, "run_all", fake_run_all)
    monkeypatch.setattr(launch, "free_port", lambda: 4321)
    args = argparse.Namespace(processes=2, devices_per_process=4, port=0, replicas=None, restart=0,
                              command_args=["--", *CHILD])
    assert command(args) == 5
    (commands, envs), = started
    # --devices is added from --devices-per-process; "--" is dropped.
    child = ["train", "--devices", "4", *CHILD[1:]]
    assert [c[3:] for c in commands] == [child, child]
    assert [e["JAXPAR_COORDINATOR"] for e in envs] == ["127.0.0.1:4321"] * 2
    # The same device count given after -- is no conflict, and is not given twice; a port
    # given is used.
    args.command_args, args.port = ["train", "--devices", "4", *CHILD[1:]], 999
    assert command(args) == 5
    assert started[1][0][0][3:] == child
    assert started[1][1][1]["JAXPAR_COORDINATOR"] == "127.0.0.1:999"


def test_a_document_run_resumes_on_2_then_3_processes(tmp_path):
    """A mixture of documents (Parquet and zstd jsonl) tokenized as read and packed: two
    steps on 2 processes (4 devices each), two more resumed on 3 (2 each, 6 devices, on an
    fsdp x tensor mesh: tensor parallelism in a multi-process run) from the stream
    positions gathered into the checkpoint. The global batches do not depend on the
    process count, so the losses follow one uninterrupted process's run on 8 devices (the
    first bitwise: same data, same init), up to float summation order; metrics are written
    once, by process 0; and the last checkpoint, written collectively by 3 processes, loads
    into one process with 8 devices holding that run's weights. (4 processes resuming on
    fewer: tests/runs/test_pod_rehearsal.py.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from tests.data.test_streams import _docs
    from tests.data.test_tokenizer import make_tokenizer

    make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    pq.write_table(pa.table({"text": _docs(300, 1)}), tmp_path / "web.parquet",
                   row_group_size=50)
    (tmp_path / "code.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": d}) + "\n" for d in _docs(200, 2)).encode()))
    run = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
           "model.d_ff=64", "model.max_seq_len=32", "train.seq_len=16", "train.global_batch=24",
           "train.warmup_steps=0", f"data.tokenizer={tmp_path}/tok",
           f"data.sources=[{{path: '{tmp_path}/web.parquet', weight: 2}}, "
           f"{{path: '{tmp_path}/code.jsonl.zst', weight: 1}}]",
           "data.workers=1", "checkpoint.every=2", "checkpoint.async_save=false",
           "train.eval_every=0"]
    out = tmp_path / "run"
    said = {}
    for processes, devices, steps, mesh in ((2, 4, 2, []),
                                            (3, 2, 4, ["mesh.fsdp=3", "mesh.tensor=2"])):
        # the same train.steps (and learning-rate schedule) throughout: --max-steps stops
        resume = ["--resume"] if steps > 2 else []
        proc = subprocess.run(
            [sys.executable, "-m", "jaxpar.cli", "launch", "--processes", str(processes),
             "--devices-per-process", str(devices), "--", "train", "--config",
             "configs/tiny.yaml", "--out", str(out), "--max-steps", "2", *resume, *run,
             *mesh, "train.steps=4"],
            capture_output=True, text=True, timeout=300, env=without_cache(os.environ))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        said[processes] = proc.stdout
    assert "[0] jaxpar: 8 cpu devices in 2 processes, mesh fsdp=8" in said[2], said[2]
    assert "[1] " in said[2]
    assert ("[0] jaxpar: 6 cpu devices in 3 processes, mesh fsdp=3 x tensor=2"
            in said[3]), said[3]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 5))  # written once, by process 0
    config = jaxpar.load_config("configs/tiny.yaml", [*run, "train.steps=4"])
    # the reference saves nothing: checkpoints do not change its losses or weights
    single, history = train(jaxpar.load_config("configs/tiny.yaml", [
        *run, "train.steps=4", "checkpoint.every=0"]), tmp_path / "single", progress=False)
    assert rows[0]["loss"] == history[0]["loss"]
    np.testing.assert_allclose([r["loss"] for r in rows], [m["loss"] for m in history],
                               rtol=1e-4)
    with Checkpointer(out / "checkpoints") as ckpt:
        assert ckpt.steps()[-1] == 4
        restored = build_trainer(config)
        meta = ckpt.restore(restored)
    assert meta["processes"] == 3 and restored.step_count == 4
    want = flat_paths(single.state)
    for key, value in flat_paths(restored.state).items():
        np.testing.assert_allclose(np.asarray(value), np.asarray(want[key]), rtol=1e-4,
                                   atol=1e-6, err_msg=key)
