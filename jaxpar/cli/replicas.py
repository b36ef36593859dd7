"""``jaxpar launch --replicas N -- train ...``: DiLoCo replicas as independent local
processes, the launcher their parameter server (:mod:`jaxpar.runs.replicas`).

Replica ``r`` runs ``jaxpar train`` with ``--out OUT/replica_r`` (``replica_r.1`` after
a restart, and so on), ``train.seed`` + ``r`` (its own data order) and
``diloco.sync_every=0`` (it meets through the server, not over a mesh axis); the
meetings folder is ``OUT/meetings``. The launcher polls the processes and the folder:
a replica that exits with an error or a signal is dropped from the meetings at once and,
while ``--restart`` allows, started again to rejoin. ``OUT/replicas.json`` names each
replica's process id and run folder. The launch succeeds when at least one replica
trained to the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxpar.cli.parser import parse_args
from jaxpar.cli.train import checked_train_config
from jaxpar.config.schema import load_config
from jaxpar.config.validate import check_config
from jaxpar.errors import JaxparError
from jaxpar.runs import distributed
from jaxpar.runs.replicas import (
    ENV_EVERY,
    ENV_FOLDER,
    ENV_LAUNCHER,
    ENV_REPLICA,
    SERVER_STATE,
    ParameterServer,
    check_resumable,
)


def _checked(args: argparse.Namespace, cmd: list[str]):
    """The child's parsed arguments and config, refused in one line where they cannot run
    as replicas."""
    child = parse_args(cmd)
    if args.replicas < 1 or args.devices_per_process < 1 or args.restart < 0:
        raise JaxparError("--replicas and --devices-per-process must be at least 1, "
                          "--restart at least 0")
    given = [flag for flag, value in (("--coordinator", child.coordinator),
                                      ("--num-processes", child.num_processes),
                                      ("--process-id", child.process_id),
                                      ("--devices", child.devices)) if value is not None]
    if given:
        raise JaxparError(f"train {', '.join(given)} (after --): jaxpar launch --replicas "
                          "runs each replica as a process of its own with "
                          "--devices-per-process devices; drop them")
    if child.resume:
        raise JaxparError("train --resume (after --): replicas rejoin from the parameter "
                          "server's anchor; drop --resume")
    if not child.out:
        raise JaxparError("jaxpar launch --replicas needs train --out: the replicas' runs "
                          "and their meetings live there")
    config = load_config(child.config, child.overrides, keep_mesh=child.keep_mesh)
    if config.diloco.sync_every < 1:
        raise JaxparError("jaxpar launch --replicas needs diloco.sync_every >= 1: the "
                          "steps between the replicas' meetings")
    dl = config.diloco
    inprogram = [f"diloco.{k}={v}" for k, v, default in (
        ("fragments", dl.fragments, 1), ("outer_bits", dl.outer_bits, 32),
        ("overlap", dl.overlap, False)) if v != default]
    if inprogram:
        raise JaxparError(f"{', '.join(inprogram)}: jaxpar launch --replicas meets whole "
                          "float32 weights through the parameter server, once per "
                          "meeting; these are in-program DiLoCo's (one process, data >= 2): "
                          "drop them")
    _check_folder(Path(child.out), config.diloco.sync_every, getattr(args, "resume", False))
    # each replica runs the config without in-program DiLoCo, on its own devices
    alone = checked_train_config(parse_args([*cmd, "diloco.sync_every=0"]))
    check_config(alone, devices=args.devices_per_process, processes=1)
    return child, config


def _saved(out: Path) -> list[str]:
    """The replicas' run folders in ``out`` that hold checkpoints."""
    return sorted(p.parent.name for p in out.glob("replica_*/checkpoints")
                  if any(c.name.isdigit() for c in p.iterdir()))


def _check_folder(out: Path, sync_every: int, resume: bool) -> None:
    """Refuse in one line, with advice that works, a replica run ``out`` cannot hold:
    a resume without the server's state (or with another ``sync_every``, a stray in
    ``meetings/``), a fresh start over an earlier run's meetings or checkpoints."""
    meetings = out / "meetings"
    begun = meetings.exists() and any(meetings.iterdir())
    saved = _saved(out)
    if resume:
        if (meetings / SERVER_STATE).is_file():
            check_resumable(meetings, sync_every)
            return
        held = ", ".join(saved) or (str(meetings) if begun else "")
        raise JaxparError(
            f"launch --resume: {meetings} holds no completed meeting (no {SERVER_STATE}) "
            "to continue from; " + (
                f"{held} cannot rejoin without it: start a new replica run with another "
                "--out (this one is kept)" if held
                else "start the replica run without --resume"))
    if (meetings / SERVER_STATE).is_file():
        raise JaxparError(f"{meetings} already holds a replica run; continue it with "
                          "jaxpar launch --replicas N --resume, or choose another --out")
    if begun or saved:
        raise JaxparError(f"{out} already holds a replica run that completed no meeting "
                          f"({', '.join(saved) or meetings}): choose another --out (this "
                          "one is kept)")


