"""Goodput: where a run's wall time went, across every restart of its run folder.

A *session* is one :func:`jaxpar.runs.loop.train` call on a run folder: the first
``jaxpar train`` of a run, and each ``--resume`` after a preemption, a crash or a
``--max-steps`` stop. :class:`GoodputClock` cuts a session's wall time into parts that add
up to it (:data:`PARTS`):

* ``productive``: steps trained for the first time;
* ``startup``: from the session's start to its first step (starting Python and JAX,
  building the model, restoring the checkpoint), less compiling;
* ``compile``: tracing, lowering and compiling programs, or reading them from the
  compilation cache, wherever it happened (the first step, the first evaluation);
* ``checkpoint``: the loop held up by saves (uploads to a bucket included) and, at the end,
  the wait for the last save to be written;
* ``data_wait``: steps waiting for their batch;
* ``eval``: evaluating the held-out data (``train.eval_every``);
* ``recomputed``: steps trained again: an earlier session had reached them, but the
  checkpoint this one resumed from was older (their share of the steps' time);
* ``other``: the rest (closing the logs and the profile; the end of a failed session).

The loop marks the points where one kind of work gives way to another (its first step, each
fetch of the steps' metrics, after each save or evaluation, the start of the closing), and
the clock charges the time since the previous mark to one part; compiling, heard from JAX's
monitoring events, is taken out of whichever interval it fell in. Host work between
windows of steps (writing the logs) counts with the steps, as it does in ``step_time_s``.

A session starts when its process started for ``jaxpar train`` (Linux: read from
``/proc/self/stat`` and ``/proc/uptime``, so importing Python packages and starting JAX
count as startup), and when ``train()`` was called otherwise (from Python, or where
``/proc`` is missing). A session ends when ``train()`` returns or raises; the final upload
of a run folder in a bucket comes after it and is not counted.

``OUT/goodput.jsonl`` holds one record per session (see :meth:`GoodputClock.record`),
rewritten whole at the first step, at every save, every :data:`WRITE_EVERY_S` seconds in
between and at the end: a session killed outright leaves its last record, whose ``state``
stays ``running``. In a bucket the file travels with the run's other small files (uploaded
after each save and at the end). Each ``metrics.jsonl`` row that ends a window of steps
carries the figures of the whole run so far (:data:`ROW_KEYS`), and with them TensorBoard
and W&B (tags :data:`TAGS`). :func:`read_records` reads the records back for ``jaxpar
goodput``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.storage.folders import free_bytes, human_bytes, write_fault
from jaxpar.storage.remote import check_bucket, filesystem, is_remote, read_object, reported

RECORDS = "goodput.jsonl"
"""The file of session records in a run folder."""
PARTS = ("productive", "startup", "compile", "checkpoint", "data_wait", "eval",
         "recomputed", "other")
"""The parts of a session's wall time; all but the first are lost (badput)."""
LOST = PARTS[1:]
WRITE_EVERY_S = 30.0
"""Seconds between rewrites of a running session's record (saves always rewrite it)."""
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
"""JAX's monitoring events whose durations count as compiling (nested ones once: a trace
inside another, a cache read inside a backend compile)."""


def row_key(part: str) -> str:
    """The ``metrics.jsonl`` key of a part's run total: ``goodput_productive_s`` for the
    productive time, ``badput_<part>_s`` for the others."""
    return "goodput_productive_s" if part == "productive" else f"badput_{part}_s"


ROW_KEYS = ("goodput", "goodput_wall_s", *(row_key(p) for p in PARTS))
"""What a ``metrics.jsonl`` row says of the run so far (every session, this one up to the
row): the productive fraction of the wall time, the wall time, and each part in seconds."""
TAGS = {"goodput": "goodput/fraction", "goodput_wall_s": "goodput/wall_s",
        **{row_key(p): row_key(p).replace("_", "/", 1) for p in PARTS}}
