"""What the TPU compiler says a compiled program needs of a device's HBM, from its log.

``compiled.memory_analysis().temp_size_in_bytes`` is not what a TPU program needs. The
TPU compiler lays the program's temporaries out in one heap, whose size counts the gaps
between buffers (its *fragmentation*), and the analysis reports that heap plus the
fragmentation again: on a 4-layer 22B-wide step for ``tpu-v4:4x4x4``, a 7.75 GiB heap
with 1.28 GiB of gaps is reported as 9.03 GiB of temporaries. The compiler's own account,
which it logs for each program, is the *program requirement*: the heap, the scoped memory
its kernels reserve and its code overlays (7.81 GiB there). With the arguments, that is
what it checks against the HBM a program may use ("the total memory required for HLO
temporaries exceeds available HBM"), the chip's HBM less what the runtime reserves.

libtpu writes that account to its INFO log (``$TPU_LOG_DIR``, by default
``/tmp/tpu_logs``), one file a process; :func:`unbuffer_compiler_log` has it written as
it is logged (glog buffers INFO lines for up to 30 s), so that :func:`program_memory`
can read it right after the compile. It must run before libtpu starts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

LOG_FLAG = "--logbuflevel=-1"
"""libtpu's flag (glog's) that writes INFO lines to the log file unbuffered."""

_UNIT = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = r"([\d.]+)([KMGT]?)B?"
_MODULE = re.compile(r"XLA::TPU module name: (\S+)")
_USAGE = re.compile(rf"XLA::TPU program HBM usage: {_SIZE} / {_SIZE}")
_RESERVED = re.compile(rf"Total hbm usage >= {_SIZE}:\s*\n\s*reserved\s+{_SIZE}")
_PROGRAM = re.compile(rf"Program hbm requirement {_SIZE}:")
_HEAP = re.compile(rf"HLO temp\s+{_SIZE} \(.*? Padded \({_SIZE}\), [\d.]+% fragmentation "
                   rf"\({_SIZE}\)\)")


@dataclass(frozen=True)
class ProgramMemory:
    """A TPU program's HBM, per device, as the compiler accounts for it in its log.

    ``program_bytes``: the heap, the kernels' scoped memory and the code overlays, what
    the program needs beside its arguments; ``heap_bytes`` of them the temporaries' heap,
    ``fragmentation_bytes`` the heap's gaps; ``usable_bytes`` the HBM a program and its
    arguments may take (the chip's, less ``reserved_bytes``, the runtime's)."""

    program_bytes: int
    heap_bytes: int
    fragmentation_bytes: int
    reserved_bytes: int
    usable_bytes: int


def _bytes(value: str, unit: str) -> int:
    return int(float(value) * _UNIT[unit])


def unbuffer_compiler_log(env: dict[str, str] | None = None) -> None:
    """Have libtpu write its INFO log unbuffered (:data:`LOG_FLAG` added to
    ``LIBTPU_INIT_ARGS``, unless a ``logbuflevel`` is set there). Call before libtpu
    starts (before the first TPU topology or backend)."""
    env = os.environ if env is None else env
    args = env.get("LIBTPU_INIT_ARGS", "")
    if "logbuflevel" not in args:
        env["LIBTPU_INIT_ARGS"] = f"{args} {LOG_FLAG}".strip()


def log_file(pid: int | None = None, log_dir: str | Path | None = None) -> Path | None:
    """This process's (or ``pid``'s) libtpu INFO log, the newest if several; None when
    libtpu wrote none there."""
    folder = Path(log_dir or os.environ.get("TPU_LOG_DIR") or "/tmp/tpu_logs")
    pid = os.getpid() if pid is None else pid
    try:
        found = [p for p in folder.glob(f"*INFO*.{pid}") if p.is_file()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def read_program_memory(text: str, module: str) -> ProgramMemory | None:
    """The account of the last program compiled from a module whose name holds
    ``module`` in a libtpu log's ``text``; None when the log holds none."""
    starts = [m for m in _MODULE.finditer(text) if module in m[1]]
    if not starts:
        return None
    start = starts[-1].end()
    following = _MODULE.search(text, start)
    block = text[start:following.start() if following else len(text)]
    usage, reserved = _USAGE.search(block), _RESERVED.search(block)
    program, heap = _PROGRAM.search(block), None
    if program:
        heap = _HEAP.search(block, program.end())
    if not (usage and reserved and program and heap):
        return None
    return ProgramMemory(
        program_bytes=_bytes(program[1], program[2]),
        heap_bytes=_bytes(heap[1], heap[2]),
        fragmentation_bytes=_bytes(heap[5], heap[6]),
        reserved_bytes=_bytes(reserved[3], reserved[4]),
        usable_bytes=_bytes(usage[3], usage[4]))


def log_mark(pid: int | None = None, log_dir: str | Path | None = None
             ) -> tuple[Path | None, int]:
    """Where this process's log ends now (its path and size): pass it to
    :func:`program_memory` as ``since`` to read only what a compile adds."""
    path = log_file(pid, log_dir)
    try:
        return path, (path.stat().st_size if path else 0)
    except OSError:
        return None, 0


def program_memory(module: str, pid: int | None = None, log_dir: str | Path | None = None,
                   since: tuple[Path | None, int] | None = None) -> ProgramMemory | None:
    """The TPU compiler's account of the program it last compiled from ``module`` in this
    process (:func:`read_program_memory` of :func:`log_file`), in what the log gained
    after ``since`` (a :func:`log_mark`: an executable loaded from JAX's compilation
    cache logs nothing, and an earlier program's account must not stand in for it);
    None when its log is not there or does not hold it (libtpu started without
    :func:`unbuffer_compiler_log`, or its log sent elsewhere)."""
    path = log_file(pid, log_dir)
    if path is None:
        return None
    start = since[1] if since is not None and since[0] == path else 0
    try:
        with path.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return read_program_memory(text, module)


__all__ = ["LOG_FLAG", "ProgramMemory", "log_file", "log_mark", "program_memory",
           "read_program_memory", "unbuffer_compiler_log"]
