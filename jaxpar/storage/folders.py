"""Output folders that survive faults: one writer at a time, and folders replaced whole.

* :class:`FolderLock`: a lock file holding the writer's host, pid, command and start time,
  created exclusively. A second writer gets one line naming the holder; a lock left by a
  process that no longer runs on this host is taken over with a notice. ``jaxpar train``
  locks its run folder, ``convert`` its run folder and ``export`` its target.
* :func:`staged_folder`: write a folder's new contents into a hidden sibling, then swap it
  in with one ``renameat2(RENAME_EXCHANGE)`` (Linux), so a kill at any moment leaves the
  old folder or the new one, never a mix (elsewhere: two renames, and a folder left aside
  is restored by the next write). Files of the old folder the new contents do not replace
  (a README, a tokenizer copied earlier) are carried over; weight files of the old
  contents are not.
* :func:`write_fault`, :func:`free_bytes`: name a write the file system refused (full
  disk, read-only) so the caller can say so in one line, with the free space.
* :func:`check_new_output`, :func:`write_file`, :func:`refused_write`: an output named on
  the command line (``--dump-hlo``, ``--save``) is checked before the work (an existing one
  needs ``--force``), written whole or not at all, and a refused write is one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from jaxpar.errors import JaxparError

LOCK_NAME = ".jaxpar.lock"
"""The lock file inside a run folder."""

STALE_WEIGHTS = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?|adapter_model\.safetensors)$")
"""Weight files of an earlier export, never carried into the new one."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it runs
        return True
    return True


class FolderLock:
    """An exclusive lock file (see the module docstring); a context manager.

    Args:
      path: the lock file (``run/.jaxpar.lock``, or a sibling of an export target).
      what: the command taking it, recorded for the message a second writer gets.
      say: where the stale-lock notice goes.
    """

    def __init__(self, path: str | Path, what: str, say=None):
        self.path = Path(path)
        self.what = what
        self.say = say or (lambda text: print(f"jaxpar: {text}", file=sys.stderr))
        self.held = False
        self._created: list[Path] = []

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def check(self) -> None:
        """Refuse early, creating nothing, when a running process holds the lock.

        Raises:
          JaxparError: as :meth:`acquire` would.
        """
        holder = self._holder()
        pid, host = holder.get("pid"), holder.get("host")
        if not holder or (host == socket.gethostname() and isinstance(pid, int)
                          and not _alive(pid)):
            return  # free, being written, or stale: acquire() decides
        raise self._in_use(holder)

    def _in_use(self, holder: dict) -> JaxparError:
        return JaxparError(
            f"{self.path.parent} is in use by {holder.get('command', 'jaxpar')} "
            f"(pid {holder.get('pid')} on {holder.get('host')}, started "
            f"{holder.get('started')}): one folder takes one writer; use another folder or "
            f"wait for it to finish (if that process is gone for good, delete {self.path})")

    def acquire(self) -> FolderLock:
        """Take the lock.

        Raises:
          JaxparError: when a running process holds it (or one on another host).
        """
        self._created = [p for p in (self.path.parent, *self.path.parent.parents)
                         if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "command": self.what,
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                pid, host = holder.get("pid"), holder.get("host")
                if (host == record["host"] and isinstance(pid, int) and not _alive(pid)
                        and holder):
                    self.say(f"{self.path.parent}: taking over the lock of {holder.get('command')} "
                             f"(pid {pid}, started {holder.get('started')}), which no longer "
                             f"runs")
                    with contextlib.suppress(FileNotFoundError):
                        self.path.unlink()
                    continue
                if not holder:  # being written right now, or unreadable: look again
                    time.sleep(0.05)
                    holder = self._holder()
                    if not holder:
                        continue
                raise self._in_use(holder) from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record) + "\n")
            self.held = True
            return self
        raise JaxparError(f"could not take the lock {self.path}: it keeps changing")

    def release(self) -> None:
        """Give the lock up (only if this process holds it)."""
        if self.held and self._holder().get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            for folder in self._created:  # made for the lock and left empty
                with contextlib.suppress(OSError):
                    folder.rmdir()
        self.held = False

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def export_lock(target: str | Path, what: str) -> FolderLock:
    """The lock of an export target: a sibling file, since the folder itself is swapped."""
    target = Path(target)
    return FolderLock(target.parent / f".{target.name}.jaxpar.lock", what)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    res = renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)),
                    _RENAME_EXCHANGE)
    return res == 0


def _siblings(target: Path, kind: str) -> list[Path]:
    return list(target.parent.glob(f".{target.name}.jaxpar-{kind}-*"))


@contextlib.contextmanager
def staged_folder(target: str | Path, *, write: bool = True) -> Iterator[Path]:
    """Yield a fresh hidden sibling of ``target`` to write into; on success, carry over the
    old folder's other files and swap the new one in whole (see the module docstring). On
    an exception the staging folder is removed and ``target`` is left as it was. With
    ``write`` false (a process that does not write), yields ``target`` and does nothing."""
    target = Path(target)
    if not write:
        yield target
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    for leftover in _siblings(target, "staging"):  # from a write killed midway
        shutil.rmtree(leftover, ignore_errors=True)
    for aside in _siblings(target, "old"):  # killed between two renames: restore
        if not target.exists():
            os.rename(aside, target)
        else:
            shutil.rmtree(aside, ignore_errors=True)
    staging = target.parent / f".{target.name}.jaxpar-staging-{os.getpid()}"
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if target.is_dir():
        for old in target.iterdir():
            if (old.name == LOCK_NAME or STALE_WEIGHTS.match(old.name)
                    or (staging / old.name).exists()):
                continue
            if old.is_dir():
                shutil.copytree(old, staging / old.name, symlinks=True)
            else:
                shutil.copy2(old, staging / old.name)
        if _exchange(staging, target):
            shutil.rmtree(staging, ignore_errors=True)  # now holds the old contents
            return
        aside = target.parent / f".{target.name}.jaxpar-old-{os.getpid()}"
        os.rename(target, aside)
        os.rename(staging, target)
        shutil.rmtree(aside, ignore_errors=True)
        return
    os.rename(staging, target)


