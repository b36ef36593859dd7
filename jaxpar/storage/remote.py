"""Object storage: paths such as ``gs://bucket/corpus/*.bin`` or ``s3://bucket/runs/7b``.

A URL is opened through fsspec (``gcsfs`` for ``gs://``, ``s3fs`` for ``s3://``, both in
``jaxpar[cloud]``); credentials and endpoints come from the usual places
(``GOOGLE_APPLICATION_CREDENTIALS`` or the machine's service account, ``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``...). ``STORAGE_EMULATOR_HOST`` (a local GCS server) is passed on to
TensorStore too, which writes checkpoints. Any other scheme is refused in one line.

What lives here:

* :func:`filesystem`, :func:`remote_files`, :func:`read_object`: listing and reading a
  bucket, every failure one line (:func:`storage_error`); :func:`check_bucket` fails fast
  on a bucket that does not exist or an endpoint that does not answer.
* :class:`RemoteTokens`: a token shard in a bucket, read by byte ranges (blocks of
  :data:`BLOCK_BYTES`, the last few kept), sliced like the memory map of a local shard.
* :func:`output_folder`: an output (an export, a plan, tokenized shards) written to a
  local folder, then uploaded whole to its URL.

Run folders in a bucket are :mod:`jaxpar.storage.run_mirror`'s.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from jaxpar.errors import JaxparError

SCHEMES: dict[str, str] = {"gs": "gcsfs", "s3": "s3fs"}
"""The URL schemes jaxpar reads and writes, and the fsspec package each needs."""
DIRECT_SCHEMES = ("gs",)
"""Schemes orbax (through TensorStore) writes checkpoints to directly, every process its
own shards; a run folder on another scheme is worked on through a local copy."""
BLOCK_BYTES = 1 << 22
"""Bytes a remote shard reads at once (4 MiB); :attr:`RemoteTokens.KEEP` blocks are kept."""
CACHE_ENV = "JAXPAR_CACHE_DIR"
PROBE_TIMEOUT_S = 10.0
"""How long :func:`check_bucket` waits for the storage endpoint to answer a connection."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")



