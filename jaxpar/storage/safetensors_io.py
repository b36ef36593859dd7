"""Reading and writing Hugging Face safetensors folders, a slice at a time.

:class:`SafetensorsFolder` opens ``model.safetensors`` or the shards listed in
``model.safetensors.index.json`` with the ``safetensors`` library (memory-mapped), and
reads any rectangular slice of a tensor without touching the rest; it counts the bytes
each slice read, so tests can show a process read only its share. :func:`write_shards`
writes tensors produced one at a time into shards of at most ``max_shard_bytes``, with
the index ``transformers`` expects, holding at most one shard in host memory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors needs)
import numpy as np
from jax.experimental import multihost_utils
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxpar.errors import JaxparError
from jaxpar.storage.folders import free_bytes, human_bytes, staged_folder, write_fault

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U8": 1, "BOOL": 1}


class SafetensorsFolder:
    """The tensors of a Hugging Face model folder, read slice by slice.

    Use as a context manager (the shard files stay open, memory-mapped, inside it).
    ``bytes_read`` counts the bytes of every slice returned so far.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise JaxparError(f"{index}: not a safetensors index ({err})") from None
            self.files = dict(weight_map)
        elif (self.folder / SINGLE).is_file():
            self.files = None
        else:
            raise JaxparError(f"{self.folder}: no {SINGLE} or {INDEX} (only safetensors "
                              "checkpoints are read; convert .bin files with transformers)")
        self.bytes_read = 0
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, file: str):
        if file not in self._handles:
            path = self.folder / file
            if not path.is_file():
                raise JaxparError(f"{path}: missing (listed in {INDEX})")
            try:
                self._handles[file] = self._stack.enter_context(
                    safe_open(str(path), framework="numpy"))
            except Exception as err:  # safetensors raises its own error types
                raise JaxparError(f"{path}: not a readable safetensors file ({err})") from None
        return self._handles[file]

    def names(self) -> list[str]:
        """Every tensor name in the folder."""
        if self.files is not None:
            return list(self.files)
        return list(self._handle(SINGLE).keys())

    def _file(self, name: str) -> str:
        if self.files is None:
            return SINGLE
        if name not in self.files:
            raise JaxparError(f"{self.folder}: tensor {name!r} is missing")
        return self.files[name]

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """``(shape, safetensors dtype)`` of a tensor, without reading it."""
        handle = self._handle(self._file(name))
        stored = handle.keys()  # a list: safe_open handles have no __contains__
        if name not in stored:
            raise JaxparError(f"{self.folder}: tensor {name!r} is missing")
        part = handle.get_slice(name)
        return tuple(part.get_shape()), part.get_dtype()

    def read(self, name: str, slices: tuple[slice, ...] = ()) -> np.ndarray:
        """The part ``slices`` of tensor ``name`` (leading dimensions; the rest whole)."""
        part = self._handle(self._file(name)).get_slice(name)
        array = part[tuple(slices)] if slices else part[:]
        self.bytes_read += array.nbytes
        return array


EXPORT_DELAY_ENV = "JAXPAR_EXPORT_TEST_DELAY"
"""Test hook: seconds :func:`write_shards` sleeps after each shard it writes."""


def write_shards(folder: str | Path, entries: list[tuple[str, tuple[int, ...], np.dtype]],
                 produce: Callable[[str], np.ndarray], *, max_shard_bytes: int,
                 write: bool = True) -> list[str]:
    """Write tensors into safetensors shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own) plus ``model.safetensors.index.json``, or a single
    ``model.safetensors`` when everything fits in one.

    ``entries`` lists ``(name, shape, dtype)`` in order; ``produce(name)`` returns the
    array, called once per tensor in that order on every process (so it may gather across
    processes); only when ``write`` is true are files written. Returns the file names.
    """
    shards: list[list[tuple[str, int]]] = [[]]
    size = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, nbytes))
        size += nbytes
    folder = Path(folder)
    count = len(shards)
    files = [SINGLE] if count == 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors"
                                          for k in range(count)]
    weight_map, total = {}, 0
    for file, shard in zip(files, shards, strict=True):
        tensors = {}
        for name, nbytes in shard:
            array = produce(name)  # every process gathers; only the writer keeps it
            if write:
                tensors[name] = array
            del array
            weight_map[name] = file
            total += nbytes
        if write:
            tmp = folder / (file + ".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, folder / file)
            if delay := float(os.environ.get(EXPORT_DELAY_ENV) or 0):
                time.sleep(delay)  # a test hook: time to kill the process mid-export
        del tensors
    if write and count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files


def write_hf_folder(folder: Path, entries: list, produce: Callable[[str], np.ndarray],
                    finish: Callable[[Path], None], *, max_shard_bytes: int) -> Path:
    """Write a Hugging Face model folder: the safetensors shards of ``entries`` (``(name,
    shape, dtype)``, each tensor made by ``produce(name)`` when its shard is written), then
    ``finish(staging)`` adds ``config.json`` and the rest. Written by process 0 (every
    process must call it) whole into a hidden sibling and swapped in: a kill at any moment
    leaves the earlier export (or none) or this one, never shards of one beside the other's
    config; a write the file system refuses is one line (:func:`writing`)."""
    writer = jax.process_index() == 0
    with writing(folder), staged_folder(folder, write=writer) as staging:
        write_shards(staging, entries, produce, max_shard_bytes=max_shard_bytes,
                     write=writer)
        if writer:
            finish(staging)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxpar_hf_save")
    return folder


@contextlib.contextmanager
def writing(folder: Path) -> Iterator[None]:
    """Turn a write the file system refuses (a full disk, a read-only or unwritable folder,
    a path through a file) into one line naming ``folder`` and the free space there; the
    folder's earlier contents are left as they were (see :func:`staged_folder`)."""
    existed = folder.is_dir()
    try:
        yield
    except (OSError, SafetensorError) as err:
        reason = write_fault(err)
        if reason is None and not isinstance(err, OSError):
            raise  # not the file system's refusal: a bug, shown whole
        blocker = next((p for p in folder.absolute().parents if p.exists()), None)
        if reason is None and blocker is not None and not blocker.is_dir():
            reason = f"{blocker} is a file, not a folder"
        reason = reason or err.strerror or str(err)
        kept = (f"{folder} is left as it was" if existed else "nothing was written")
        raise JaxparError(f"could not write {folder}: {reason} "
                          f"({human_bytes(free_bytes(folder))} free there); {kept}") from None
