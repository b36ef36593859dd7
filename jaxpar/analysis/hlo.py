"""Read what XLA actually did: collectives in the optimized HLO, per-device memory, FLOPs.

Everything here works on a compiled program (``jax.stages.Compiled``) or its HLO text, so
it reports the partitioned, optimized program, not what the user asked for.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import Mesh

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                    "all-to-all")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<kind>" + "|".join(COLLECTIVE_KINDS) + r")(?P<start>-start)?\("
)
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
    r"\s*\{([^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{(\{\d+,\d+\}(?:,\{\d+,\d+\})*)\}")


@dataclass
class Collective:
    """One collective instruction of the optimized HLO."""

    kind: str
    bytes: int
    groups: list[list[int]] = field(default_factory=list)
    line: str = ""


def _type_bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def _iota(dims: list[int], perm: str | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _groups(line: str) -> list[list[int]]:
    if m := _GROUPS_MESH.search(line):
        # Shardy's form: a synthetic mesh over the devices and the axes the op reduces over.
        axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", m[1])]
        sizes = [size for _, size in axes]
        ids = (_iota(_ints(m[2]), m[3]) if m[2] else np.arange(int(np.prod(sizes))))
        ids = ids.reshape(sizes)
        reduced = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m[4]]
        kept = [i for i in range(len(axes)) if i not in reduced]
        size = int(np.prod([sizes[i] for i in reduced]))
        return ids.transpose(kept + reduced).reshape(-1, size).tolist()
    if m := _GROUPS_LIST.search(line):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m[1])]
    if m := _GROUPS_IOTA.search(line):
        return _iota(_ints(m[2]), m[3]).reshape(_ints(m[1])).tolist()
    if m := _PAIRS.search(line):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m[1])]
    return []


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective in an HLO module's text (async ``-start`` ops counted once)."""
    out = []
    for line in hlo_text.splitlines():
        m = _OP.match(line)
        if not m:
            continue
        type_text = m["type"]
        if m["start"] and type_text.startswith("("):
            # Async start ops return (operand, result, ...): count the result buffer only.
            shapes = _SHAPE.findall(type_text)
            type_text = "{}[{}]".format(*shapes[min(1, len(shapes) - 1)]) if shapes else ""
        out.append(Collective(m["kind"], _type_bytes(type_text), _groups(line), line.strip()))
    return out


_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def custom_calls(hlo_text: str) -> dict[str, int]:
    """Custom calls of a compiled program by target (``tpu_custom_call``: a Pallas/Mosaic
    kernel compiled for a TPU), e.g. ``{"tpu_custom_call": 8}``."""
    return dict(sorted(Counter(_CUSTOM_CALL.findall(hlo_text)).items()))


def count_collectives(hlo_text: str) -> Counter:
    """``Counter`` of collective kinds in the HLO text."""
    return Counter(c.kind for c in parse_collectives(hlo_text))


def count_reduce_scatters(hlo_text: str) -> int:
    """Reduce-scatters in a compiled program: XLA's own instruction or, on a backend that
    has none (CPU), an all-reduce every user of which slices out this device's part."""
    count = sum(1 for c in parse_collectives(hlo_text) if c.kind == "reduce-scatter")
    lines = hlo_text.splitlines()
    for name in re.findall(r"(%all-reduce[\w.]*) = ", hlo_text):
        uses = re.compile(re.escape(name) + r"[,)]")
        users = [line for line in lines if uses.search(line) and f"{name} = " not in line]
        if users and all("dynamic-slice" in line.split("=", 1)[0] for line in users):
            count += 1
    return count


