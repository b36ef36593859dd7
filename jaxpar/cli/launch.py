"""``jaxpar launch``: run ``jaxpar train ...`` as several local processes joined by
``jax.distributed`` (see :mod:`jaxpar.runs.distributed`); each process runs this module's
:func:`jaxpar.cli.child.child_main` (``python -m jaxpar.cli.child``). With ``--replicas``
the processes are independent DiLoCo replicas and the launcher is their parameter server
(:mod:`jaxpar.cli.replicas`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jaxpar.cli.parser import parse_args
from jaxpar.cli.replicas import replicas_command
from jaxpar.cli.train import checked_train_config
from jaxpar.config.validate import check_config
from jaxpar.errors import JaxparError
from jaxpar.runs.distributed import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    free_port,
    run_all,
)


def _conflicts(child: argparse.Namespace, args: argparse.Namespace) -> list[str]:
    """The child's flags that ``jaxpar launch`` sets itself, each named with launch's flag."""
    found = []
    if child.devices is not None and child.devices != args.devices_per_process:
        found.append(f"train --devices {child.devices} (after --) conflicts with launch "
                     f"--devices-per-process {args.devices_per_process}: give the devices "
                     "of each process with --devices-per-process alone")
    own = {"--coordinator": child.coordinator, "--num-processes": child.num_processes,
           "--process-id": child.process_id}
    given = [f"{flag} {value}" for flag, value in own.items() if value is not None]
    if given:
        found.append(f"train {', '.join(given)} (after --) conflicts with launch "
                     f"--processes {args.processes}: jaxpar launch sets --coordinator, "
                     "--num-processes and --process-id of each process itself; drop them")
    return found


def _check_child(cmd: list[str], args: argparse.Namespace) -> list[str]:
    """The ``train`` command each process runs, with ``--devices`` of launch's
    ``--devices-per-process``; refused before any process starts (one error line, not
    one per process) when its arguments or config are wrong or it sets what launch does.
    """
    child = parse_args(cmd)  # a bad argument exits 2 with one line, as jaxpar train would
    conflicts = _conflicts(child, args)
    if conflicts:
        raise JaxparError("; ".join(conflicts))
    if child.devices is None:
        cmd = [cmd[0], "--devices", str(args.devices_per_process), *cmd[1:]]
    config = checked_train_config(child)
    check_config(config, devices=args.devices_per_process * args.processes,
                 processes=args.processes)
    return cmd


def child_processes(cmd: Sequence[str], processes: int, port: int
                    ) -> tuple[list[list[str]], list[dict[str, str]]]:
    """The command lines and environments of the ``processes`` that run the jaxpar command
    ``cmd`` (e.g. ``["train", ...]``) together, with the coordinator on ``port``."""
    envs = [dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                 **{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(processes),
                    ENV_PROCESS_ID: str(i)}) for i in range(processes)]
    return [[sys.executable, "-m", "jaxpar.cli.child", *cmd] for _ in range(processes)], envs


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
    if args.replicas is not None:
        return replicas_command(args, cmd)
    if args.processes < 1 or args.devices_per_process < 1:
        raise JaxparError("--processes and --devices-per-process must be at least 1")
    cmd = _check_child(cmd, args)
    commands, envs = child_processes(cmd, args.processes, args.port or free_port())
    return run_all(commands, envs)
