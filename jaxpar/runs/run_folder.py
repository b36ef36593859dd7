"""The run folder's checks, made before anything is built (a light module: the CLI runs
them before JAX starts)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from jaxpar.errors import JaxparError
from jaxpar.storage.folders import LOCK_NAME
from jaxpar.storage.remote import check_url, is_remote
from jaxpar.storage.run_mirror import RunMirror

if TYPE_CHECKING:
    from jaxpar.config.schema import Config

FINISHED = "finished.json"
"""Written at the end of a run: its last step and that checkpoint's size in bytes (what lets
``--resume`` on a finished run answer without building anything)."""


def folder_bytes(folder: Path) -> int:
    """The bytes of every file under ``folder``."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def mark_finished(out: Path, step: int) -> None:
    """Record that the run in ``out`` finished at ``step``, with its checkpoint's size."""
    checkpoint = out / "checkpoints" / str(step)
    if checkpoint.is_dir():
        (out / FINISHED).write_text(json.dumps({"step": step,
                                                "bytes": folder_bytes(checkpoint)}))


def check_run_folder(out_dir: str | Path | None, *, resume: bool = False,
                     config: Config | None = None) -> None:
    """Refuse a run folder that cannot work before anything is built or written.

    Raises:
      JaxparError: when ``--resume`` has no folder, the folder is a file or not writable,
        a fresh run would go into a folder that holds checkpoints (nothing saved is ever
        overwritten), or ``train.profile_steps`` has no folder to write the trace to.
    """
    if out_dir is not None:
        check_url(out_dir, "--out")
    if is_remote(out_dir):  # a bucket: its checkpoints, then the local copy's
        mirror = RunMirror(str(out_dir), skip=(LOCK_NAME,))
        mirror.check()
        steps = mirror.remote_steps()
        if steps and not resume:
            raise JaxparError(f"{out_dir} already holds checkpoints (steps {steps}); pass "
                              "--resume to continue that run, or choose another --out")
        if mirror.direct:  # the run's local folder is a fresh scratch folder
            return
        out_dir = mirror.local
    if out_dir is None:
        if resume:
            raise JaxparError("--resume needs --out: the run folder that holds checkpoints/")
        if config is not None and config.train.profile_steps:
            raise JaxparError(f"train.profile_steps={list(config.train.profile_steps)} needs "
                              "--out: the trace is written to OUT/profile")
        return
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise JaxparError(f"--out {str(out)!r} is a file, not a folder")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise JaxparError(f"--out {str(out)!r}: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JaxparError(f"--out {str(out)!r}: {str(existing)!r} is not writable")
    saved = out / "checkpoints"
    steps = sorted(int(p.name) for p in saved.iterdir() if p.name.isdigit()) if (
        saved.is_dir()) else []
    if steps and not resume:
        raise JaxparError(f"{saved} already holds checkpoints (steps {steps}); pass --resume "
                          "to continue that run, or choose another --out")
