"""``jaxpar convert --from-hf``: a Hugging Face model folder as step 0 of a jaxpar run.
:func:`convert_to_run` does the work and is usable from Python."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax

from jaxpar.checkpoint.checkpointer import Checkpointer
from jaxpar.config.assembly import assemble
from jaxpar.config.schema import TrainConfig, load_config, parse_override
from jaxpar.errors import JaxparError
from jaxpar.hf.convert import check_tensors
from jaxpar.hf.families import check_overrides, read_config
from jaxpar.runs.distributed import simulate_devices
from jaxpar.runs.run_folder import check_run_folder
from jaxpar.storage.folders import LOCK_NAME, FolderLock

MESH_FOR_CONVERT = ("mesh.data=1", "mesh.fsdp=-1")
"""Converted weights are held sharded over every device unless a mesh override says else."""


def check_hf_folder(folder: str | Path, what: str = "--from-hf") -> Path:
    """A Hugging Face model folder (``config.json`` present), checked without JAX."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise JaxparError(f"{what} {str(folder)!r} is not a folder")
    if not (path / "config.json").is_file():
        raise JaxparError(f"{what} {str(folder)!r} has no config.json (not a Hugging Face "
                          "model folder)")
    return path


def convert_to_run(folder: str | Path, out: str | Path, overrides: Sequence[str] = ()
                   ) -> Path:
    """Write the Hugging Face model in ``folder`` as step 0 of a jaxpar run in ``out``
    (``out/checkpoints/0``, and the config in ``out/config.yaml``), usable by ``--resume``
    (with ``--config out/config.yaml``) and ``init_from``.

    ``overrides`` are config overrides (the mesh, a precision policy, ...); the model
    section comes from ``folder/config.json``. A ``model.*`` override may set only what
    leaves the weights alone (:data:`~jaxpar.hf.families.COMPATIBLE_FIELDS`); one that
    contradicts ``config.json`` is an error naming both values.
    """
    source = check_hf_folder(folder)
    hf_model, _ = read_config(source)
    parsed = [parse_override(o) for o in overrides]
    model = {k[len("model."):]: v for k, v in parsed if k.startswith("model.")}
    compatible = check_overrides(hf_model, model, str(source / "config.json"))
    given = lambda section: any(k.startswith(section) for k, _ in parsed)
    defaults = [] if given("mesh.") else list(MESH_FOR_CONVERT)
    if not given("train.seq_len"):  # the default may exceed a small model's context
        longest = compatible.get("max_seq_len", hf_model.max_seq_len)
        defaults.append(f"train.seq_len={min(TrainConfig.seq_len, int(longest))}")
    config = load_config(None, [*defaults, *overrides, f"init_from=hf:{source}"])
    if compatible:  # typed as the config reads them, onto the checkpoint's model
        typed = load_config(None, [o for o in overrides if o.startswith("model.")]).model
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, **{k: getattr(typed, k) for k in compatible}))
    check_run_folder(out, resume=False, config=config)
    check_tensors(source)  # the safetensors headers, before anything is built or written
    with writer_lock(FolderLock(Path(out) / LOCK_NAME, "jaxpar convert")):
        trainer = assemble(config).trainer
        with Checkpointer(Path(out) / "checkpoints", every=1, keep=1) as checkpointer:
            checkpointer.save(trainer, config=config, force=True)
        if jax.process_index() == 0:  # what `jaxpar train --resume` continues with
            config.save(Path(out) / "config.yaml")
    return Path(out)


def writer_lock(lock: FolderLock) -> contextlib.AbstractContextManager:
    """``lock`` on process 0 of a run (the one that writes), nothing on the others."""
    return lock if jax.process_index() == 0 else contextlib.nullcontext()


def command(args: argparse.Namespace) -> int:
    """``jaxpar convert``: check the folder, start the devices, write the run."""
    check_hf_folder(args.from_hf)
    simulate_devices(args.devices)
    out = convert_to_run(args.from_hf, args.out, args.overrides)
    print(f"jaxpar: wrote {out}/checkpoints/0 from {args.from_hf}; continue with "
          f"jaxpar train --out {out} --resume, or start runs from it with init_from={out}")
    return 0