def _last_step(folder: str | Path) -> int | None:
    """The last step a replica's run folder logged (``metrics.jsonl``), or None."""
    path = Path(folder) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def summary(replicas: int, reached: dict[int, int | None], failed: dict[int, int],
            steps: int, max_steps: int | None, meetings: int) -> str:
    """The launcher's last line: how many replicas trained to the end (step ``steps``),
    and where those that exited cleanly before it stopped (``--max-steps``); ``reached``
    maps each replica that exited with status 0 to the last step it logged."""
    done = [r for r, s in reached.items() if s is None or s >= steps]
    early = sorted((r, s) for r, s in reached.items() if r not in done)
    said = f"{len(done)} of {replicas} replicas trained to the end after {meetings} meetings"
    if early:
        why = f" (--max-steps {max_steps})" if max_steps else ""
        said += "; " + ", ".join(f"replica {r} stopped at step {s} of {steps}"
                                 for r, s in early) + why + (
            f"; continue with jaxpar launch --replicas {replicas} --resume")
    if failed:
        said += "; " + ", ".join(f"replica {r} failed (exit status {c})"
                                 for r, c in sorted(failed.items()))
    return said


def _last_attempt(out: Path, replica: int) -> int:
    """The attempt number of replica ``replica``'s newest run folder (``replica_r`` is 0,
    ``replica_r.2`` is 2)."""
    found = [0 if p.name == f"replica_{replica}" else int(p.name.rsplit(".", 1)[1])
             for p in out.glob(f"replica_{replica}*")
             if p.name == f"replica_{replica}" or p.name.rsplit(".", 1)[-1].isdigit()]
    return max(found, default=0)


def _command(cmd: list[str], out: Path, replica: int, attempt: int, seed: int,
             devices: int, resume: bool = False) -> tuple[list[str], Path]:
    """Replica ``replica``'s command line (the ``train`` arguments with its own --out,
    devices, seed and no in-program DiLoCo; ``--resume`` from its folder's checkpoint)
    and run folder."""
    folder = out / (f"replica_{replica}" + (f".{attempt}" if attempt else ""))
    args, skip = [], False
    for a in cmd:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        if a.startswith("--out="):
            continue
        args.append(a)
    args += ["--out", str(folder), "--devices", str(devices), "diloco.sync_every=0",
             f"train.seed={seed + replica}"] + (["--resume"] if resume else [])
    return [sys.executable, "-m", "jaxpar.cli", *args], folder


def replicas_command(args: argparse.Namespace, cmd: list[str]) -> int:
    """Run the replicas and serve their meetings until every replica has exited."""
    child, config = _checked(args, cmd)
    out = Path(child.out)
    dl = config.diloco
    server = ParameterServer(out / "meetings", outer_lr=dl.outer_lr,
                             outer_momentum=dl.outer_momentum, nesterov=dl.nesterov,
                             staleness=dl.staleness, sync_every=dl.sync_every)
    resume = getattr(args, "resume", False)
    if resume:
        server.restore()
    lock = threading.Lock()
    procs: dict[int, subprocess.Popen] = {}
    attempts = {r: _last_attempt(out, r) if resume else 0 for r in range(args.replicas)}
    resuming = set(range(args.replicas)) if resume else set()
    folders: dict[int, str] = {}
    restarts = args.restart

    def start(r: int) -> None:
        line, folder = _command(cmd, out, r, attempts[r], config.train.seed,
                                args.devices_per_process, resume=r in resuming)
        resuming.discard(r)  # a restart after this starts afresh and joins
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                   PYTHONUNBUFFERED="1", **{ENV_FOLDER: str(server.folder),
                                             ENV_REPLICA: str(r), ENV_EVERY: str(dl.sync_every),
                                             ENV_LAUNCHER: str(os.getpid())})
        proc = subprocess.Popen(line, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                bufsize=1)
        procs[r], folders[r] = proc, str(folder)
        threading.Thread(target=distributed.pump_lines, args=(proc.stdout, f"[{r}] ", sys.stdout,
                                                         lock, [], []), daemon=True).start()
        (out / "replicas.json").write_text(json.dumps(
            {str(k): {"pid": p.pid, "out": folders[k]} for k, p in procs.items()}))

    def say(text: str) -> None:
        with lock:
            print(f"jaxpar launch: {text}", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    if resume:
        say(f"resuming the replica run in {out} after meeting {server.round}")
    for r in range(args.replicas):
        start(r)
    finished: set[int] = set()
    failed: dict[int, int] = {}
    try:
        while True:
            for r, proc in list(procs.items()):
                code = proc.poll()
                if code is None or r in finished or r in failed:
                    continue
                if code == 0:
                    finished.add(r)
                    continue
                status = distributed.exit_status(code)
                for line in server.drop(r):
                    say(line)
                if restarts > 0:
                    restarts -= 1
                    attempts[r] += 1
                    say(f"replica {r} exited with status {status}; restarting it "
                        f"({folders[r]} -> attempt {attempts[r]})")
                    start(r)
                else:
                    failed[r] = status
                    say(f"replica {r} exited with status {status}; the others go on")
            alive = {r for r, p in procs.items() if p.poll() is None}
            for line in server.poll(alive, finished):
                say(line)
            if not alive:
                break
            time.sleep(0.02)
    except KeyboardInterrupt:
        distributed.stop_processes(list(procs.values()), 5.0)
        return 130
    say(summary(args.replicas, {r: _last_step(folders[r]) for r in finished}, failed,
                config.train.steps, child.max_steps, server.round)
        + f"; the anchor is {server.folder}/round_{server.round}/anchor.npz")
    if finished:
        return 0
    return next(iter(failed.values()), 1)