"""Row key -> TensorBoard and W&B tag (``goodput/fraction``, ``badput/compile_s``...)."""

_from_process = False


def count_from_process_start() -> None:
    """Make the next session start when this process started (``jaxpar train``, whose
    process runs that one command); :func:`session_start` takes the mark."""
    global _from_process
    _from_process = True


def process_start_time() -> float | None:
    """When this process started, as Unix time (from ``/proc``; None where it is missing)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def session_start() -> tuple[float, str]:
    """The start of a session beginning now: ``(unix time, "process")`` after
    :func:`count_from_process_start` (which this takes back), else ``(now, "call")``."""
    global _from_process
    began = process_start_time() if _from_process else None
    _from_process = False
    return (began, "process") if began is not None else (time.time(), "call")


class _CompileTime:
    """The spans of time JAX reported compiling (:data:`COMPILE_EVENTS`), on the
    ``time.perf_counter`` clock, from any thread."""

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def heard(self, event: str, duration: float, **_: Any) -> None:
        if event in COMPILE_EVENTS:
            end = time.perf_counter()
            with self._lock:
                self._spans.append((end - duration, end))

    def within(self, begin: float, end: float) -> float:
        """Seconds of ``[begin, end]`` covered by a span (overlaps once); the spans over
        by ``end`` are forgotten."""
        with self._lock:
            spans = sorted(self._spans)
            self._spans = [s for s in spans if s[1] > end]
        total, reach = 0.0, begin
        for lo, hi in spans:
            lo, hi = max(lo, reach), min(hi, end)
            if hi > lo:
                total += hi - lo
                reach = hi
        return total


def _parse(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "wall_s" in record:
            out.append(record)
    return out


def last_logged_step(path: Path) -> int:
    """The step of the last row of a ``metrics.jsonl`` (0 without one); reads its tail."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (1 << 16)))
            tail = f.read()
    except OSError:
        return 0
    for line in reversed(tail.splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


class GoodputClock:
    """Accounts one session's wall time (see the module's description); a context
    manager around the session, the loop's marks in between.

    Args:
      out: the run folder (local: a bucket's run works in a local folder), or None to write
        nothing (the figures still join the metrics rows).
      started: the session's start, from :func:`session_start` (default: now).
      resume: whether the session continues the run in ``out``: its earlier records are
        kept and the steps they reached count as recomputed when trained again (without,
        the records start anew, like ``metrics.jsonl``).
      writer: whether this process writes the records (process 0).
    """

    def __init__(self, out: str | Path | None, started: tuple[float, str] | None = None, *,
                 resume: bool = False, writer: bool = True):
        self.out = Path(out) if out is not None else None
        when, self.counted_from = started or (time.time(), "call")
        perf, unix = time.perf_counter(), time.time()
        self.started = min(when, unix)
        self._last = perf - (unix - self.started)  # the start on the perf_counter clock
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.earlier: list[dict[str, Any]] = []
        self.reached = 0  # the highest step an earlier session reached
        if resume and self.out is not None:
            path = self.out / RECORDS
            self.earlier = _parse(path.read_text()) if path.is_file() else []
            self.reached = max([last_logged_step(self.out / "metrics.jsonl"),
                                *(int(r.get("step") or 0) for r in self.earlier)])
        self.session = max([0, *(int(r.get("session") or 0) for r in self.earlier)]) + 1
        self.first_step: int | None = None
        self.step: int | None = None
        self.recomputed_steps = 0
        self.state = "running"
        self._writer = writer
        self._written = -float("inf")
        self._closing = False
        self._compiles = _CompileTime()

    def __enter__(self) -> GoodputClock:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._compiles.heard)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 _tb: Any) -> None:
        """Charge the rest of the session, and write its final record."""
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._compiles.heard)
        self.parts[self._before_loop("checkpoint" if self._closing else "other")] += (
            self._interval()[0])
        self.state = ("ended" if kind is None else "stopped"
                      if issubclass(kind, KeyboardInterrupt) else f"failed ({kind.__name__})")
        try:
            self.write()
        except JaxparError:
            if kind is None:  # a failed session's own error says more
                raise

    def _interval(self) -> tuple[float, float]:
        """Seconds since the last mark less compiling (charged here), and the compiling."""
        now = time.perf_counter()
        took = max(0.0, now - self._last)
        compiling = min(took, self._compiles.within(self._last, now))
        self._last = now
        self.parts["compile"] += compiling
        return took - compiling, compiling

    # --- the loop's marks ------------------------------------------------------------
    def loop_started(self, step: int) -> None:
        """The first step is dispatched next, from ``step`` steps done: the time so far
        was startup."""
        self.parts["startup"] += self._interval()[0]
        self.first_step = self.step = step
        self.write()

    def steps(self, rows: Sequence[dict[str, Any]]) -> None:
        """The metrics of ``rows`` (a window of steps) were fetched: the time since the
        last mark went to these steps, waiting for their batches (``data_wait_s``) or
        working, productively or on steps an earlier session had reached."""
        work, _ = self._interval()
        if not rows:
            self.parts["other"] += work
            return
        waited = min(work, sum(float(r.get("data_wait_s") or 0.0) for r in rows))
        work -= waited
        again = sum(1 for r in rows if r["step"] <= self.reached)
        self.parts["data_wait"] += waited
        self.parts["recomputed"] += work * again / len(rows)
        self.parts["productive"] += work * (len(rows) - again) / len(rows)
        self.recomputed_steps += again
        self.step = max(self.step or 0, int(rows[-1]["step"]))

    def acted(self, row: dict[str, Any], saved: bool) -> None:
        """What was due after ``row``'s step is done: saves (and their uploads) and the
        evaluation (``row["eval_s"]``). Charge them, add the run's figures to ``row``, and
        rewrite the record after a save (``saved``) or when it is :data:`WRITE_EVERY_S`
        old."""
        rest, compiling = self._interval()
        evaluating = min(rest, max(0.0, float(row.get("eval_s") or 0.0) - compiling))
        self.parts["eval"] += evaluating
        self.parts["checkpoint"] += rest - evaluating
        row.update(self.figures())
        if saved or time.perf_counter() - self._written >= WRITE_EVERY_S:
            self.write()

    def mark(self, part: str) -> None:
        """Charge the time since the last mark, less compiling, to ``part`` (one of
        :data:`PARTS`; ``startup`` before the first step)."""
        self.parts[self._before_loop(part)] += self._interval()[0]

    def closing(self) -> None:
        """The run is closing: the time since the last mark (logs, the profile) was other;
        after this the session waits for its last save."""
        self.mark("other")
        self._closing = True

    def _before_loop(self, part: str) -> str:
        """``part``, or ``startup`` before the first step."""
        return "startup" if self.step is None else part

    # --- figures and records ---------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """This session's record, as charged up to the last mark: ``session`` (1, 2, ...),
        ``start`` and ``end`` (Unix times), ``counted_from`` (``process`` or ``call``),
        ``host``, ``first_step`` (steps done at its start) and ``step`` (reached),
        ``recomputed_steps``, ``state`` (``running``, ``ended``, ``stopped``, ``failed
        (Error)``), ``wall_s`` and ``<part>_s`` for each of :data:`PARTS`."""
        wall = sum(self.parts.values())
        return {"session": self.session, "start": round(self.started, 3),
                "end": round(self.started + wall, 3), "counted_from": self.counted_from,
                "host": socket.gethostname(), "first_step": self.first_step,
                "step": self.step, "recomputed_steps": self.recomputed_steps,
                "state": self.state, "wall_s": round(wall, 4),
                **{f"{p}_s": round(s, 4) for p, s in self.parts.items()}}

    def figures(self) -> dict[str, float]:
        """The whole run's figures so far (every earlier session and this one), keyed as in
        ``metrics.jsonl`` (:data:`ROW_KEYS`)."""
        return run_figures([*self.earlier, self.record()])

    def write(self) -> None:
        """Rewrite ``OUT/goodput.jsonl``: the earlier sessions' records and this one's
        (nothing without a run folder, in a process that does not write, or before the
        first step: a run refused while it was built leaves its folder as it was).

        Raises:
          JaxparError: naming the file, when it cannot be written (a full disk).
        """
        if (self.out is None or not self._writer or not self.out.is_dir()
                or self.first_step is None):
            return
        path = self.out / RECORDS
        part = path.with_name(RECORDS + ".part")  # never uploaded half-written
        text = "".join(json.dumps(r) + "\n" for r in [*self.earlier, self.record()])
        try:
            part.write_text(text)
            part.replace(path)
        except OSError as err:
            raise JaxparError(f"writing {path} failed: {write_fault(err) or err} "
                              f"({human_bytes(free_bytes(path))} free there)") from None
        self._written = time.perf_counter()


def run_figures(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The totals of session records as ``metrics.jsonl`` keys (:data:`ROW_KEYS`)."""
    wall = sum(float(r.get("wall_s") or 0.0) for r in records)
    parts = {p: sum(float(r.get(f"{p}_s") or 0.0) for r in records) for p in PARTS}
    return {"goodput": round(parts["productive"] / wall, 6) if wall > 0 else 0.0,
            "goodput_wall_s": round(wall, 4),
            **{row_key(p): round(s, 4) for p, s in parts.items()}}


