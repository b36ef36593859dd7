"""``jaxpar tokenize``: text corpora into token shards, once, in parallel.

Each input file (text, ``.jsonl``, ``.jsonl.gz``; globs and folders expand to their files)
is tokenized by a worker process of its own with the run's Hugging Face tokenizer: every
document encoded without special tokens and ended by the EOS id, written as a ``.bin``
shard of raw ids (``uint16`` when the vocabulary fits, else ``uint32``) named after its
position and source (``00003-web.bin``), atomically (a temporary name, then a rename).
``tokenize.json`` beside them records the tokenizer, the EOS id, the id type and each
shard's source and length. The shards are what :mod:`jaxpar.data.shards` reads: train
with ``data.source=OUT data.token_dtype=... data.eos_id=...`` (the command prints the
line), in shuffled epochs, packed, mixed with other sources, on any number of processes.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxpar.data.shards import MANIFEST, is_pattern
from jaxpar.data.tokenizer import (
    data_files,
    documents,
    encoded_stream,
    eos_id,
    load_tokenizer,
    token_dtype,
    tokenizer_json,
    vocab_size,
)
from jaxpar.errors import JaxparError


def input_files(inputs: list[str]) -> list[Path]:
    """Every file the inputs name, in order (globs sorted, folders recursively, hidden
    files left out), each once.

    Raises:
      JaxparError: for an input that matches nothing or does not exist."""
    files: list[Path] = []
    for spec in inputs:
        if is_pattern(spec):
            found = [Path(p) for p in sorted(glob.glob(spec, recursive=True))
                     if Path(p).is_file()]
            if not found:
                raise JaxparError(f"jaxpar tokenize: {spec!r} matches no file")
        elif Path(spec).exists():
            found = data_files(spec)
        else:
            raise JaxparError(f"jaxpar tokenize: {spec!r} does not exist")
        files += [f for f in found if f not in files]
    return files


def _tokenize_file(index: int, file: str, tokenizer_spec: str, field: str, out: str
                   ) -> tuple[str, int]:
    """One worker's file -> ``out/<index>-<stem>.bin``; returns (shard name, ids)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    eos = eos_id(tokenizer, tokenizer_json(tokenizer_spec).parent)
    dtype = np.dtype(token_dtype(vocab_size(tokenizer)))
    stem = Path(file).name.split(".")[0] or "shard"
    name = f"{index:05d}-{stem}.bin"
    target = Path(out) / name
    tmp = target.with_name(f".{name}.{os.getpid()}.tmp")
    count = 0
    try:
        with open(tmp, "wb") as f, tqdm(disable=True) as bar:
            for chunk in encoded_stream(tokenizer, eos, dtype, bar,
                                 documents(file, [Path(file)], field)):
                f.write(chunk.tobytes())
                count += len(chunk)
        os.replace(tmp, target)
    except OSError as exc:
        raise JaxparError(f"jaxpar tokenize: cannot write {str(target)!r}: "
                          f"{exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return name, count


def write_shards(inputs: list[str], tokenizer_spec: str, out: str | Path, *,
                 field: str = "text", workers: int = 0, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into shards in ``out`` (see the module docstring) with
    ``workers`` processes (0: one per CPU, at most one per file); returns the manifest.

    Raises:
      JaxparError: before any work for a bad tokenizer, missing inputs or an ``out`` that
        already holds shards; during it, naming the file, for unreadable or malformed
        input (a JSONL line without ``field``, naming file and line)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    eos = eos_id(tokenizer, tokenizer_json(tokenizer_spec).parent)
    dtype = token_dtype(vocab_size(tokenizer))
    files = input_files(inputs)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.glob("*.bin"))):
        raise JaxparError(f"jaxpar tokenize: --out {str(out)!r} "
                          f"{'holds shards already' if out.is_dir() else 'is a file'}; "
                          "choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    workers = max(1, min(workers or os.cpu_count() or 1, len(files)))
    shards: list[dict] = [{} for _ in files]
    # spawn: workers start clean (no inherited threads or device runtimes).
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool, \
            tqdm(total=len(files), desc="tokenize", unit="file",
                 disable=None if progress else True) as bar:
        jobs = {pool.submit(_tokenize_file, i, str(f), tokenizer_spec, field, str(out)): i
                for i, f in enumerate(files)}
        for job in concurrent.futures.as_completed(jobs):
            name, count = job.result()
            i = jobs[job]
            shards[i] = {"shard": name, "source": str(files[i]), "tokens": count}
            bar.update(1)
    manifest = {"tokenizer": str(tokenizer_json(tokenizer_spec)), "field": field, "eos_id": eos,
                "token_dtype": str(np.dtype(dtype)), "tokens": sum(s["tokens"] for s in shards),
                "shards": shards}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest
