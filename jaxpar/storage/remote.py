"""Object storage: token shards read from a bucket, and run folders kept in one.

A path such as ``s3://bucket/corpus/*.bin`` or ``gs://bucket/runs/7b`` is opened through
fsspec (``s3fs`` for ``s3://``, ``gcsfs`` for ``gs://``); credentials and endpoints come
from the usual places (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, instance roles,
``GOOGLE_APPLICATION_CREDENTIALS``...). Any other scheme is refused in one line.

Two uses:

* :class:`RemoteTokens`: a token shard in a bucket, read by byte ranges (blocks of
  :data:`BLOCK_BYTES`, the last few kept), sliced like the memory map of a local shard.
* :class:`RunMirror`: a run folder in a bucket. The run works in a local mirror (under
  ``$JAXPAR_CACHE_DIR``, default ``~/.cache/jaxpar``) and uploads what changed after each
  checkpoint; ``--resume`` first downloads the bucket's folder. Orbax 0.12 writes
  TensorStore checkpoints straight to ``gs://`` only, so the mirror is what lets ``s3://``
  (and ``gs://`` alike) hold a run. A checkpoint step counts as uploaded once its marker
  :data:`UPLOADED` is written, after every file of every process: a step interrupted
  half-way through its upload is never restored from.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.errors import JaxparError

SCHEMES: dict[str, str] = {"s3": "s3fs", "gs": "gcsfs"}
"""The URL schemes jaxpar reads and writes, and the fsspec package each needs."""
BLOCK_BYTES = 1 << 22
"""Bytes a remote shard reads at once (4 MiB); :attr:`RemoteTokens.KEEP` blocks are kept."""
UPLOADED = ".jaxpar-uploaded"
"""The file that marks a checkpoint step whose every file is in the bucket."""
CACHE_ENV = "JAXPAR_CACHE_DIR"

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_STEP = re.compile(r"^checkpoints/(\d+)/")
_PROCESS = re.compile(r"(?:^|/)ocdbt\.process_(\d+)(?:/|$)")


def url_scheme(path: str | Path) -> str | None:
    """The scheme of a URL (``s3`` of ``s3://b/k``); None for a local path."""
    found = _URL.match(str(path))
    return found.group(1).lower() if found else None


def is_remote(path: str | Path | None) -> bool:
    """Whether ``path`` is a URL in object storage jaxpar supports (see :data:`SCHEMES`)."""
    return path is not None and url_scheme(path) in SCHEMES


def check_url(path: str | Path, what: str) -> None:
    """Refuse, in one line naming ``what``, a URL whose scheme jaxpar does not support."""
    scheme = url_scheme(path)
    if scheme is not None and scheme not in SCHEMES:
        raise JaxparError(f"{what} {str(path)!r}: {scheme}:// is not supported; give a local "
                          f"path or one of {', '.join(s + '://' for s in SCHEMES)}")


def filesystem(url: str, what: str) -> Any:
    """The fsspec file system of ``url``.

    Raises:
      JaxparError: naming ``what``, for an unsupported scheme or a missing fsspec package.
    """
    check_url(url, what)
    import fsspec  # imported on use: local runs never need it

    scheme = url_scheme(url)
    try:
        return fsspec.filesystem(scheme)
    except ImportError:
        raise JaxparError(f"{what} {url!r}: {scheme}:// needs the {SCHEMES[scheme]} package "
                          f"(pip install {SCHEMES[scheme]})") from None


def storage_error(exc: BaseException, url: str, what: str) -> JaxparError:
    """One line for a failed bucket operation: a missing bucket or object, no credentials,
    an unreachable endpoint."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        text = "no such bucket or object" if not text or "does not exist" in text else text
    elif isinstance(exc, PermissionError):
        text = f"access denied ({text})"
    return JaxparError(f"{what} {url!r}: {text}")


@contextlib.contextmanager
def _reported(url: str, what: str) -> Iterator[None]:
    try:
        yield
    except JaxparError:
        raise
    except Exception as exc:  # botocore/aiohttp errors have no common base: name them
        raise storage_error(exc, url, what) from None


def read_object(url: str, what: str) -> bytes:
    """A whole object of a bucket (one line naming ``what`` on failure)."""
    fs = filesystem(url, what)
    with _reported(url, what):
        return fs.cat_file(url)


def remote_files(spec: str, suffixes: tuple[str, ...], what: str) -> list[str]:
    """The objects ``spec`` names, sorted URLs: a glob's matches, the files under a folder
    (those ending in ``suffixes``), or one object.

    Raises:
      JaxparError: in one line, when nothing matches or the bucket cannot be read.
    """
    fs = filesystem(spec, what)
    scheme = url_scheme(spec)
    with _reported(spec, what):
        if any(c in spec for c in "*?["):
            found = sorted(fs.glob(spec))
            if not found:
                raise JaxparError(f"{what} {spec!r}: the pattern matches no object")
        elif fs.isdir(spec):
            found = sorted(p for p in fs.find(spec) if p.endswith(suffixes))
            if not found:
                raise JaxparError(f"{what} {spec!r}: the folder holds no "
                                  f"{' or '.join(suffixes)} object")
        elif fs.exists(spec):
            found = [spec]
        else:
            raise JaxparError(f"{what} {spec!r} does not exist")
    return [p if url_scheme(p) else f"{scheme}://{p}" for p in found]


class RemoteTokens:
    """A token shard in object storage, sliced like a 1-D array of ``dtype``.

    Args:
      url: the object.
      dtype: the ids' type.
      offset: bytes before the first id (a ``.npy`` header).
      size: the object's size in bytes (asked of the bucket when not given).
    """

    KEEP = 8
    """Blocks kept in memory per shard."""

    def __init__(self, url: str, dtype: str | np.dtype, *, offset: int = 0,
                 size: int | None = None):
        self.filename, self.dtype = url, np.dtype(dtype)
        self._fs = filesystem(url, "shard")
        with _reported(url, "shard"):
            size = self._fs.size(url) if size is None else size
        if (size - offset) % self.dtype.itemsize:
            raise JaxparError(f"shard {url!r}: {size - offset} bytes is not a whole number "
                              f"of {self.dtype} ids ({self.dtype.itemsize} bytes each): "
                              "truncated, or set data.token_dtype")
        self._offset, self._len = offset, (size - offset) // self.dtype.itemsize
        self._blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, url: str, token_dtype: str) -> RemoteTokens:
        """A ``.bin`` shard of ``token_dtype`` ids, or a ``.npy`` shard (its header read)."""
        if not url.endswith(".npy"):
            return cls(url, token_dtype)
        fs = filesystem(url, "shard")
        with _reported(url, "shard"), fs.open(url, "rb") as f:
            try:
                major, _ = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if major == 1
                        else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read(f)
            except ValueError as exc:
                raise JaxparError(f"shard {url!r}: not a readable .npy array ({exc})") from None
            offset = f.tell()
        if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
            raise JaxparError(f"shard {url!r}: expected a 1-D integer array of token ids, "
                              f"got {dtype} {shape}")
        return cls(url, dtype, offset=offset, size=offset + shape[0] * dtype.itemsize)

    def __len__(self) -> int:
        return self._len

    def _block(self, index: int) -> bytes:
        with self._lock:
            if index in self._blocks:
                self._blocks.move_to_end(index)
                return self._blocks[index]
        start = self._offset + index * BLOCK_BYTES
        end = min(start + BLOCK_BYTES, self._offset + self._len * self.dtype.itemsize)
        with _reported(self.filename, "shard"):
            data = self._fs.cat_file(self.filename, start=start, end=end)
        with self._lock:
            self._blocks[index] = data
            while len(self._blocks) > self.KEEP:
                self._blocks.popitem(last=False)
        return data

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a remote shard is read by contiguous slices")
        start, stop, _ = key.indices(self._len)
        stop = max(stop, start)
        width = self.dtype.itemsize
        lo, hi = start * width, stop * width
        parts = [self._block(b) for b in range(lo // BLOCK_BYTES,
                                               (hi - 1) // BLOCK_BYTES + 1)] if hi > lo else []
        raw = b"".join(parts)[lo % BLOCK_BYTES:lo % BLOCK_BYTES + hi - lo]
        return np.frombuffer(raw, self.dtype)


def cache_root() -> Path:
    """Where remote run folders are mirrored: ``$JAXPAR_CACHE_DIR`` or ``~/.cache/jaxpar``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxpar")


class RunMirror:
    """A run folder in a bucket, worked on through a local copy.

    Args:
      url: the run folder (``s3://bucket/runs/name``).
      skip: names of files never uploaded (the run's lock).
    """

    def __init__(self, url: str, *, skip: tuple[str, ...] = ()):
        self.url = url.rstrip("/")
        self.fs = filesystem(self.url, "--out")
        _, rest = _URL.match(self.url).groups()
        self.local = cache_root() / "runs" / url_scheme(url) / rest
        self.skip = skip
        self._sent: dict[str, tuple[int, int]] = {}
        self._marks: set[int] | None = None  # steps marked uploaded in the bucket

    def _remote(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def remote_steps(self) -> list[int]:
        """The checkpoint steps wholly uploaded to the bucket, ascending."""
        with _reported(self.url, "--out"):
            markers = self.fs.glob(f"{self.url}/checkpoints/*/{UPLOADED}")
        return sorted(int(m.rstrip("/").split("/")[-2]) for m in markers
                      if m.rstrip("/").split("/")[-2].isdigit())

    def check(self) -> None:
        """Fail in one line when the bucket cannot be listed (no bucket, no credentials, no
        endpoint), before any work."""
        with _reported(self.url, "--out"):
            bucket = self.url.split("://", 1)[1].split("/", 1)[0]
            if not self.fs.exists(f"{url_scheme(self.url)}://{bucket}"):
                raise JaxparError(f"--out {self.url!r}: bucket {bucket!r} does not exist")
            if self.fs.exists(self.url):  # an existing run folder must be listable too
                self.fs.ls(self.url)

    def fetch(self, rel: str) -> Path | None:
        """Download one file of the run folder (``config.yaml``) into the local copy; None
        when the bucket does not have it."""
        with _reported(self.url, "--out"):
            if not self.fs.exists(self._remote(rel)):
                return None
            target = self.local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(self._remote(rel), str(target))
        return target

    def pull(self) -> list[int]:
        """Download the bucket's run folder into the local copy (files already there with
        the same size are kept; steps not wholly uploaded are left out); returns the
        uploaded steps."""
        steps = set(self.remote_steps())
        with _reported(self.url, "--out"):
            listing = self.fs.find(self.url, detail=True) if self.fs.exists(self.url) else {}
        prefix = self.url.split("://", 1)[1].rstrip("/") + "/"
        for key, info in listing.items():
            rel = key.split("://", 1)[-1][len(prefix):]
            step = _STEP.match(rel)
            if rel.endswith(UPLOADED) or (step and int(step.group(1)) not in steps):
                continue
            target = self.local / rel
            if not (target.is_file() and target.stat().st_size == info.get("size")):
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(f".{target.name}.{os.getpid()}.part")
                with _reported(key, "--out"):
                    self.fs.get_file(self._remote(rel), str(part))
                os.replace(part, target)  # processes sharing a mirror never see half a file
            stat = target.stat()
            self._sent[rel] = (stat.st_size, stat.st_mtime_ns)  # in the bucket already
        self._marks = steps
        return sorted(steps)

    def push(self, process_index: int = 0, barrier: Callable[[], None] | None = None) -> None:
        """Upload what changed in the local copy since the last push. Each process sends the
        files of its own ``ocdbt.process_N`` folders; process 0 sends the rest, then, after
        ``barrier`` (every process's files sent), the markers of complete steps."""
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = path.relative_to(self.local).as_posix()
            if path.name in self.skip or path.name.endswith(".part") or (
                    "orbax-checkpoint-tmp" in rel):
                continue
            owner = _PROCESS.search(rel)
            if (int(owner.group(1)) if owner else 0) != process_index:
                continue
            stat = path.stat()
            stamp = (stat.st_size, stat.st_mtime_ns)
            if self._sent.get(rel) == stamp:
                continue
            with _reported(self._remote(rel), "--out"):
                self.fs.put_file(str(path), self._remote(rel))
            self._sent[rel] = stamp
        if barrier is not None:
            barrier()
        if process_index != 0:
            return
        folder = self.local / "checkpoints"
        local = {int(p.name) for p in folder.iterdir() if p.name.isdigit()} if (
            folder.is_dir()) else set()
        if self._marks is None:
            self._marks = set(self.remote_steps())
        with _reported(self.url, "--out"):
            for step in sorted(local - self._marks):
                self.fs.pipe_file(self._remote(f"checkpoints/{step}/{UPLOADED}"), b"")
                self._marks.add(step)
            for step in sorted(self._marks - local):  # pruned by checkpoint.keep
                self.fs.rm(self._remote(f"checkpoints/{step}"), recursive=True)
                self._marks.discard(step)
