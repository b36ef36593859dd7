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
returns its exit status, naming the process that failed first and its error line. It sets
each process's ``--devices`` (from ``--devices-per-process``), ``--coordinator``,
``--num-processes`` and ``--process-id`` itself: the same flags after ``--`` are refused
before any process starts (the command is :mod:`jaxpar.cli.launch`). Each process runs
:func:`jaxpar.cli.launch.child_main`, which exits as soon as its command fails rather than
wait for the others at ``jax.distributed``'s shutdown.
"""

from __future__ import annotations

import os
import re
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
ENV_HEARTBEAT = "JAXPAR_HEARTBEAT_TIMEOUT_S"
"""Seconds without a heartbeat after which a process counts as lost and the others are
stopped (``jax.distributed``'s ``heartbeat_timeout_seconds``; default 100)."""
ENV_AUTO = "JAXPAR_DISTRIBUTED"
"""Set to ``auto`` to call ``jax.distributed.initialize()`` with no arguments (clusters
JAX detects itself: Cloud TPU, SLURM, Open MPI)."""


def simulate_devices(n: int | None) -> None:
    """Run on ``n`` simulated CPU devices (``jaxpar ... --devices N``); None leaves JAX's
    choice. Must come before JAX starts a backend."""
    if n is None:
        return
    import jax

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise JaxparError(f"environment variable {name}={raw!r} is not an integer") from None


def _heartbeat() -> dict[str, int]:
    """``jax.distributed.initialize``'s heartbeat timeout, when ``JAXPAR_HEARTBEAT_TIMEOUT_S``
    sets one: how soon the others stop once a host is lost."""
    seconds = _env_int(ENV_HEARTBEAT)
    if seconds is None:
        return {}
    if seconds < 1:
        raise JaxparError(f"{ENV_HEARTBEAT}={seconds}: give a number of seconds, 1 or more")
    return {"heartbeat_timeout_seconds": seconds}


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
            jax.distributed.initialize(**_heartbeat())
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
                               process_id=pid, **_heartbeat())
    return True


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*:")
"""The last line of a Python traceback: ``jax.errors.JaxRuntimeError: ...``."""


def _is_error(line: str) -> bool:
    """Whether an output line is a failure's one-line summary: jaxpar's ``jaxpar: error:``
    line, or the last line of a Python traceback (``SomeError: ...``)."""
    return line.startswith("jaxpar: error:") or bool(_EXCEPTION.match(line))


def pump_lines(stream: TextIO, prefix: str, out: TextIO, lock: threading.Lock,
          errors: list[str], said: list[float]) -> None:
    """Copy ``stream`` to ``out`` line by line with ``prefix``; the newest line that looks
    like an error (:func:`_is_error`) is kept as ``errors[0]``, and the time of the first
    ``jaxpar: error:`` line as ``said[0]``."""
    for line in stream:
        line = line.rstrip("\n")
        if _is_error(line.strip()):
            errors[:] = [line.strip()]
            if line.startswith("jaxpar: error:") and not said:
                said.append(time.monotonic())
        with lock:
            out.write(prefix + line + "\n")
            out.flush()


def stop_processes(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM the processes still running, SIGKILL those alive ``grace_s`` later."""
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


def exit_status(code: int) -> int:
    """A process's exit status as a shell reports it."""
    return 128 - code if code < 0 else code  # killed by signal n: 128 + n, as shells say


def first_failure(exits: Mapping[int, tuple[float, int]],
                  said: Mapping[int, float] | None = None) -> int | None:
    """The index of the process that failed first. ``exits`` maps a process index to its
    (exit time, exit code), ``said`` to when it printed its ``jaxpar: error:`` line (a
    process can take a while to exit after that); among those that exited with a
    non-zero code the earliest wins (ties: the lower index)."""
    said = said or {}
    failed = sorted((min(when, said.get(i, when)), i) for i, (when, code) in exits.items()
                    if code != 0)
    return failed[0][1] if failed else None


def run_all(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]] | None = None,
            *, prefixes: Sequence[str] | None = None, out: TextIO | None = None,
            grace_s: float = 5.0) -> int:
    """Run the commands at once, streaming their merged output line by line with prefixes.

    Returns 0 when all succeed; as soon as one fails, the others are stopped (SIGTERM,
    then SIGKILL after ``grace_s``) and its exit status is returned. The process blamed
    is the one that failed first (:func:`first_failure`: the others often fail after it,
    of a collective that lost its peer); one line on stderr names it with its last
    error line (``jaxpar: error: ...``, or a traceback's last line).
    """
    out = out or sys.stdout
    prefixes = prefixes or [f"[{i}] " for i in range(len(commands))]
    lock = threading.Lock()
    procs, threads = [], []
    exits: dict[int, tuple[float, int]] = {}
    errors: list[list[str]] = [[] for _ in commands]
    said: list[list[float]] = [[] for _ in commands]

    def wait(i: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        exits[i] = (time.monotonic(), code)

    for i, cmd in enumerate(commands):
        proc = subprocess.Popen(list(cmd), env=dict(envs[i]) if envs else None,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1)
        procs.append(proc)
        for target, args in ((pump_lines, (proc.stdout, prefixes[i], out, lock, errors[i],
                                     said[i])),
                             (wait, (i, proc))):
            thread = threading.Thread(target=target, args=args, daemon=True)
            thread.start()
            threads.append(thread)
    status, culprit = 0, None
    try:
        while True:
            culprit = first_failure(dict(exits), {i: t[0] for i, t in enumerate(said) if t})
            if culprit is not None:
                status = exit_status(exits[culprit][1])
                break
            if len(exits) == len(procs):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
    finally:
        stop_processes(procs, grace_s)
        for t in threads:
            t.join(timeout=5)
    if culprit is not None and len(procs) > 1:
        detail = f": {errors[culprit][0]}" if errors[culprit] else ""
        with lock:
            print(f"jaxpar launch: process {culprit} failed first (exit status {status})"
                  f"{detail}; stopped the others", file=sys.stderr)
    return status
