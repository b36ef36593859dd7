"""The largest buffers of a compiled step's device memory, as XLA lays them out.

``compiled.memory_analysis()`` gives totals only. XLA's buffer assignment also writes a
*memory-usage report* when it dumps a module (``--xla_dump_to``): the size its heap peaks
at, and the buffers of its program, largest first, each with the values that use it one
after another (``5×bf16[28,1,8192,3072]``: a layer loop's stacked saves). Buffers live at
different times share space, so they can add up to more than the peak.
Both XLA:CPU and the TPU compiler write it. It is how a planner figure that is off gets
explained: which tensors the compiler keeps that the model did not count.

:func:`enable_dump` must run before JAX starts its first backend (XLA reads its flags
once); :func:`peak_buffers` then reads the report of the step's module from the folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

STEP_MODULE = "_step_impl"
"""Part of the name XLA gives the training step's module (``jit__step_impl``)."""

_REPORT = "*after_optimizations-memory-usage-report.txt"
_TOTAL = re.compile(r"^Total bytes: (\d+)", re.M)
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = re.compile(r"^\s*([\d.]+)(B|KiB|MiB|GiB|TiB)$")


@dataclass(frozen=True)
class PeakBuffer:
    """One buffer of device memory: its ``bytes``, and the ``values`` (their shapes) that
    occupy it one after another."""

    bytes: int
    values: int
    shapes: str


def enable_dump(directory: str | Path, module: str = STEP_MODULE) -> None:
    """Have XLA dump the modules whose name holds ``module`` into ``directory``, memory
    report included. Call before JAX's first backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_dump_to={directory} "
                               f"--xla_dump_hlo_module_re=.*{re.escape(module)}.*").strip()


def _bytes(text: str) -> int | None:
    m = _SIZE.match(text)
    return int(float(m[1]) * _UNITS[m[2]]) if m else None


def read_report(text: str) -> tuple[int, list[PeakBuffer]]:
    """(heap peak bytes, buffers largest first) of the first memory space (``default``,
    the device's) of a memory-usage report's text; the report lists the largest buffers,
    and says how many smaller ones it leaves out."""
    total = _TOTAL.search(text)
    slots = []
    for line in text.split("\n\n", 1)[0].splitlines():
        parts = [p.strip() for p in line.split(";")]
        if len(parts) != 5:
            continue
        size = _bytes(parts[1])
        if size is None or not parts[3].isdigit():
            continue  # the header row
        slots.append(PeakBuffer(size, int(parts[3]), parts[4]))
    return (int(total[1]) if total else sum(s.bytes for s in slots)), slots


def peak_buffers(directory: str | Path, module: str = STEP_MODULE
                 ) -> tuple[int, list[PeakBuffer]] | None:
    """The memory-usage report of the dumped module named like ``module`` (the largest,
    when several are), read by :func:`read_report`; None when XLA wrote none."""
    reports = [p for p in Path(directory).glob(_REPORT) if module in p.name]
    if not reports:
        return None
    read = [read_report(p.read_text()) for p in reports]
    return max(read, key=lambda r: r[0])
