"""Where a collective came from: the op and the source line of the model that brought it.

A compiled program's collectives carry the metadata of the operation the partitioner
inserted them for: its ``op_name`` (``jit(step)/transpose(jvp())/concatenate``: a
``concatenate`` of the backward pass) and its Python stack, kept in the module's
``StackFrames`` tables (``stack_frame_id``) or, from older XLA, as ``source_file`` and
``source_line``. :func:`collective_sources` reads them, and :func:`explain_collectives`
says in one line per source what brought each collective a sharded step should not hold
(all-to-alls, by default)::

    8 all-to-alls from the backward pass of tests/user_models.py:626 in
    CausalSelfAttention.__call__: `q, k, v = jnp.split(self.c_attn(x), 3, axis=2)` ...

The line named is the innermost frame outside jaxpar, JAX, Flax and other installed
packages: the model's own code.
"""

from __future__ import annotations

import linecache
import re
from collections import Counter
from pathlib import Path
from typing import Any

from jaxpar.analysis.hlo import parse_collectives

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_ROW = re.compile(r"^\s*(\d+)\s+(.*)$")
_FIELDS = re.compile(r"(\w+)=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_LIBRARY = ("/site-packages/", "/dist-packages/", "<frozen",
            str(Path(__file__).resolve().parents[1]) + "/")  # jaxpar's own modules

SPLIT_HINT = (
    "an array split or sliced along a dimension that is sharded over a mesh axis, as a "
    "fused projection (q, k and v in one Linear) split in three under tensor parallelism "
    "is: each device holds a contiguous block of the fused dimension, not its share of each "
    "part. Gather the fused output (plan.layouts: the projection's output as "
    "('batch', 'seq', None)) and keep the heads that follow off the tensor axis; see "
    "docs/guides/models.md#fused-projections-tied-heads-and-grouped-query-attention")
RESHAPE_HINT = (
    "a reshape or transpose that moves a sharded dimension; pin the layout of the module "
    "around it (plan.layouts)")
HINTS = {"concatenate": SPLIT_HINT, "split": SPLIT_HINT, "slice": SPLIT_HINT,
         "dynamic_slice": SPLIT_HINT, "reshape": RESHAPE_HINT, "transpose": RESHAPE_HINT}
"""What usually brings a collective at an op of this name (the last part of op_name)."""


def _tables(hlo_text: str) -> dict[str, dict[int, str]]:
    out: dict[str, dict[int, str]] = {name: {} for name in _TABLES}
    current = None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped in _TABLES:
            current = stripped
            continue
        m = _ROW.match(line) if current else None
        if m is None:
            current = None
            continue
        out[current][int(m[1])] = m[2]
    return out


def _frames(tables: dict[str, dict[int, str]], frame_id: int) -> list[tuple[str, str, int]]:
    """``(file, function, line)`` of a stack, innermost first. A frame's printed
    ``parent_frame_id`` is its parent's id plus one (0: no parent)."""
    out: list[tuple[str, str, int]] = []
    seen = set()
    while frame_id in tables["StackFrames"] and frame_id not in seen and len(out) < 64:
        seen.add(frame_id)
        frame = dict(_FIELDS.findall(tables["StackFrames"][frame_id]))
        loc = dict(_FIELDS.findall(tables["FileLocations"].get(
            int(frame.get("file_location_id", 0)), "")))
        if not loc:
            break
        out.append((tables["FileNames"].get(int(loc["file_name_id"]), "?").strip('"'),
                    tables["FunctionNames"].get(int(loc["function_name_id"]), "?").strip('"'),
                    int(loc["line"])))
        frame_id = int(frame.get("parent_frame_id", 0)) - 1
    return out


def _user_frame(frames: list[tuple[str, str, int]]) -> tuple[str, str, int] | None:
    for frame in frames:
        if not any(part in frame[0] for part in _LIBRARY):
            return frame
    return frames[0] if frames else None


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def collective_sources(hlo_text: str, kinds: tuple[str, ...] = ("all-to-all",)
                       ) -> list[dict[str, Any]]:
    """The collectives of ``kinds`` in a compiled program's HLO text, grouped by source.

    Each row: ``kind``, ``count``, ``op`` (the HLO op they were inserted for, the last part
    of ``op_name``), ``backward`` (in the backward pass: ``transpose(`` in ``op_name``),
    ``argument`` (a reshard of the program's argument named ``op``, with no stack),
    ``file``, ``line``, ``function`` (the innermost frame outside installed packages and
    jaxpar; None where the program carries no stack) and ``code`` (that line's text, when
    the file is readable). Most frequent first.
    """
    tables = _tables(hlo_text)
    groups: Counter = Counter()
    for c in parse_collectives(hlo_text):
        if c.kind not in kinds:
            continue
        op_name = (_OP_NAME.search(c.line) or [None, ""])[1]
        op = re.sub(r"\[.*\]$", "", op_name.rsplit("/", 1)[-1]) or "?"
        where = None
        source = _SOURCE.search(c.line)
        frame_id = _FRAME_ID.search(c.line)
        if source:
            where = (source[1], "?", int(source[2]))
        elif frame_id:
            where = _user_frame(_frames(tables, int(frame_id[1])))
        groups[(c.kind, op, "transpose(" in op_name, where, "/" not in op_name)] += 1
    rows = []
    for (kind, op, backward, where, argument), count in groups.most_common():
        file, function, line = where or (None, None, None)
        code = linecache.getline(file, line).strip() if file and line else ""
        rows.append({"kind": kind, "count": count, "op": op, "backward": backward,
                     "argument": argument and op != "?" and where is None,
                     "file": _short(file) if file else None, "line": line,
                     "function": function, "code": code or None})
    return rows


def explain_collectives(hlo_text: str, kinds: tuple[str, ...] = ("all-to-all",)
                        ) -> list[str]:
    """One line per source of the collectives of ``kinds`` (see :func:`collective_sources`):
    how many, the pass, the model's line and its code, the HLO op and what usually brings
    a collective there. Empty when the program holds none."""
    out = []
    for row in collective_sources(hlo_text, kinds):
        n = row["count"]
        what = f"{n} {row['kind']}{'s' if n != 1 else ''}"
        phase = "the backward pass of" if row["backward"] else "the forward pass at"
        if row["file"]:
            where = f"{row['file']}:{row['line']}"
            if row["function"] and row["function"] != "?":
                where += f" in {row['function']}"
            if row["code"]:
                where += f": `{row['code']}`"
        elif row["argument"]:
            out.append(f"{what} resharding the program's argument {row['op']} (it arrives "
                       "laid out otherwise than its first use wants)")
            continue
        else:
            where = "an unknown line (the program carries no source metadata)"
        hint = HINTS.get(row["op"])
        out.append(f"{what} from {phase} {where} (HLO op {row['op']})"
                   + (f": {hint}" if hint else ""))
    return out
