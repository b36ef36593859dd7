"""``jaxpar tokenize``: text corpora into token shards, once, in parallel.

Each input file (text, ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, Parquet, Arrow and
ArrayRecord files, read as :mod:`jaxpar.data.documents` reads them for training; globs and
folders expand to their files) is tokenized by a worker process of its own with the run's
Hugging Face tokenizer: every document encoded without special tokens and ended by the EOS
id, written as a ``.bin`` shard of raw ids (``uint16`` when the vocabulary fits, else
``uint32``) named after its position and source (``00003-web.bin``), atomically (a
temporary name, then a rename). ``tokenize.json`` beside them records the tokenizer, its
vocabulary, the EOS id, the id type and each shard's source and length; training checks a
config against it (:func:`jaxpar.data.shards.check_shards`). The shards are what
:mod:`jaxpar.data.shards` reads: train with ``data.source=OUT data.token_dtype=...
data.eos_id=...`` (the command prints the line), in shuffled epochs, packed, mixed with
other sources, on any number of processes.

Interrupted (Ctrl-C, SIGTERM), the command stops its workers at once and exits 130 or 143
in one line. Its ``tokenize.json`` says ``"complete": false`` from the start until the
last shard is written, so a folder cut off part way is known as such: training refuses it,
and the same command again rewrites it (saying so). Any other folder with shards is
refused.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxpar.data.documents import document_files, is_hf_dataset, open_documents
from jaxpar.data.shards import MANIFEST, is_pattern, read_manifest
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
from jaxpar.errors import JaxparError, RunStopped

TEXT_READ = (".jsonl.zst", ".parquet", ".arrow", ".array_record")
"""Inputs read through :func:`jaxpar.data.documents.open_documents` (each record's text);
any other file is text, ``.jsonl`` or ``.jsonl.gz``."""
NOT_INPUTS = (".bin", ".npy", ".gz", ".zst", ".zip", ".tar", ".bz2", ".xz")
"""Files refused as inputs (ids, or compressed other than ``.jsonl.gz``/``.jsonl.zst``)."""
SUPPORTED = "text, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .arrow, .array_record"
SHARD_NAME = re.compile(r"^\d{5}-.*\.bin$")
"""The name of a shard this command writes."""


def input_files(inputs: list[str]) -> list[Path]:
    """Every file the inputs name, in order (globs sorted, folders recursively, hidden
    files left out; a Hugging Face ``datasets`` folder's Arrow files), each once.

    Raises:
      JaxparError: for an input that matches nothing, does not exist, or is of a kind not
        read (token ids, other compressed files)."""
    files: list[Path] = []
    for spec in inputs:
        if is_pattern(spec):
            found = [Path(p) for p in sorted(glob.glob(spec, recursive=True))
                     if Path(p).is_file()]
            if not found:
                raise JaxparError(f"jaxpar tokenize: {spec!r} matches no file")
        elif is_hf_dataset(spec):  # its Arrow shards, not its state and info files
            found = [Path(f) for f in document_files(spec)]
        elif Path(spec).exists():
            found = data_files(spec)
        else:
            raise JaxparError(f"jaxpar tokenize: {spec!r} does not exist")
        files += [f for f in found if f not in files]
    for file in files:
        if file.name.endswith(NOT_INPUTS) and not file.name.endswith((".jsonl.gz",
                                                                      ".jsonl.zst")):
            raise JaxparError(f"jaxpar tokenize: input {str(file)!r} is not a kind it reads "
                              f"({SUPPORTED})")
    return files


def _texts(file: str, field: str) -> Iterator[tuple[str, int]]:
    """(text, bytes) per document of ``file``, whatever its kind."""
    if file.endswith(TEXT_READ):
        docs = open_documents(file, field)
        return ((docs[i], 0) for i in range(len(docs)))
    return documents(file, [Path(file)], field)


class _NoBar:
    """A progress bar that shows nothing (no tqdm in a worker: its lock is a semaphore the
    resource tracker would report leaked when the worker is stopped)."""

    n = 0

    def update(self, _: int) -> None:
        """Nothing to show."""


def _quiet_worker() -> None:
    """A worker leaves Ctrl-C to the main process, which stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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
        with open(tmp, "wb") as f:
            for chunk in encoded_stream(tokenizer, eos, dtype, _NoBar(),  # type: ignore
                                        _texts(file, field)):
                f.write(chunk.tobytes())
                count += len(chunk)
        os.replace(tmp, target)
    except OSError as exc:
        raise JaxparError(f"jaxpar tokenize: cannot write {str(target)!r}: "
                          f"{exc.strerror or exc}") from None
    except JaxparError as exc:  # the data layer names data.source; here it is an input
        raise JaxparError(str(exc).replace(f"data.source {file!r}: ", "jaxpar tokenize: ")
                          ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return name, count


def _prepare_out(out: Path) -> None:
    """Make ``out``, or empty it of an interrupted run's shards (saying so).

    Raises:
      JaxparError: when ``out`` is a file or holds shards of a finished run (or others)."""
    if out.exists() and not out.is_dir():
        raise JaxparError(f"jaxpar tokenize: --out {str(out)!r} is a file; choose a folder")
    if out.is_dir():
        manifest = read_manifest(out)
        shards = sorted(out.glob("*.bin"))
        if shards or manifest is not None:
            cut = (manifest.get("complete") is False if manifest is not None
                   else all(SHARD_NAME.match(p.name) for p in shards))
            if not cut:
                raise JaxparError(f"jaxpar tokenize: --out {str(out)!r} holds shards "
                                  "already; choose another folder")
            print(f"jaxpar: --out {str(out)!r} holds what an interrupted jaxpar tokenize left "
                  f"({len(shards)} shards, no finished {MANIFEST}): rewriting it",
                  file=sys.stderr)
            for path in [*shards, *out.glob(".*.tmp")]:
                path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


class _Signals:
    """SIGINT and SIGTERM raise :class:`RunStopped` in the main thread while in use."""

    STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}

    def __enter__(self) -> _Signals:
        self.saved = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.STATUS:
                self.saved[sig] = signal.signal(sig, self._stop)
        return self

    def _stop(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        raise RunStopped(f"tokenize stopped by {name}, its workers with it; the shards are "
                         "unfinished: run the same command again to rewrite "
                         "them", self.STATUS[signal.Signals(signum)])

    def __exit__(self, *_: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """SIGINT ignored while workers start: they inherit that, so a Ctrl-C to the whole
        terminal's process group reaches only this process, which stops them."""
        if signal.SIGINT not in self.saved:
            yield
            return
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._stop)


def _stop_pool(pool: concurrent.futures.ProcessPoolExecutor, out: Path) -> None:
    """End the workers now (a file half tokenized is abandoned) and their temporary files."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(5)
    pool.shutdown(wait=True, cancel_futures=True)  # its queues released: nothing leaks
    for path in out.glob(".*.tmp"):
        path.unlink(missing_ok=True)


def write_shards(inputs: list[str], tokenizer_spec: str, out: str | Path, *,
                 field: str = "text", workers: int = 0, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into shards in ``out`` (see the module docstring) with
    ``workers`` processes (0: one per CPU, at most one per file); returns the manifest.

    Raises:
      JaxparError: before any work for a bad tokenizer, missing inputs or an ``out`` that
        already holds shards (an interrupted run's are rewritten); during it, naming the
        file, for unreadable or malformed input (a JSONL line without ``field``, naming
        file and line).
      RunStopped: on SIGINT (status 130) or SIGTERM (143), once the workers are stopped.
    """
    tokenizer = load_tokenizer(tokenizer_spec)
    eos = eos_id(tokenizer, tokenizer_json(tokenizer_spec).parent)
    vocab = vocab_size(tokenizer)
    dtype = token_dtype(vocab)
    files = input_files(inputs)
    out = Path(out)
    _prepare_out(out)
    manifest = {"tokenizer": str(tokenizer_json(tokenizer_spec)), "field": field,
                "eos_id": eos, "token_dtype": str(np.dtype(dtype)), "vocab_size": vocab}
    (out / MANIFEST).write_text(json.dumps({**manifest, "complete": False,
                                            "inputs": [str(f) for f in files]}, indent=1))
    workers = max(1, min(workers or os.cpu_count() or 1, len(files)))
    shards: list[dict] = [{} for _ in files]
    # spawn: workers start clean (no inherited threads or device runtimes).
    context = multiprocessing.get_context("spawn")
    with _Signals() as signals, tqdm(total=len(files), desc="tokenize", unit="file",
                                     disable=None if progress else True) as bar:
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                                      initializer=_quiet_worker)
        try:
            with signals.spawning():  # the pool starts its workers on the first submit
                jobs = {pool.submit(_tokenize_file, i, str(f), tokenizer_spec, field,
                                    str(out)): i for i, f in enumerate(files)}
            for job in concurrent.futures.as_completed(jobs):
                name, count = job.result()
                i = jobs[job]
                shards[i] = {"shard": name, "source": str(files[i]), "tokens": count}
                bar.update(1)
        except BaseException:
            _stop_pool(pool, out)
            raise
        pool.shutdown()
    manifest.update(complete=True, tokens=sum(s["tokens"] for s in shards), shards=shards)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest
