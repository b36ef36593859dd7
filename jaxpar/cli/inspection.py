"""``jaxpar inspect``: compile a config's training step and print what XLA did."""

from __future__ import annotations

import argparse
import json

from jaxpar.analysis.inspection import inspect_config
from jaxpar.analysis.report import render_inspection
from jaxpar.config.schema import load_config
from jaxpar.config.validate import check_config
from jaxpar.runs.distributed import simulate_devices


def command(args: argparse.Namespace) -> int:
    """``jaxpar inspect``: print the report of :func:`inspect_config` as tables or JSON."""
    simulate_devices(args.devices)
    config = load_config(args.config, args.overrides, keep_mesh=args.keep_mesh)
    check_config(config)
    report = inspect_config(config, source=args.config or "defaults")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render_inspection(report))
    return 0
