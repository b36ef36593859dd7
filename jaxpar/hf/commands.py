"""``jaxpar convert --from-hf`` and ``jaxpar export --to-hf``: Hugging Face folders to jaxpar
runs and back. The CLI parses; these functions do the work and are usable from Python."""

from __future__ import annotations

import contextlib
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
    return path


def convert_to_run(folder: str | Path, out: str | Path, overrides: Sequence[str] = ()
                   ) -> Path:
    """Write the Hugging Face model in ``folder`` as step 0 of a jaxpar run in ``out``
    (``out/checkpoints/0``, with the config), usable by ``--resume`` and ``init_from``.

    ``overrides`` are config overrides (the mesh, a precision policy, ...); the model
    section comes from ``folder/config.json``.
    """
    from jaxpar.assembly import assemble
    from jaxpar.checkpoint import Checkpointer
    from jaxpar.config import TrainConfig, load_config
    from jaxpar.hf.families import read_config
    from jaxpar.run import check_run_folder

    source = check_hf_folder(folder)
    given = lambda section: any(o.startswith(section) for o in overrides)
    defaults = [] if given("mesh.") else list(MESH_FOR_CONVERT)
    if not given("train.seq_len="):  # the default may exceed a small model's context
        seq_len = min(TrainConfig.seq_len, read_config(source)[0].max_seq_len)
        defaults.append(f"train.seq_len={seq_len}")
    config = load_config(None, [*defaults, *overrides, f"init_from=hf:{source}"])
    check_run_folder(out, resume=False, config=config)
    with _lock(FolderLock(Path(out) / LOCK_NAME, "jaxpar convert")):
        trainer = assemble(config).trainer
        with Checkpointer(Path(out) / "checkpoints", every=1, keep=1) as checkpointer:
            checkpointer.save(trainer, config=config, force=True)
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

    from jaxpar.generate import check_run

    target = check_export_target(to, merge_lora=merge_lora, adapters=adapters)
    check_run(run)
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
