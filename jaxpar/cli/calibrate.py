"""``jaxpar calibrate``: measure this machine's devices and write a catalog entry for
``jaxpar plan --catalog``."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import jax
import yaml

from jaxpar.errors import JaxparError
from jaxpar.planner.calibrate import calibrate, default_name, summary, write_entry
from jaxpar.runs.distributed import simulate_devices
from jaxpar.storage.folders import check_writable
from jaxpar.storage.remote import check_output_file, is_remote, output_file


def command(args: argparse.Namespace) -> int:
    """``jaxpar calibrate``: check ``--out`` and ``--name``, measure, print or write."""
    if args.out and is_remote(args.out):  # written locally, then uploaded
        check_output_file(args.out, "--out")
    elif args.out:
        folder = Path(args.out).parent
        if not folder.is_dir():
            raise JaxparError(f"--out {args.out}: folder {str(folder)!r} does not exist")
        if Path(args.out).is_dir():
            raise JaxparError(f"--out {args.out} is a folder; give a file name")
        check_writable(Path(args.out), "--out", file=True)  # before minutes of measuring
    if args.name is not None and not re.fullmatch(r"[a-z0-9][a-z0-9._\-]*", args.name):
        raise JaxparError(f"--name {args.name!r}: use lower-case letters, digits, '.', '_' "
                          "and '-'")
    simulate_devices(args.devices)
    devices = jax.devices()
    name = args.name or default_name(devices)
    if devices[0].platform == "cpu" and not name.startswith("cpu"):
        raise JaxparError(f"--name {name!r}: the planner prices chips named cpu* as XLA:CPU "
                          "(blocking collectives); name CPU entries cpu...")
    print(f"jaxpar: calibrating {len(devices)} {devices[0].platform} devices "
          f"({devices[0].device_kind}){' (quick)' if args.quick else ''}...", flush=True)
    entry = calibrate(devices, quick=args.quick)
    print(summary(entry))
    if args.out:
        with output_file(args.out, "--out", existing=True) as local:
            raw = write_entry(entry, name, local)
        raw = f"{args.out}.measurements.json" if is_remote(args.out) else raw
        print(f"jaxpar: wrote {args.out} (entry {name!r}) and {raw}; use it with "
              f"jaxpar plan --catalog {args.out} --chips {name}:{len(devices)} ...")
    else:
        figures = {k: v for k, v in entry.items() if k != "measurements"}
        print("\n" + yaml.safe_dump({name: figures}, sort_keys=False), end="")
    return 0
