"""The ``jaxpar`` command line.

``jaxpar train --config configs/tiny.yaml [--devices N] [--out DIR] [--resume] [key=value ...]``
``jaxpar plan --model configs/llama-7b.yaml --chips tpu-v5p:256 --global-batch 512 --seq 4096``
``jaxpar inspect --config configs/tiny.yaml --devices 8 [--json]``
``jaxpar compile --target tpu-v5p:4x4x4 [--slices N] --config RUN.yaml [--json] [--save DIR]``
``jaxpar calibrate [--out chip.yaml] [--name NAME] [--devices N] [--quick]``
``jaxpar launch --processes 2 --devices-per-process 4 -- train --config ...``
``jaxpar sample --run runs/tiny --prompt "def " [--max-tokens 64] [--temperature 0] [--top-k 0]``
``jaxpar convert --from-hf HF_FOLDER --out RUN [--devices N] [key=value ...]``
``jaxpar export --run RUN --to-hf DIR [--merge-lora | --adapters] [--dtype bfloat16]``
``jaxpar tokenize --tokenizer TOK --out SHARDS [--field text] [--workers N] INPUT ...``
``jaxpar goodput RUN [--json]``

One module a command (:mod:`jaxpar.cli.train`, :mod:`~jaxpar.cli.plan`,
:mod:`~jaxpar.cli.inspection`, :mod:`~jaxpar.cli.calibrate`, :mod:`~jaxpar.cli.launch`,
:mod:`~jaxpar.cli.sample`, :mod:`~jaxpar.cli.convert`, :mod:`~jaxpar.cli.export`,
:mod:`~jaxpar.cli.tokenize_corpus`, :mod:`~jaxpar.cli.goodput`), their
arguments in :mod:`jaxpar.cli.parser`. ``--devices N`` simulates N CPU devices; it is
handled before JAX starts a backend. Options and ``section.key=value`` overrides may come
in any order.

A mistake in the input (a config key, a value out of range, a file, a folder, a device
count) is reported as one line, ``jaxpar: error: ...``, with exit status 2, before any
heavy work; an interrupted run exits with 130 (Ctrl-C) or 143 (SIGTERM) after finishing
its checkpoint. Output cut short by its reader (``jaxpar plan ... | head``) ends quietly
with 141 (128 + SIGPIPE, as a shell reports a command killed by a broken pipe). Anything
else that goes wrong is a bug and shows its traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence

from jaxpar.cli.parser import build_parser, parse_args
from jaxpar.errors import JaxparError, JaxparWarning, RunStopped

COMMANDS: dict[str, str] = {
    "train": "train", "plan": "plan", "inspect": "inspection", "compile": "inspection",
    "calibrate": "calibrate", "launch": "launch", "sample": "sample", "convert": "convert",
    "export": "export", "tokenize": "tokenize_corpus", "goodput": "goodput",
}
"""The module of :mod:`jaxpar.cli` whose ``command`` each ``jaxpar`` subcommand runs,
imported once the arguments parse: ``--help`` and argument errors never start JAX."""


def command_for(name: str) -> Callable:
    """The ``command`` function of subcommand ``name``."""
    return importlib.import_module(f"jaxpar.cli.{COMMANDS[name]}").command


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """jaxpar's own warnings as one line, without the source line that raised them."""
    if issubclass(category, JaxparWarning):
        print(f"jaxpar: warning: {message}", file=file or sys.stderr)
    else:
        _DEFAULT_SHOW(message, category, filename, lineno, file, line)


_DEFAULT_SHOW = warnings.showwarning


def _quiet_stdout() -> None:
    """After the reader of stdout went away (``| head``): point stdout at ``/dev/null`` so
    the interpreter's final flush has nowhere to fail (the standard recipe of Python's
    ``signal`` documentation)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured output)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` command; user errors print one line and exit 2."""
    args = parse_args(argv)
    shown = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        status = command_for(args.command)(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit as "Exception ignored"
        return status
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    except JaxparError as err:
        print(f"jaxpar: error: {err}", file=sys.stderr)
        return 2
    except RunStopped as stop:
        print(f"jaxpar: {stop}", file=sys.stderr)
        return stop.status
    except KeyboardInterrupt:
        print("jaxpar: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown


__all__ = ["COMMANDS", "build_parser", "command_for", "main", "parse_args"]