def group_axes(groups: list[list[int]], mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which the devices of each group differ.

    HLO partition ``i`` is the ``i``-th device of the mesh in row-major order.
    """
    shape = tuple(mesh.shape.values())
    names = tuple(mesh.shape)
    varying: set[int] = set()
    for group in groups:
        coords = np.array([np.unravel_index(i, shape) for i in group])
        if len(coords) > 1:
            varying.update(int(a) for a in np.nonzero((coords != coords[0]).any(axis=0))[0])
    return tuple(names[a] for a in sorted(varying))


def collective_table(hlo_text: str, mesh: Mesh) -> list[dict[str, Any]]:
    """Collectives grouped by (kind, mesh axes): count and bytes per device of the results."""
    rows: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
    for c in parse_collectives(hlo_text):
        axes = group_axes(c.groups, mesh)
        row = rows.setdefault((c.kind, axes), {"kind": c.kind, "axes": list(axes), "count": 0,
                                               "bytes_per_device": 0})
        row["count"] += 1
        row["bytes_per_device"] += c.bytes
    return sorted(rows.values(), key=lambda r: (r["kind"], r["axes"]))


_ENTRY_LAYOUT = re.compile(r"entry_computation_layout=\{\((.*?)\)->(.*?)\}(?:, \w+=|\n|$)",
                           re.S)
_LAID_OUT = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
_ALIAS = re.compile(r"\{([\d,]*)\}: \((\d+), \{[\d,]*\}")
HOST_SPACE = "S(5)"
"""How the optimized HLO marks a buffer in host memory (``pinned_host``)."""


def _buffers(text: str) -> list[tuple[int, bool]]:
    """(bytes, in host memory) of each array in a layout list."""
    out = []
    for dtype, dims, layout in _LAID_OUT.findall(text):
        n = int(np.prod([int(d) for d in filter(None, dims.split(","))], dtype=np.int64))
        out.append((n * _DTYPE_BYTES[dtype], HOST_SPACE in (layout or "")))
    return out


def memory_spaces(hlo_text: str) -> dict[str, int]:
    """Per-device bytes of a compiled program's arguments and outputs by memory space,
    read from its entry layout (host buffers carry ``S(5)``): ``argument_bytes``,
    ``output_bytes`` and ``alias_bytes`` (outputs reusing a donated argument) in device
    memory, and the same with a ``host_`` prefix."""
    header = hlo_text.split("\n", 1)[0]
    found = _ENTRY_LAYOUT.search(header)
    if not found:
        return {}
    args, outs = _buffers(found.group(1)), _buffers(found.group(2))
    aliased = {int(i or 0): int(p) for i, p in _ALIAS.findall(
        header.split("entry_computation_layout")[0])}
    out: dict[str, int] = dict.fromkeys(
        ("argument_bytes", "output_bytes", "alias_bytes", "host_argument_bytes",
         "host_output_bytes", "host_alias_bytes"), 0)
    for size, host in args:
        out["host_argument_bytes" if host else "argument_bytes"] += size
    for index, (size, host) in enumerate(outs):
        out["host_output_bytes" if host else "output_bytes"] += size
        if index in aliased:
            out["host_alias_bytes" if host else "alias_bytes"] += size
    return out


def memory_stats(compiled: Any) -> dict[str, int]:
    """XLA's per-device memory for a compiled program: argument, output, temp, code bytes,
    in device memory, and the arguments and outputs in host memory (``host_`` keys: from
    XLA's analysis where it splits them, otherwise from the HLO's memory spaces)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    out = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "code_bytes": int(stats.generated_code_size_in_bytes),
        "host_argument_bytes": int(stats.host_argument_size_in_bytes),
        "host_output_bytes": int(stats.host_output_size_in_bytes),
        "host_alias_bytes": int(stats.host_alias_size_in_bytes),
        "host_temp_bytes": int(stats.host_temp_size_in_bytes),
    }
    if not any(out[k] for k in ("host_argument_bytes", "host_output_bytes")):
        # The analysis counts both spaces as one (XLA:CPU): split by the HLO's spaces.
        spaces = memory_spaces(compiled.as_text())
        for key in ("argument_bytes", "output_bytes", "alias_bytes"):
            if spaces.get("host_" + key):
                out["host_" + key] = spaces["host_" + key]
                out[key] = max(out[key] - spaces["host_" + key], 0)
    return out


