"""One process of ``jaxpar launch`` (``python -m jaxpar.cli.child ARGS``): ``jaxpar ARGS``,
exiting at once when it fails."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

from jaxpar.cli import main


def child_main(argv: Sequence[str]) -> None:
    """One launched process: ``jaxpar`` with ``argv``. A failure exits at once with its
    status, without the shutdown barrier of ``jax.distributed`` (which would wait for the
    other processes, and so hide which one failed first)."""
    try:
        status = main(argv)
    except SystemExit as stop:  # argparse, or sys.exit in a command
        code = stop.code
        status = code if isinstance(code, int) else 0 if code is None else 1
        if status and not isinstance(code, int):
            print(code, file=sys.stderr)
    except BaseException:  # a bug: its traceback, as Python would show it
        traceback.print_exc()
        status = 1
    if status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(0)


if __name__ == "__main__":
    child_main(sys.argv[1:])
