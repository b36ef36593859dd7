"""``jaxpar goodput RUN``: where a run's wall time went, session by session (each restart of
the run folder), from its ``goodput.jsonl`` (see :mod:`jaxpar.runs.goodput`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from jaxpar.analysis.report import table
from jaxpar.runs.goodput import LOST, PARTS, read_records, row_key, run_figures

HEADERS = ("session", "steps", "wall", *(p.replace("_", " ") for p in PARTS), "goodput",
           "end")
"""The table's columns: one row per session, then the run's total and each part's share."""


def seconds(s: float | None) -> str:
    """``4.25`` -> ``'4.2s'``, ``754`` -> ``'12m34s'``, ``7384`` -> ``'2h03m'``."""
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _state(record: dict[str, Any], last: bool) -> str:
    """A session's end: ``ended``, ``stopped``, ``failed (Error)``; a record left
    ``running`` is a session killed outright (the last one may still be running)."""
    state = str(record.get("state") or "?")
    if state == "running":
        return "running?" if last else "killed"
    return state


def _steps(record: dict[str, Any]) -> str:
    first, last = record.get("first_step"), record.get("step")
    if first is None or last is None:
        return "-"
    if last <= first:
        return "-"
    return f"{last}" if last == first + 1 else f"{first + 1}-{last}"


def render(run: str, records: list[dict[str, Any]]) -> str:
    """The table of ``jaxpar goodput``: every session, the total, each part's share of the
    wall time, then the gaps between sessions and the biggest loss."""
    rows = []
    for i, r in enumerate(records):
        wall = float(r.get("wall_s") or 0.0)
        productive = float(r.get("productive_s") or 0.0)
        rows.append([r.get("session", i + 1), _steps(r), seconds(wall),
                     *(seconds(r.get(f"{p}_s")) for p in PARTS),
                     f"{productive / wall:.1%}" if wall > 0 else "-",
                     _state(r, i == len(records) - 1)])
    total = run_figures(records)
    wall = total["goodput_wall_s"]
    rows.append(["total", "", seconds(wall), *(seconds(total[row_key(p)]) for p in PARTS),
                 f"{total[row_key('productive')] / wall:.1%}" if wall > 0 else "-", ""])
    rows.append(["share", "", "100%" if wall > 0 else "-",
                 *(f"{total[row_key(p)] / wall:.0%}" if wall > 0 else "-" for p in PARTS),
                 "", ""])
    again = sum(int(r.get("recomputed_steps") or 0) for r in records)
    first = min((r["first_step"] for r in records if r.get("first_step") is not None),
                default=0)
    last = max((r["step"] for r in records if r.get("step") is not None), default=0)
    n = len(records)
    lines = [f"run {run}: {n} session{'s' * (n != 1)}, steps {first + 1}-{last}, {again} "
             f"step{'s' * (again != 1)} trained again", "",
             table(HEADERS, rows, right=tuple(range(2, len(HEADERS) - 1)))]
    footer = []
    if n > 1:
        gaps = sum(max(0.0, b["start"] - a["end"])
                   for a, b in zip(records[:-1], records[1:], strict=True)
                   if "start" in b and "end" in a)
        footer.append(f"between the sessions (not counted above): {seconds(gaps)}")
    part, lost = max(((p, total[row_key(p)]) for p in LOST), key=lambda x: x[1])
    if wall > 0 and lost > 0:
        footer.append(f"most lost to {part.replace('_', ' ')}: {seconds(lost)} "
                      f"({lost / wall:.0%} of the wall time)")
    if footer:
        lines += ["", *footer]
    return "\n".join(lines)


def command(args: argparse.Namespace) -> int:
    """``jaxpar goodput RUN [--json]``: print the table (or the records as JSON)."""
    records = read_records(args.run)
    if args.json:
        print(json.dumps({"sessions": records, "total": run_figures(records)}, indent=1))
    else:
        print(render(args.run, records))
    return 0
