"""Multi-process runs: joining one from ``jaxpar train``, and starting one with ``jaxpar launch``.

A multi-host run is one ``jaxpar train`` per host, each started with the same arguments
plus who it is: ``--coordinator host:port --num-processes N --process-id I`` (or the
environment variables ``JAXPAR_COORDINATOR``, ``JAXPAR_NUM_PROCESSES``,
``JAXPAR_PROCESS_ID``). :func:`initialize` passes them to ``jax.distributed.initialize``
before JAX starts a backend. On a Cloud TPU pod slice nothing needs to be given: every
worker runs the same command and JAX finds its peers itself.

``jaxpar launch --processes 2 --devices-per-process 4 -- train ...`` does this on one
machine for tests and laptops: it starts the processes with simulated CPU devices and gloo
collectives, prefixes their output with ``[i]``, and when one fails stops the others and
returns its exit status.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from jaxpar.errors import JaxparError

ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_AUTO = "JAXPAR_DISTRIBUTED"
"""Set to ``auto`` to call ``jax.distributed.initialize()`` with no arguments (clusters
JAX detects itself: Cloud TPU, SLURM, Open MPI)."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise JaxparError(f"environment variable {name}={raw!r} is not an integer") from None


def _tpu_pod() -> bool:
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join a multi-process run if this process is part of one; returns whether it is.

    Call before anything starts a JAX backend. Arguments left None are read from
    ``JAXPAR_COORDINATOR``, ``JAXPAR_NUM_PROCESSES`` and ``JAXPAR_PROCESS_ID``. With none
    of them set, a Cloud TPU pod slice (or ``JAXPAR_DISTRIBUTED=auto``) is initialised by
    JAX's own detection, and anything else runs as a single process. CPU collectives use
    gloo.

    Raises:
      JaxparError: when only some of the three are given, or the process id is out of range.
    """
    import jax

    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if coordinator is None and num is None and pid is None:
        if os.environ.get(ENV_AUTO, "").lower() == "auto" or _tpu_pod():
            jax.distributed.initialize()
            return True
        return False
    given = {"--coordinator": coordinator, "--num-processes": num, "--process-id": pid}
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise JaxparError(f"a multi-process run needs --coordinator, --num-processes and "
                          f"--process-id (or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, "
                          f"{ENV_PROCESS_ID}); missing {', '.join(missing)}")
    if num < 1 or not 0 <= pid < num:
        raise JaxparError(f"--process-id {pid} is not in [0, {num}) (--num-processes {num})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num,
                               process_id=pid)
    return True


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream: TextIO, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal n: 128 + n, as shells say


def run_all(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]] | None = None,
            *, prefixes: Sequence[str] | None = None, out: TextIO | None = None,
            grace_s: float = 5.0) -> int:
    """Run the commands at once, streaming their merged output line by line with prefixes.

    Returns 0 when all succeed; as soon as one fails, the others are stopped (SIGTERM,
    then SIGKILL after ``grace_s``) and its exit status is returned.
    """
    out = out or sys.stdout
    prefixes = prefixes or [f"[{i}] " for i in range(len(commands))]
    lock = threading.Lock()
    procs, threads = [], []
    for i, cmd in enumerate(commands):
        proc = subprocess.Popen(list(cmd), env=dict(envs[i]) if envs else None,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1)
        procs.append(proc)
        thread = threading.Thread(target=_pump, args=(proc.stdout, prefixes[i], out, lock),
                                  daemon=True)
        thread.start()
        threads.append(thread)
    status, culprit = 0, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                culprit, status = failed[0][0], _exit_status(failed[0][1])
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
    finally:
        _stop(procs, grace_s)
        for t in threads:
            t.join(timeout=5)
    if culprit is not None and len(procs) > 1:
        with lock:
            print(f"jaxpar launch: process {culprit} exited with status {status}; "
                  "stopped the others", file=sys.stderr)
    return status


def _check_child(cmd: list[str], processes: int) -> None:
    """Refuse a ``train`` command whose arguments or config are wrong before starting any
    process (one error line, not one per process)."""
    from jaxpar.cli import checked_train_config, parse_args
    from jaxpar.validate import check_config

    child = parse_args(cmd)  # a bad argument exits 2 with one line, as jaxpar train would
    config = checked_train_config(child)
    check_config(config, devices=child.devices * processes, processes=processes)


def command(args: argparse.Namespace) -> int:
    """``jaxpar launch``: run ``jaxpar train ...`` as ``--processes`` local processes."""
    cmd = list(args.command_args)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise JaxparError("jaxpar launch needs a command after --, e.g. "
                          "jaxpar launch --processes 2 -- train --config configs/tiny.yaml")
    if cmd[0] != "train":
        raise JaxparError(f"jaxpar launch runs 'train' (the multi-process command), "
                          f"not {cmd[0]!r}")
    if args.processes < 1 or args.devices_per_process < 1:
        raise JaxparError("--processes and --devices-per-process must be at least 1")
    if not any(a == "--devices" or a.startswith("--devices=") for a in cmd):
        cmd[1:1] = ["--devices", str(args.devices_per_process)]
    _check_child(cmd, args.processes)
    port = args.port or free_port()
    n = args.processes
    envs = [dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                 **{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(n),
                    ENV_PROCESS_ID: str(i)}) for i in range(n)]
    commands = [[sys.executable, "-m", "jaxpar.cli", *cmd] for _ in range(n)]
    return run_all(commands, envs)