def configure_clients() -> None:
    """Settings the storage clients read from the environment, made before they start:
    gcsfs's experimental bucket-type probe (it asks a storage-control API, with default
    credentials, about every bucket, and warns when it cannot: always, against an
    emulator) is turned off unless asked for, and TensorStore, which writes checkpoints,
    is pointed at the GCS emulator ``STORAGE_EMULATOR_HOST`` names."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:  # an emulator asks for no credentials: look for none
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = (emulator if "://" in emulator
                                                  else f"http://{emulator}")
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
        import fsspec.config

        for protocol in ("gs", "gcs"):
            fsspec.config.conf.setdefault(protocol, {}).setdefault("token", "anon")


configure_clients()


def url_scheme(path: str | Path) -> str | None:
    """The scheme of a URL (``s3`` of ``s3://b/k``); None for a local path."""
    found = _URL.match(str(path))
    return found.group(1).lower() if found else None


def is_remote(path: str | Path | None) -> bool:
    """Whether ``path`` is a URL in object storage jaxpar supports (see :data:`SCHEMES`)."""
    return path is not None and url_scheme(path) in SCHEMES


def bucket_of(url: str) -> str:
    """The bucket of a URL (``b`` of ``gs://b/runs/x``)."""
    return str(url).split("://", 1)[1].split("/", 1)[0]


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
    configure_clients()
    scheme = url_scheme(url)
    try:
        fs = _client_class(url, what)(**_options(scheme))
    except ImportError:
        raise _missing_package(url, what) from None
    if scheme == "s3":  # s3fs retries a timed-out request 5 times on top of botocore's
        fs.retries = 1
    return fs


def _client_class(url: str, what: str) -> type:
    """The fsspec file system class of ``url``'s scheme, its package imported (no client
    started)."""
    import fsspec  # imported on use: local runs never need it

    try:
        return fsspec.get_filesystem_class(url_scheme(url))
    except ImportError:
        raise _missing_package(url, what) from None


def _missing_package(url: str, what: str) -> JaxparError:
    scheme = url_scheme(url)
    return JaxparError(f"{what} {url!r}: {scheme}:// needs the {SCHEMES[scheme]} package "
                       f"(pip install {SCHEMES[scheme]})")


REQUEST_TIMEOUT_S = 15.0
"""How long one request to a bucket may wait for an answer; with :data:`ATTEMPTS` tries,
an endpoint that accepts connections and never answers fails within a minute."""
ATTEMPTS = 2


def _options(scheme: str | None) -> dict[str, Any]:
    """fsspec options: a request that gets no answer fails after a bounded wait (the
    clients' own defaults retry for minutes); listings are not cached (other processes and
    hosts write the same folders: a cached listing would hide their checkpoints); against
    a GCS emulator no credentials are looked for."""
    if scheme == "gs":
        options: dict[str, Any] = {"requests_timeout": REQUEST_TIMEOUT_S,
                                   "retries": ATTEMPTS, "use_listings_cache": False}
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            options["token"] = "anon"
        return options
    if scheme == "s3":
        return {"use_listings_cache": False,
                "config_kwargs": {"connect_timeout": PROBE_TIMEOUT_S,
                                  "read_timeout": REQUEST_TIMEOUT_S,
                                  "retries": {"max_attempts": ATTEMPTS, "mode": "standard"}}}
    return {}


def endpoint(url: str) -> tuple[str, int] | None:
    """The host and port the requests for ``url`` go to: an emulator's or a custom
    endpoint's, Google's for ``gs://``; None for S3's own (its host depends on the
    region)."""
    scheme = url_scheme(url)
    given = (os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
             if scheme == "gs"
             else os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    if not given:
        return None
    parsed = urlparse(given if "://" in given else f"http://{given}")
    return parsed.hostname or "localhost", parsed.port or (443 if parsed.scheme == "https"
                                                           else 80)


_ANSWERED: set[tuple[str, int]] = set()


def probe_endpoint(url: str, what: str) -> None:
    """Fail in one line, within :data:`PROBE_TIMEOUT_S`, when the storage endpoint of
    ``url`` cannot be reached (no network, a name that does not resolve, an emulator that
    is not running): the storage clients would retry for minutes.

    Raises:
      JaxparError: naming ``what``, the URL and the endpoint.
    """
    where = endpoint(url)
    if where is None or where in _ANSWERED:
        return
    try:
        socket.create_connection(where, timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise JaxparError(f"{what} {url!r}: the storage endpoint {where[0]}:{where[1]} "
                          f"does not answer ({exc.strerror or exc})") from None
    _ANSWERED.add(where)


def check_bucket(url: str, what: str) -> None:
    """Fail in one line, within :data:`PROBE_TIMEOUT_S` or so, when the endpoint does not
    answer or ``url``'s bucket does not exist or cannot be listed (no credentials, access
    denied): before any work.

    Raises:
      JaxparError: naming ``what`` and the URL.
    """
    check_url(url, what)
    _client_class(url, what)  # a missing package is named first, as filesystem() names it
    # The endpoint before the client: gcsfs looks for credentials as it starts, which on a
    # host without any (no GCE metadata server) takes 16 s of timeouts.
    probe_endpoint(url, what)
    fs = filesystem(url, what)
    bucket = bucket_of(url)
    with reported(url, what):
        try:  # not exists(): it answers False for no credentials or a refused request
            fs.ls(f"{url_scheme(url)}://{bucket}", detail=False)
        except FileNotFoundError:
            raise JaxparError(f"{what} {url!r}: bucket {bucket!r} does not exist") from None
        if fs.isfile(url):
            raise JaxparError(f"{what} {url!r} is an object, not a folder")


def storage_error(exc: BaseException, url: str, what: str) -> JaxparError:
    """One line for a failed bucket operation: a missing bucket or object, no credentials,
    an unreachable endpoint."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, TimeoutError) or "timeout" in f"{type(exc).__name__} {text}".lower():
        text = (f"the storage endpoint did not answer within {REQUEST_TIMEOUT_S:.0f} s, "
                f"{ATTEMPTS} tries ({text})")
    elif "credentials" in text.lower() and "access denied" not in text.lower():
        text = (f"no credentials ({text}): give the machine a service account or role, or "
                "set GOOGLE_APPLICATION_CREDENTIALS / AWS_ACCESS_KEY_ID")
    elif isinstance(exc, FileNotFoundError):
        text = "no such bucket or object" if not text or "does not exist" in text else text
    elif isinstance(exc, PermissionError):
        text = f"access denied ({text})"
    return JaxparError(f"{what} {url!r}: {text}")


@contextlib.contextmanager
def reported(url: str, what: str) -> Iterator[None]:
    """Turn any failure of the bucket operations inside into :func:`storage_error`'s line."""
    try:
        yield
    except JaxparError:
        raise
    except Exception as exc:  # botocore/aiohttp errors have no common base: name them
        raise storage_error(exc, url, what) from None


def read_object(url: str, what: str) -> bytes:
    """A whole object of a bucket (one line naming ``what`` on failure)."""
    fs = filesystem(url, what)
    with reported(url, what):
        return fs.cat_file(url)


def remote_files(spec: str, suffixes: tuple[str, ...], what: str) -> list[str]:
    """The objects ``spec`` names, sorted URLs: a glob's matches, the files under a folder
    (those ending in ``suffixes``), or one object.

    Raises:
      JaxparError: in one line, when nothing matches or the bucket cannot be read.
    """
    fs = filesystem(spec, what)
    probe_endpoint(spec, what)
    scheme = url_scheme(spec)
    with reported(spec, what):
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
        with reported(url, "shard"):
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
        with reported(url, "shard"), fs.open(url, "rb") as f:
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
        with reported(self.filename, "shard"):
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
    """Where jaxpar keeps local copies: ``$JAXPAR_CACHE_DIR`` or ``~/.cache/jaxpar``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxpar")


@contextlib.contextmanager
def output_folder(target: str | Path, what: str, *, write: bool = True,
                  replace: re.Pattern[str] | None = None) -> Iterator[Path]:
    """A local folder to write an output into. For a local ``target``, the target itself;
    for a URL, a temporary folder whose files are uploaded to ``target`` (replacing the
    objects of the same names) once the block succeeds, then removed; objects already
    there whose names match ``replace`` and that the upload did not overwrite (an earlier
    export's weight shards) are deleted after. Nothing is uploaded when the block fails,
    or when ``write`` is false (a process that does not write).

    Raises:
      JaxparError: naming ``what``, when the bucket cannot be written.
    """
    if not is_remote(target):
        yield Path(target)
        return
    url = str(target).rstrip("/")
    cache_root().mkdir(parents=True, exist_ok=True)
    local = Path(tempfile.mkdtemp(prefix="upload-", dir=cache_root()))
    try:
        yield local
        if write:
            sent = set(upload_tree(local, url, what))
            if replace is not None:
                _remove_stale(url, sent, replace, what)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def upload_tree(local: Path, url: str, what: str) -> list[str]:
    """Upload every file under ``local`` to the same relative paths under ``url``;
    returns the URLs written."""
    fs = filesystem(url, what)
    sent = []
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        dest = f"{url}/{path.relative_to(local).as_posix()}"
        with reported(dest, what):
            fs.put_file(str(path), dest)
        sent.append(dest)
    return sent


def _remove_stale(url: str, sent: set[str], pattern: re.Pattern[str], what: str) -> None:
    fs = filesystem(url, what)
    scheme = url_scheme(url)
    with reported(url, what):
        found = fs.ls(url, detail=False) if fs.isdir(url) else []
        for key in found:
            key = key if url_scheme(key) else f"{scheme}://{key}"
            if pattern.match(key.rstrip("/").rsplit("/", 1)[-1]) and key not in sent:
                fs.rm_file(key)


@contextlib.contextmanager
def output_file(target: str | Path, what: str, *, existing: bool = False) -> Iterator[Path]:
    """A local path to write a file into. For a local ``target``, the target itself; for a
    URL, a path in a temporary folder (holding the object's current contents when
    ``existing`` and there is one) whose files are uploaded beside ``target``'s URL once
    the block succeeds (a file written next to it, ``NAME.measurements.json``, goes too).
    """
    if not is_remote(target):
        yield Path(target)
        return
    url = str(target)
    parent, name = url.rsplit("/", 1)
    with output_folder(parent, what) as local:
        path = local / name
        if existing:
            fs = filesystem(url, what)
            with reported(url, what):
                if fs.exists(url):
                    fs.get_file(url, str(path))
        yield path


def check_output_file(target: str, what: str, *, force: bool = True) -> None:
    """Refuse, in one line, a URL an output file cannot be written to: an unusable bucket,
    a folder there, or (without ``force``) an object that exists."""
    check_bucket(target.rsplit("/", 1)[0], what)
    fs = filesystem(target, what)
    with reported(target, what):
        if fs.isdir(target):
            raise JaxparError(f"{what} {target!r} is a folder; name a file")
        if not force and fs.exists(target):
            raise JaxparError(f"{what} {target!r} exists; pass --force to replace it")
