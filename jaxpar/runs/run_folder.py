"""The run folder's checks, made before anything is built (a light module: the CLI runs
them before JAX starts)."""

from __future__ import annotations

import os
from pathlib import Path

from jaxpar.config.schema import Config
from jaxpar.errors import JaxparError
from jaxpar.storage.folders import LOCK_NAME
from jaxpar.storage.remote import RunMirror, check_url, is_remote


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
