"""``jaxpar export --to-hf``: a jaxpar run's newest checkpoint as a Hugging Face folder
(a whole model, or PEFT adapters). :func:`export_run` does the work and is usable from
Python."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxpar import hf
from jaxpar.adapters import lora
from jaxpar.cli.convert import writer_lock
from jaxpar.config.schema import hf_folder
from jaxpar.errors import JaxparError
from jaxpar.hf.families import read_config, to_hf
from jaxpar.hf.own_weights import save_own_weights
from jaxpar.models.transformer import Transformer
from jaxpar.runs.generate import check_run, load_run_model, run_config
from jaxpar.storage.folders import STALE_WEIGHTS, export_lock
from jaxpar.storage.remote import check_bucket, is_remote, output_folder


def check_export_target(to: str | Path, *, merge_lora: bool, adapters: bool) -> Path:
    """The ``--to-hf`` folder, refused when it is a file (or a bucket that cannot be used);
    the flags, when both are given."""
    if merge_lora and adapters:
        raise JaxparError("--merge-lora and --adapters exclude each other: merge the adapters "
                          "into a whole model, or export the adapters alone")
    if is_remote(to):  # written locally, then uploaded (see output_folder)
        check_bucket(str(to), "--to-hf")
        return Path(str(to))
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


def export_run(run: str | Path, to: str | Path, *, merge_lora: bool = False,
               adapters: bool = False, dtype: str = "float32") -> Path | str:
    """Write a jaxpar run's newest checkpoint as a Hugging Face folder (local, or a
    ``gs://``/``s3://`` URL: written locally, then uploaded; earlier weight files there
    are removed).

    A run without LoRA is written whole. A LoRA run needs ``merge_lora`` (the adapters
    folded into the base weights, written whole) or ``adapters`` (the adapters alone, in
    PEFT's format, for the base model the run started from). The run's tokenizer (its
    ``data.tokenizer``, else the Hugging Face folder it started from) is copied along. A
    ``model.factory`` model, which no Hugging Face architecture describes, is written as
    ``model.safetensors`` under its own parameter names, its blocks in their list however
    the run laid them out (:mod:`jaxpar.hf.own_weights`).
    """
    target = check_export_target(to, merge_lora=merge_lora, adapters=adapters)
    check_run(run)
    model = run_config(run).model
    if not (model.factory or adapters):  # a model no architecture expresses (experts, ...)
        to_hf(model.transformer())       # is refused before its weights are read
    if is_remote(to):
        with output_folder(str(to), "--to-hf", replace=STALE_WEIGHTS) as local:
            _export(run, local, merge_lora=merge_lora, adapters=adapters, dtype=dtype)
        return str(to).rstrip("/")
    with writer_lock(export_lock(target, "jaxpar export")):
        return _export(run, target, merge_lora=merge_lora, adapters=adapters, dtype=dtype)


def _export(run: str | Path, target: Path, *, merge_lora: bool, adapters: bool,
            dtype: str) -> Path:
    model, config = load_run_model(run)
    has_adapters = bool(lora.adapted(model))
    if not isinstance(model, Transformer):
        return _export_own(model, config, target, has_adapters=has_adapters,
                           adapters=adapters, dtype=dtype)
    if has_adapters and not (merge_lora or adapters):
        raise JaxparError("the run trained LoRA adapters: pass --merge-lora (a whole model) "
                          "or --adapters (PEFT adapters for the base model)")
    if not has_adapters and (merge_lora or adapters):
        raise JaxparError(f"the run has no LoRA adapters; drop "
                          f"{'--merge-lora' if merge_lora else '--adapters'}")
    base = hf_folder(config.init_from)
    tokenizer = config.data.tokenizer or (base if base and _has_tokenizer(base) else None)
    arch = _base_architecture(base, model)
    if adapters:
        hf.save_adapters(model, target, base_model=str(base or ""), dtype=jnp.dtype(dtype),
                         architecture=arch)
        if tokenizer:
            hf.convert.copy_tokenizer(tokenizer, target)
        return target
    if has_adapters:
        lora.merge(model, dtype=jnp.float32)
    return hf.save(model, target, dtype=jnp.dtype(dtype), tokenizer=tokenizer,
                   architecture=arch)


def _base_architecture(base: Path | None, model: Transformer) -> str | None:
    """The architecture of the Hugging Face folder the run started from, when it still
    expresses the model (a run from Phi-3 is exported as Phi-3, not as the Llama its
    options also describe); None (the options choose) otherwise."""
    if base is None or not (base / "config.json").is_file():
        return None
    try:
        _, arch = read_config(base)
        to_hf(model.config, arch)
    except JaxparError:
        return None
    return arch


def _export_own(model: Any, config: Any, target: Path, *, has_adapters: bool,
                adapters: bool, dtype: str) -> Path:
    """A ``model.factory`` model: its own weights under its own names (no Hugging Face
    architecture describes it), LoRA merged."""
    if adapters:
        raise JaxparError(f"--adapters writes PEFT adapters for a Hugging Face model; the run's "
                          f"model is model.factory={config.model.factory!r}: use --merge-lora")
    if has_adapters:
        lora.merge(model, dtype=jnp.float32)
    save_own_weights(model, target, dtype=jnp.dtype(dtype))
    (target / "jaxpar_model.json").write_text(json.dumps(
        {"factory": config.model.factory, "kwargs": dict(config.model.kwargs or {})}) + "\n")
    return target


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file()


def command(args: argparse.Namespace) -> int:
    """``jaxpar export``: check the target and the run, write the folder."""
    check_export_target(args.to_hf, merge_lora=args.merge_lora, adapters=args.adapters)
    check_run(args.run)
    out = export_run(args.run, args.to_hf, merge_lora=args.merge_lora,
                     adapters=args.adapters, dtype=args.dtype)
    kind = "PEFT adapters" if args.adapters else "a Hugging Face model"
    print(f"jaxpar: wrote {kind} to {out}")
    return 0