def flops(compiled: Any) -> float:
    """Total FLOPs XLA's cost analysis counts for the compiled program (per device)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))



_HEADER = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
                    r"(?P<op>[\w\-]+)\((?P<rest>.*)$")
_CALLED = re.compile(r"\b(calls|body|branch_computations|called_computations)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")
_CONDITION = re.compile(r"condition=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"^\w+\[([\d,]*)\]")
_NAME = re.compile(r"%?([\w.\-]+)")


_DIM_LABELS = re.compile(r"dim_labels=(\w+)_\w+->\w+")
_WINDOW = re.compile(r"window=\{size=([\dx]+)(?: pad=([\d_x]+))?")


def _conv_dot(rest: str) -> tuple[list[int], int]:
    """A TPU ``convolution`` that computes a ``dot_general``: (the lhs dimensions it
    contracts, the window positions each output sums over). The lhs's feature dimension
    (``f`` in ``dim_labels``) is contracted; a spatial dimension is contracted over its
    window unless the window is padded by its size minus one on both sides, the form in
    which the TPU compiler writes a batch dimension (each output sees one position)."""
    labels = _DIM_LABELS.search(rest)
    contracting = [labels[1].index("f")] if labels and "f" in labels[1] else []
    window = 1
    if w := _WINDOW.search(rest):
        sizes = _ints(w[1].replace("x", ","))
        pads = w[2].split("x") if w[2] else ["0_0"] * len(sizes)
        for size, pad in zip(sizes, pads, strict=False):
            lo, hi = (int(x) for x in pad.split("_"))
            window *= 1 if (lo, hi) == (size - 1, size - 1) else size
    return contracting, window


def matmul_flops(hlo_text: str) -> dict[str, int]:
    """FLOPs of every ``dot`` in an optimized HLO module, each loop body counted per trip.

    XLA's own cost analysis (:func:`flops`) counts a ``while`` loop's body once, so a model
    whose layers run under ``lax.scan`` looks ``n_layers`` times cheaper than it is (the
    TPU compiler writes dots as ``convolution``s: those are counted too, see
    :func:`_conv_dot`). Here
    each computation is weighted by how often it runs: a ``while`` body by its
    ``known_trip_count`` (once when XLA does not know it), fusions and calls by their
    caller. A dot costs ``2 x output elements x contracted size``.

    Returns ``{"flops", "dots", "loops", "loops_without_trip_count"}``.
    """
    shapes: dict[str, list[int]] = {}
    dots: list[tuple[str, str, str, list[int]]] = []
    callers: dict[str, list[tuple[str, int]]] = {}
    bounds: dict[str, list[int]] = {}
    comp = entry = None
    loops = unknown = 0
    for line in hlo_text.splitlines():
        if m := _HEADER.match(line):
            comp = m["name"]
            entry = comp if m[1] else entry
            continue
        m = _INSTR.match(line)
        if m is None or comp is None:
            continue
        if a := _ARRAY.match(m["type"]):
            shapes[m["name"]] = _ints(a[1])
        rest = m["rest"]
        if m["op"] == "dot":
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
            dots.append((comp, m["name"], _NAME.match(rest.lstrip())[1],
                         _ints(contracting[1]) if contracting else [], 1))
        elif m["op"] == "convolution" and "dot_general" in rest:
            dots.append((comp, m["name"], _NAME.match(rest.lstrip())[1], *_conv_dot(rest)))
        if (m["op"] == "constant" and (c := re.match(r"(\d+)\)", rest))
                and m["type"][:5] in ("s32[]", "u32[]")):
            bounds.setdefault(comp, []).append(int(c[1]))
        for kind, target in _CALLED.findall(rest):
            factor: int | str = 1
            if kind == "body":
                loops += 1
                trip = _TRIP.search(rest)
                cond = _CONDITION.search(rest)
                factor = int(trip[1]) if trip else (cond[1] if cond else 1)
            for callee in _NAME.findall(target):
                callers.setdefault(callee, []).append((comp, factor))

    def trips(factor: int | str) -> int:
        """A loop's trip count; without XLA's ``known_trip_count`` (the TPU compiler's
        loops), the bound its condition compares the counter with (``i < n``)."""
        nonlocal unknown
        if isinstance(factor, int):
            return factor
        found = bounds.get(factor, [])
        if len(found) == 1:
            return found[0]
        unknown += 1
        return 1

    callers = {k: [(c, trips(f)) for c, f in v] for k, v in callers.items()}

    runs: dict[str, int] = {}

    def times(name: str, seen: frozenset = frozenset()) -> int:
        if name == entry:
            return 1
        if name not in runs:
            runs[name] = sum(times(c, seen | {name}) * f
                             for c, f in callers.get(name, []) if c not in seen)
        return runs[name]

    total = 0
    for comp_name, out, lhs, contracting, window in dots:
        k = window * (int(np.prod([shapes[lhs][d] for d in contracting]))
                      if lhs in shapes else 1)
        total += 2 * int(np.prod(shapes.get(out, [0]))) * k * times(comp_name)
    return {"flops": total, "dots": len(dots), "loops": loops,
            "loops_without_trip_count": unknown}
