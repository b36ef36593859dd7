"""Run folders in a bucket: ``jaxpar train --out gs://bucket/runs/7b``.

A run folder holds checkpoints (large, written by every process) and a few small files
written by process 0 (``config.yaml``, ``metrics.jsonl``, TensorBoard events). How each
reaches the bucket depends on the scheme:

* ``gs://`` (:data:`~jaxpar.storage.remote.DIRECT_SCHEMES`): orbax writes checkpoints
  straight to ``URL/checkpoints`` through TensorStore, each process its own shards, as on a
  shared disk; a step is complete once orbax has written its ``commit_success.txt``. The
  small files are written in a scratch folder of this process (under ``$JAXPAR_CACHE_DIR``)
  and uploaded after each checkpoint and at the end; the scratch folder is removed when the
  run ends, so the machine keeps nothing of the run.
* ``s3://``: orbax 0.12 cannot address S3 through TensorStore, so the whole run folder is
  worked on in a local copy and uploaded after each checkpoint, each process sending the
  files of its own ``ocdbt.process_N`` folders. A step counts as uploaded once its marker
  :data:`UPLOADED` is written, after every file of every process: a step interrupted
  half-way through its upload is never restored from.

``--resume`` first downloads the small files (and, for ``s3://``, the uploaded steps).
One run writes a folder at a time: :class:`BucketLock` is the bucket's counterpart of
:class:`~jaxpar.storage.folders.FolderLock`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.storage.remote import (
    DIRECT_SCHEMES,
    cache_root,
    check_bucket,
    filesystem,
    reported,
    url_scheme,
)

UPLOADED = ".jaxpar-uploaded"
"""The file that marks an ``s3://`` checkpoint step whose every file is in the bucket."""
COMMITTED = "commit_success.txt"
"""The file orbax writes last into a checkpoint step in a ``gs://`` bucket."""
LOCK_STALE_ENV = "JAXPAR_BUCKET_LOCK_STALE_S"
"""Seconds after its last heartbeat a bucket lock counts as abandoned (default 300)."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_STEP = re.compile(r"^checkpoints/(\d+)/")
_PROCESS = re.compile(r"(?:^|/)ocdbt\.process_(\d+)(?:/|$)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunMirror:
    """A run folder in a bucket, and the local folder the run writes its files in.

    Args:
      url: the run folder (``gs://bucket/runs/name``).
      skip: names of files never uploaded (the run's lock).
    """

    def __init__(self, url: str, *, skip: tuple[str, ...] = ()):
        self.url = url.rstrip("/")
        self.direct = url_scheme(self.url) in DIRECT_SCHEMES
        _, rest = _URL.match(self.url).groups()
        scheme = url_scheme(url)
        self.local = (cache_root() / "scratch" / str(os.getpid()) / scheme / rest
                      if self.direct else cache_root() / "runs" / scheme / rest)
        self.skip = skip
        self._sent: dict[str, tuple[int, int]] = {}
        self._marks: set[int] | None = None  # s3: steps marked uploaded in the bucket

    @functools.cached_property
    def fs(self) -> Any:
        """The bucket's fsspec file system, started on first use (:meth:`check` probes the
        endpoint first: a client that cannot reach it waits on timeouts)."""
        return filesystem(self.url, "--out")

    @property
    def checkpoints(self) -> str | Path:
        """Where the run's checkpoints are written: the bucket itself (``gs://``) or the
        local copy."""
        return f"{self.url}/checkpoints" if self.direct else self.local / "checkpoints"

    def _remote(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def remote_steps(self) -> list[int]:
        """The complete checkpoint steps in the bucket, ascending."""
        marker = COMMITTED if self.direct else UPLOADED
        with reported(self.url, "--out"):
            markers = self.fs.glob(f"{self.url}/checkpoints/*/{marker}")
        return sorted(int(m.rstrip("/").split("/")[-2]) for m in markers
                      if m.rstrip("/").split("/")[-2].isdigit())

    def check(self) -> None:
        """Fail in one line when the bucket cannot be used (no endpoint, no bucket, no
        credentials, an object where the folder should be), before any work."""
        check_bucket(self.url, "--out")
        with reported(self.url, "--out"):
            if self.fs.exists(self.url):  # an existing run folder must be listable too
                self.fs.ls(self.url)

    def fetch(self, rel: str) -> Path | None:
        """Download one file of the run folder (``config.yaml``) into the local folder;
        None when the bucket does not have it."""
        with reported(self.url, "--out"):
            if not self.fs.exists(self._remote(rel)):
                return None
            target = self.local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(self._remote(rel), str(target))
        return target

    def pull(self) -> list[int]:
        """Download the bucket's run folder into the local folder (``gs://``: all but the
        checkpoints; ``s3://``: files already there with the same size are kept, steps not
        wholly uploaded are left out); returns the complete steps."""
        steps = set(self.remote_steps())
        with reported(self.url, "--out"):
            listing = self.fs.find(self.url, detail=True) if self.fs.exists(self.url) else {}
        prefix = self.url.split("://", 1)[1].rstrip("/") + "/"
        for key, info in listing.items():
            rel = key.split("://", 1)[-1][len(prefix):]
            step = _STEP.match(rel)
            if rel.endswith(UPLOADED) or Path(rel).name in self.skip or (
                    step and (self.direct or int(step.group(1)) not in steps)):
                continue
            target = self.local / rel
            if not (target.is_file() and target.stat().st_size == info.get("size")):
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(f".{target.name}.{os.getpid()}.part")
                with reported(key, "--out"):
                    self.fs.get_file(self._remote(rel), str(part))
                os.replace(part, target)  # processes sharing a mirror never see half a file
            stat = target.stat()
            self._sent[rel] = (stat.st_size, stat.st_mtime_ns)  # in the bucket already
        self._marks = steps
        return sorted(steps)

    def push(self, process_index: int = 0, barrier: Callable[[], None] | None = None) -> None:
        """Upload what changed in the local folder since the last push. ``s3://``: each
        process sends the files of its own ``ocdbt.process_N`` folders; process 0 sends the
        rest, then, after ``barrier`` (every process's files sent), the markers of complete
        steps. ``gs://``: process 0 sends the small files (the checkpoints are there)."""
        if self.direct and process_index != 0:
            return
        if self.local.is_dir():
            for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
                self._send(path, process_index)
        if self.direct:
            return
        if barrier is not None:
            barrier()
        if process_index == 0:
            self._mark_steps()

    def _send(self, path: Path, process_index: int) -> None:
        rel = path.relative_to(self.local).as_posix()
        if path.name in self.skip or path.name.endswith(".part") or (
                "orbax-checkpoint-tmp" in rel):
            return
        owner = _PROCESS.search(rel)
        if (int(owner.group(1)) if owner else 0) != process_index:
            return
        stat = path.stat()
        stamp = (stat.st_size, stat.st_mtime_ns)
        if self._sent.get(rel) == stamp:
            return
        with reported(self._remote(rel), "--out"):
            self.fs.put_file(str(path), self._remote(rel))
        self._sent[rel] = stamp

    def _mark_steps(self) -> None:
        folder = self.local / "checkpoints"
        local = {int(p.name) for p in folder.iterdir() if p.name.isdigit()} if (
            folder.is_dir()) else set()
        if self._marks is None:
            self._marks = set(self.remote_steps())
        with reported(self.url, "--out"):
            for step in sorted(local - self._marks):
                self.fs.pipe_file(self._remote(f"checkpoints/{step}/{UPLOADED}"), b"")
                self._marks.add(step)
            for step in sorted(self._marks - local):  # pruned by checkpoint.keep
                self.fs.rm(self._remote(f"checkpoints/{step}"), recursive=True)
                self._marks.discard(step)

    def discard(self) -> None:
        """Remove this process's scratch folder (``gs://``; the bucket has everything),
        and those left by processes of this host that no longer run."""
        if not self.direct:
            return
        shutil.rmtree(cache_root() / "scratch" / str(os.getpid()), ignore_errors=True)
        scratch = cache_root() / "scratch"
        for other in scratch.iterdir() if scratch.is_dir() else ():
            if other.name.isdigit() and not _alive(int(other.name)):
                shutil.rmtree(other, ignore_errors=True)


class BucketLock:
    """One writer per run folder in a bucket: an object holding the writer's host, pid,
    command, start time and a heartbeat refreshed every :attr:`HEARTBEAT_S` while it runs.

    A second writer gets one line naming the holder. A lock whose holder no longer runs is
    taken over with a notice: on this host, when its pid is gone; anywhere, once its
    heartbeat is older than ``$JAXPAR_BUCKET_LOCK_STALE_S`` (default 300 s), as after a
    preempted or lost host. Same interface as :class:`~jaxpar.storage.folders.FolderLock`.

    Args:
      url: the lock object (``gs://bucket/run/.jaxpar.lock``).
      what: the command taking it.
      say: where the takeover notice goes.
    """

    HEARTBEAT_S = 60.0

    def __init__(self, url: str, what: str, say: Callable[[str], None] | None = None):
        self.url, self.what = url, what
        self.say = say or (lambda text: None)
        self.fs = filesystem(url, "--out")
        self.held = False
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @staticmethod
    def stale_after_s() -> float:
        """Seconds without a heartbeat after which a lock is abandoned."""
        return float(os.environ.get(LOCK_STALE_ENV) or 300)

    def _holder(self) -> dict[str, Any]:
        with reported(self.url, "--out"):
            if not self.fs.exists(self.url):
                return {}
            try:
                return json.loads(self.fs.cat_file(self.url))
            except (FileNotFoundError, ValueError):
                return {}

    def _abandoned(self, holder: dict[str, Any]) -> bool:
        pid, host = holder.get("pid"), holder.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            return True
        return time.time() - float(holder.get("beat", 0)) > self.stale_after_s()

    def _in_use(self, holder: dict[str, Any]) -> JaxparError:
        folder = self.url.rsplit("/", 1)[0]
        return JaxparError(
            f"{folder} is in use by {holder.get('command', 'jaxpar')} (pid "
            f"{holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}): "
            f"one folder takes one writer; use another folder or wait for it to finish (if "
            f"that run is gone for good, delete {self.url}, or wait "
            f"{self.stale_after_s():.0f} s after its last heartbeat)")

    def check(self) -> None:
        """Refuse early, writing nothing, when a running writer holds the lock."""
        holder = self._holder()
        if holder and not self._abandoned(holder):
            raise self._in_use(holder)

    def _write(self, record: dict[str, Any]) -> None:
        with reported(self.url, "--out"):
            self.fs.pipe_file(self.url, json.dumps(record).encode())

    def acquire(self) -> BucketLock:
        """Take the lock (and start its heartbeat).

        Raises:
          JaxparError: when a running writer holds it.
        """
        holder = self._holder()
        if holder:
            if not self._abandoned(holder):
                raise self._in_use(holder)
            self.say(f"{self.url}: taking over the lock of {holder.get('command')} (pid "
                     f"{holder.get('pid')} on {holder.get('host')}, started "
                     f"{holder.get('started')}), which no longer runs")
        self._record = {"host": socket.gethostname(), "pid": os.getpid(),
                        "command": self.what, "token": self._token,
                        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "beat": time.time()}
        self._write(self._record)
        self.held = True
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                      name="jaxpar-bucket-lock")
        self._beat.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed beat only ages the lock
                self._write({**self._record, "beat": time.time()})

    def release(self) -> None:
        """Give the lock up (only if this writer still holds it)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None
        if self.held and self._holder().get("token") == self._token:
            with contextlib.suppress(Exception), reported(self.url, "--out"):
                self.fs.rm_file(self.url)
        self.held = False

    def __enter__(self) -> BucketLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["COMMITTED", "UPLOADED", "BucketLock", "RunMirror"]