# --- writes that fail ----------------------------------------------------------------------
_WRITE_FAULTS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "permission denied"}
_FAULT_TEXT = re.compile(r"No space left on device|os_error_code='28'|Disk quota exceeded|"
                         r"Read-only file system|Permission denied")


def free_bytes(path: str | Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def human_bytes(n: float) -> str:
    """``n`` bytes as a short figure (``1.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def write_fault(err: BaseException) -> str | None:
    """What went wrong when ``err`` (or an exception it was raised from) is the file system
    refusing a write (full disk, quota, read-only, permissions); None for anything else.
    Reads the messages too: tensorstore and safetensors report ``ENOSPC`` as text."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _WRITE_FAULTS:
            return _WRITE_FAULTS[err.errno]
        found = _FAULT_TEXT.search(str(err))
        if found:
            text = found.group(0)
            return "no space left on device" if "28" in text else text.lower()
        err = err.__cause__ or err.__context__
    return None


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def refuse_url(path: str | Path, what: str) -> None:
    """Refuse, in one line naming ``what``, a URL (``gs://``, ``s3://``...) where a local
    path is needed: read as a path it would become a local folder named ``gs:``."""
    found = _URL.match(str(path))
    if found:
        raise JaxparError(f"{what} {str(path)!r}: {found.group(1)}:// storage is not "
                          "supported; give a local path or a mounted bucket (gcsfuse, "
                          "s3fs, mountpoint-s3)")


def check_writable(path: str | Path, what: str, *, file: bool = False) -> None:
    """Refuse, in one line naming ``what``, an output path that cannot be written: a file
    expected where a folder stands (``file``), or no write permission on the nearest
    existing folder. Checked before any work, so nothing is computed for nothing.

    Raises:
      JaxparError: naming ``what`` and the path.
    """
    refuse_url(path, what)
    path = Path(path)
    if file and path.is_dir():
        raise JaxparError(f"{what} {str(path)!r} is a folder; name a file")
    parent = path if path.is_dir() else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise JaxparError(f"{what} {str(path)!r}: {str(parent)!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise JaxparError(f"{what} {str(path)!r}: cannot write in {str(parent)!r} "
                          "(permission denied or a read-only file system)")


# --- output files and folders named on the command line -----------------------------------
def check_new_output(path: str | Path, what: str, *, force: bool, folder: bool = False) -> None:
    """Refuse, in one line naming ``what``, an output that cannot be written where asked,
    before any work: a URL, a folder where a file is named (or a file where a folder is),
    a parent folder that does not exist, or an existing file (a non-empty folder with
    ``folder``) without ``force``: a user's file is never replaced unasked.

    Raises:
      JaxparError: naming ``what``, the path and the fix.
    """
    refuse_url(path, what)
    path = Path(path)
    if not folder and path.is_dir():
        raise JaxparError(f"{what} {str(path)!r} is a folder; name a file")
    if folder and path.exists() and not path.is_dir():
        raise JaxparError(f"{what} {str(path)!r} is a file; name a folder")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise JaxparError(f"{what} {str(path)!r}: folder {str(path.parent)!r} does not exist; "
                          "create it first")
    taken = path.is_dir() and any(path.iterdir()) if folder else path.is_file()
    if taken and not force:
        raise JaxparError(f"{what} {str(path)!r} exists{' and is not empty' * folder}; pass "
                          "--force to replace it, or name another")
    check_writable(path, what, file=not folder)


def _write_all(file, data: bytes) -> None:
    """Write ``data`` to the open ``file`` and make it durable (the one place tests make a
    disk full)."""
    file.write(data)
    file.flush()
    os.fsync(file.fileno())


def write_file(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` whole or not at all: into a hidden sibling first, renamed
    over ``path`` once complete (a full disk leaves the earlier file, not half a new one).
    A path that is not a regular file (``/dev/null``, a pipe) is written as it is.

    Raises:
      OSError: the file system's refusal, after the partial sibling is removed.
    """
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    if path.exists() and not path.is_file():  # /dev/null, /dev/stdout, a pipe: as it is
        with open(path, "wb") as file:
            file.write(data)
        return
    temp = path.parent / f".{path.name}.jaxpar-tmp-{os.getpid()}"
    try:
        with open(temp, "wb") as file:
            _write_all(file, data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


@contextlib.contextmanager
def refused_write(path: str | Path, what: str) -> Iterator[None]:
    """Turn a write to ``path`` that the file system refuses (full disk, read-only,
    permissions) into one line naming ``what``, the reason and the free space, saying that
    an earlier ``path`` is left as it was (the writes inside are whole-or-nothing:
    :func:`write_file`, :func:`staged_folder`)."""
    path = Path(path)
    existed = path.exists()
    try:
        yield
    except OSError as err:
        reason = write_fault(err) or err.strerror or str(err)
        kept = f"{str(path)!r} is left as it was" if existed else "nothing was written"
        raise JaxparError(f"{what} {str(path)!r}: could not write: {reason} "
                          f"({human_bytes(free_bytes(path))} free there); {kept}") from None