def describe(figures: dict[str, Any]) -> str:
    """One line of run figures (:data:`ROW_KEYS`), e.g. ``goodput 61% of 6.2 s, most lost
    to compile (25%)``; empty when they are missing."""
    wall = figures.get("goodput_wall_s")
    if not wall:
        return ""
    part, lost = max(((p, figures.get(row_key(p)) or 0.0) for p in LOST),
                     key=lambda x: x[1])
    text = f"goodput {figures['goodput']:.0%} of {wall:.1f} s"
    return text + (f", most lost to {part.replace('_', ' ')} ({lost / wall:.0%})"
                   if lost > 0 else "")


def final_figures(run: str | Path | None, last: dict[str, Any]) -> dict[str, Any]:
    """The run's figures once a session is over: from the records in ``run`` (its close
    included), else (no run folder, or records that cannot be read) those of ``last``,
    the session's last metrics row."""
    if run:
        try:
            return run_figures(read_records(run))
        except JaxparError:
            pass
    return last


def _missing(run: str | Path, folder: bool) -> JaxparError:
    if not folder:
        return JaxparError(f"RUN {str(run)!r}: no such folder")
    return JaxparError(f"RUN {str(run)!r} holds no {RECORDS}: it is not the --out of jaxpar "
                       "train, or its sessions ran before goodput was recorded")


def read_records(run: str | Path) -> list[dict[str, Any]]:
    """The session records of a run folder, local or in a bucket, oldest first.

    Raises:
      JaxparError: in one line, for a missing folder or object, or a folder without
        records (not a ``jaxpar train`` run folder, or one trained before records were
        kept).
    """
    if is_remote(run):
        url = str(run).rstrip("/")
        where = f"{url}/{RECORDS}"
        check_bucket(url, "RUN")  # no endpoint, bucket or credentials: one line
        fs = filesystem(url, "RUN")
        with reported(url, "RUN"):
            folder, found = fs.isdir(url), fs.isfile(where)
        if not found:
            raise _missing(run, folder)
        text = read_object(where, "RUN").decode(errors="replace")
    else:
        path = Path(run) / RECORDS
        if not path.is_file():
            raise _missing(run, Path(run).is_dir())
        text, where = path.read_text(errors="replace"), str(path)
    records = _parse(text)
    if not records:
        raise JaxparError(f"{where} holds no session record")
    return records
