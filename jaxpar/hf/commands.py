"""``jaxpar convert --from-hf`` and ``jaxpar export --to-hf``: Hugging Face folders to jaxpar
runs and back. The CLI parses; these functions do the work and are usable from Python."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from jaxpar.errors import JaxparError
from jaxpar.folders import LOCK_NAME, FolderLock, export_lock

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


def check_export_target(to: str | Path, *, merge_lora: bool, adapters: bool) -> Path:
    """The ``--to-hf`` folder, refused when it is a file; the flags, when both are given."""
    if merge_lora and adapters:
        raise JaxparError("--merge-lora and --adapters exclude each other: merge the adapters "
                          "into a whole model, or export the adapters alone")
    path = Path(to).expanduser()
    if path.exists() and not path.is_dir():
        raise JaxparError(f"--to-hf {str(to)!r} is a file, not a folder")
    existing = path.absolute().parent  # the export is staged beside the target, then swapped
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise JaxparError(f"--to-hf {str(to)!r}: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JaxparError(f"--to-hf {str(to)!r}: {str(existing)!r} is not writable")
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
    import jax

    from jaxpar.assembly import assemble
    from jaxpar.checkpoint import Checkpointer
    from jaxpar.config import TrainConfig, load_config, parse_override
    from jaxpar.hf.convert import check_tensors
    from jaxpar.hf.families import check_overrides, read_config
    from jaxpar.run import check_run_folder

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
    with _lock(FolderLock(Path(out) / LOCK_NAME, "jaxpar convert")):
        trainer = assemble(config).trainer
        with Checkpointer(Path(out) / "checkpoints", every=1, keep=1) as checkpointer:
            checkpointer.save(trainer, config=config, force=True)
        if jax.process_index() == 0:  # what `jaxpar train --resume` continues with
            config.save(Path(out) / "config.yaml")
    return Path(out)


def _lock(lock: FolderLock) -> contextlib.AbstractContextManager:
    """``lock`` on process 0 of a run (the one that writes), nothing on the others."""
    import jax

    return lock if jax.process_index() == 0 else contextlib.nullcontext()


def export_run(run: str | Path, to: str | Path, *, merge_lora: bool = False,
               adapters: bool = False, dtype: str = "float32") -> Path:
    """Write a jaxpar run's newest checkpoint as a Hugging Face folder.

    A run without LoRA is written whole. A LoRA run needs ``merge_lora`` (the adapters
    folded into the base weights, written whole) or ``adapters`` (the adapters alone, in
    PEFT's format, for the base model the run started from). The run's tokenizer (its
    ``data.tokenizer``, else the Hugging Face folder it started from) is copied along.
    """
    from jaxpar.generate import check_run, run_config
    from jaxpar.hf.families import to_hf

    target = check_export_target(to, merge_lora=merge_lora, adapters=adapters)
    check_run(run)
    model = run_config(run).model
    if not (model.factory or adapters):  # a model no architecture expresses (experts, ...)
        to_hf(model.transformer())       # is refused before its weights are read
    with _lock(export_lock(target, "jaxpar export")):
        return _export(run, target, merge_lora=merge_lora, adapters=adapters, dtype=dtype)


def _export(run: str | Path, target: Path, *, merge_lora: bool, adapters: bool,
            dtype: str) -> Path:
    import jax.numpy as jnp

    from jaxpar import hf, lora
    from jaxpar.config import hf_folder
    from jaxpar.generate import load_run_model
    from jaxpar.models.transformer import Transformer

    model, config = load_run_model(run)
    if not isinstance(model, Transformer):
        raise JaxparError(f"the run's model is model.factory={config.model.factory!r}; only "
                          "jaxpar's decoder has a Hugging Face layout")
    has_adapters = bool(lora.adapted(model))
    if has_adapters and not (merge_lora or adapters):
        raise JaxparError("the run trained LoRA adapters: pass --merge-lora (a whole model) "
                          "or --adapters (PEFT adapters for the base model)")
    if not has_adapters and (merge_lora or adapters):
        raise JaxparError(f"the run has no LoRA adapters; drop "
                          f"{'--merge-lora' if merge_lora else '--adapters'}")
    base = hf_folder(config.init_from)
    tokenizer = config.data.tokenizer or (base if base and _has_tokenizer(base) else None)
    if adapters:
        hf.save_adapters(model, target, base_model=str(base or ""), dtype=jnp.dtype(dtype))
        if tokenizer:
            hf.convert.copy_tokenizer(tokenizer, target)
        return target
    if has_adapters:
        lora.merge(model, dtype=jnp.float32)
    return hf.save(model, target, dtype=jnp.dtype(dtype), tokenizer=tokenizer)


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file()
