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

from jaxpar.analysis.loops import (
    PASS_THROUGH,
    TUPLE_INDEX,
    Instruction,
    Module,
    called,
    computation_runs,
    parameter_element,
    parse_module,
    producer,
)
from jaxpar.planner.links import wire_bytes

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
    """One collective instruction of the optimized HLO: ``bytes`` of its result per
    device, the computation holding it, ``runs`` (its executions per step: its loops' trip
    counts multiplied, :func:`jaxpar.analysis.loops.computation_runs`) and ``implements``,
    the collective it is part of: its own kind, or for a collective-permute of the
    compiler's collective matmul (a windowed einsum: a weight gathered or a gradient
    reduce-scattered shard by shard under the matmul), ``all-gather`` or
    ``reduce-scatter``; for an all-reduce, ``all-gather`` when it sums a buffer of zeros
    holding this device's shard (how the TPU compiler gathers on a 3D torus) and
    ``reduce-scatter`` when each device keeps only its slice of the sum."""

    kind: str
    bytes: int
    groups: list[list[int]] = field(default_factory=list)
    line: str = ""
    computation: str = ""
    runs: int = 1
    implements: str = ""

    @property
    def wire_bytes(self) -> float:
        """Bytes a device receives for one execution (:func:`jaxpar.planner.comms.
        wire_bytes`; the group size from the replica groups), as the instruction runs:
        an all-reduce the compiler fused with its slicing into a reduce-scatter
        (``all-reduce-scatter`` computations) moves a reduce-scatter's bytes; one that
        merely implements a gather or a scatter moves an all-reduce's."""
        n = len(self.groups[0]) if self.groups else 1
        if self.kind == "all-reduce" and self.computation.startswith("all-reduce-scatter"):
            return wire_bytes("reduce-scatter", self.bytes / n, n)
        return wire_bytes(self.kind, self.bytes, n)


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


_WINDOWED = re.compile(r"windowed_dot_general_body_(ag|rs)\b")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_START = {f"{kind}-start": kind for kind in COLLECTIVE_KINDS}


def _windowed(computation: str) -> str:
    """``all-gather`` or ``reduce-scatter`` when ``computation`` is the body of the TPU
    compiler's windowed-einsum loop of that kind (a collective matmul), else empty."""
    m = _WINDOWED.search(computation)
    return ("all-gather" if m[1] == "ag" else "reduce-scatter") if m else ""


def _collective_matmul(module: Module, instr: Instruction) -> str:
    """``all-gather`` or ``reduce-scatter`` when ``instr`` (a permute) is a step of the
    compiler's collective matmul (a windowed einsum): inside its loop's body, or a step
    the compiler peeled out of the loop (or pipelined into the previous trip of an outer
    loop) whose result flows into that loop, or one of a loop it unrolled (a few devices:
    a partial sum passed on is a reduce-scatter's step, a weight's shard a gather's);
    else empty. Only permutes that a ``dot_general`` brought are followed."""
    if kind := _windowed(instr.computation):
        return kind
    name = _OP_NAME.search(instr.attrs)
    if not name or "dot_general" not in name[1].rsplit("/", 1)[-1]:
        return ""
    # An epilogue: the permute sends on what a windowed loop left (a few ops up).
    frontier, seen = list(instr.operands), set(instr.operands)
    for _ in range(4):
        nxt = []
        for value in frontier:
            source = module.by_name.get(value)
            if source is None:
                continue
            if source.op == "while":
                if kind := _windowed(dict(called(source)).get("body", "")):
                    return kind
                continue
            nxt += [o for o in source.operands if o not in seen]
            seen.update(source.operands)
        frontier = nxt
    # A prologue: what it sends flows into a windowed loop.
    frontier, seen = [instr.name], {instr.name}
    for _ in range(12):
        nxt = []
        for value in frontier:
            for user in module.users(value):
                if user.op == "while":
                    if kind := _windowed(dict(called(user)).get("body", "")):
                        return kind
                    continue
                if user.root and user.op == "tuple":
                    # A loop body's result: the value comes back as the next trip's
                    # element of the loop's parameter.
                    places = {i for i, o in enumerate(user.operands) if o == value}
                    carried = [i.name for i in module.computations[user.computation]
                               if i.op == "get-tuple-element"
                               and parameter_element(module, i.name) in places]
                    nxt += [c for c in carried if c not in seen]
                    seen.update(carried)
                elif user.name not in seen:
                    seen.add(user.name)
                    nxt.append(user.name)
        frontier = nxt
    # Unrolled (a few devices): no loop to name it; what it passes on tells.
    return "reduce-scatter" if _partial_sum(module, instr.operands[0]) else "all-gather"


_SUMS = {"add", "convolution", "dot", "broadcast"}


def _partial_sum(module: Module, name: str, depth: int = 0) -> bool:
    """Whether ``name`` is a collective matmul's running partial sum (made by a matmul,
    an addition, or zeros to start from), seen through copies, permutes passing it on,
    and the outputs of fusions."""
    source = producer(module, name)
    if source is None or depth > 16:
        return False
    if source.op in ("collective-permute-done", "collective-permute",
                     "collective-permute-start") and source.operands:
        return _partial_sum(module, source.operands[0], depth + 1)
    if source.op == "get-tuple-element" and source.operands:
        index = TUPLE_INDEX.search(source.attrs)
        tupled = producer(module, source.operands[0])
        if index and tupled is not None and tupled.op == "tuple":
            element = int(index[1])
            if element < len(tupled.operands):
                return _partial_sum(module, tupled.operands[element], depth + 1)
        return False
    return source.op in _SUMS


def parse_collectives(hlo: str | Module) -> list[Collective]:
    """Every collective in an HLO module (its text, or the text parsed by
    :func:`jaxpar.analysis.loops.parse_module`; async ``-start`` ops counted once, and a
    collective the TPU compiler splits over an async collective fusion's start,
    continuations and done counted once, at its start), each with its executions per step
    and the collective it implements."""
    module = parse_module(hlo) if isinstance(hlo, str) else hlo
    runs = None
    out = []
    # The TPU compiler (its layouts are tiled) runs some gathers and reduce-scatters as
    # all-reduces by choice; XLA:CPU runs every reduce-scatter so, and the planner lists
    # it as the all-reduce it is there.
    tiled = any(":T(" in i.type for i in module.by_name.values())
    for comp, instrs in module.computations.items():
        for instr in instrs:
            kind = _START.get(instr.op, instr.op)
            if kind not in COLLECTIVE_KINDS:
                continue
            type_text = _start_result(instr.type, kind) if instr.op != kind else instr.type
            if runs is None:
                runs = computation_runs(module).runs
            implements = kind
            if kind == "collective-permute":
                implements = _collective_matmul(module, instr) or kind
            elif kind == "all-reduce" and comp.startswith("all-reduce-scatter"):
                implements = "reduce-scatter"  # the TPU compiler's fused reduce-scatter
            elif kind == "all-reduce" and tiled:
                # Each element of a combined all-reduce on its own: what it is part of.
                for part, size in _all_reduce_parts(module, instr):
                    out.append(Collective(kind, size, _groups(instr.line), instr.line, comp,
                                          runs.get(comp, 1) if comp else 1, part))
                continue
            out.append(Collective(kind, _type_bytes(type_text), _groups(instr.line),
                                  instr.line, comp, runs.get(comp, 1) if comp else 1,
                                  implements))
    return _once_per_async_fusion(module, out)


def _top_level(tuple_text: str) -> list[str]:
    """The elements of a tuple type's text (``(a, (b, c), d)`` -> ``a``, ``(b, c)``, ``d``)."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(tuple_text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                parts.append(tuple_text[start:i].strip())
        elif ch == "," and depth == 1:
            parts.append(tuple_text[start:i].strip())
            start = i + 1
    return [p for p in parts if p]


def _start_result(type_text: str, kind: str) -> str:
    """What an async ``-start`` op's type holds of its result: an all-reduce-start's type
    is its result (a tuple when the compiler combined several); the others return
    ``(operand, result, ...)``, where the GPU compiler's combined collectives make the
    operand and the result tuples of their own (``((a, b), (a', b'))``)."""
    if kind == "all-reduce" or not type_text.startswith("("):
        return type_text
    parts = _top_level(type_text)
    return parts[1] if len(parts) > 1 else type_text


_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


def _once_per_async_fusion(module: Module, found: list[Collective]) -> list[Collective]:
    """``found`` less the copies of a collective that the TPU compiler's async collective
    fusion carries in its continuation and done computations (the same ``channel_id`` as
    the one in the computation its ``async-collective-start`` runs)."""
    channels = []
    for c in found:
        channel = _CHANNEL.search(c.line)
        at_start = bool(channel) and any(i.name.startswith("async-collective-start")
                                         for i in module.runners(c.computation))
        channels.append((channel[1] if channel else None, at_start))
    started = {channel for channel, at_start in channels if at_start}
    return [c for c, (channel, at_start) in zip(found, channels, strict=True)
            if at_start or channel not in started]


_SLICE_PASS = PASS_THROUGH | {"get-tuple-element"}


def _slices_only(module: Module, name: str, depth: int = 0) -> bool:
    """Whether every use of ``name`` keeps a slice of it (``dynamic-slice``, ``slice``),
    through copies, tuple elements and into the fusions that take it."""
    users = module.users(name)
    if not users or depth > 8:
        return False
    for user in users:
        if user.op in ("dynamic-slice", "slice") and user.operands[0] == name:
            continue
        if user.op in _SLICE_PASS or user.op.endswith("-done"):
            if not _slices_only(module, user.name, depth + 1):
                return False
            continue
        if user.op == "fusion":
            callee = next((c for how, c in called(user) if how == "calls"), None)
            params = [module.parameter(callee, i) for i, o in enumerate(user.operands)
                      if o == name] if callee else []
            if not params or not all(p is not None and _slices_only(module, p.name, depth + 1)
                                     for p in params):
                return False
            continue
        return False
    return True


def _element_uses(module: Module, instr: Instruction) -> list[list[str]]:
    """For each element an all-reduce returns (one, or one per operand of a combined
    all-reduce), the values that hold it: the result itself, or its tuple elements; seen
    past an async ``-done`` and, for an all-reduce an async call runs (TPU7x's
    SparseCore), from the call's side."""
    holders = [instr.name]
    if instr.root:
        holders = [r.name for r in module.runners(instr.computation)]
    holders = [d.name for h in holders for d in module.users(h)
               if d.op.endswith("-done")] or holders
    n = max(1, sum(1 for o in instr.operands
                   if not module.by_name.get(o, instr).type.startswith("token")))
    if n == 1:
        return [holders]
    parts: list[list[str]] = [[] for _ in range(n)]
    for h in holders:
        for user in module.users(h):
            index = TUPLE_INDEX.search(user.attrs) if user.op == "get-tuple-element" else None
            if index and int(index[1]) < n:
                parts[int(index[1])].append(user.name)
    return parts


def _all_reduce_parts(module: Module, instr: Instruction) -> list[tuple[str, int]]:
    """What an all-reduce is part of, element by element of a combined one, with each
    element's bytes: ``all-gather`` when what it sums was made by a
    ``dynamic-update-slice`` (each device's shard placed in a buffer of zeros),
    ``reduce-scatter`` when every use of its sum keeps only a slice, else
    ``all-reduce``."""
    operands = [o for o in instr.operands
                if not module.by_name.get(o, instr).type.startswith("token")]
    shapes = _SHAPE.findall(instr.type)
    if instr.op != "all-reduce" and len(shapes) > len(operands):
        shapes = shapes[len(shapes) - len(operands):]
    uses = _element_uses(module, instr)
    parts = []
    for i, operand in enumerate(operands):
        size = _type_bytes("{}[{}]".format(*shapes[i])) if i < len(shapes) else 0
        source = producer(module, operand)
        if source is not None and source.op == "dynamic-update-slice":
            parts.append(("all-gather", size))
        elif i < len(uses) and uses[i] and all(_slices_only(module, u) for u in uses[i]):
            parts.append(("reduce-scatter", size))
        else:
            parts.append(("all-reduce", size))
    return parts


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


def collective_table(hlo: str | Module, mesh: Mesh) -> list[dict[str, Any]]:
    """Collectives grouped by (kind, mesh axes), the kind being what each implements (a
    collective matmul's permutes are under the all-gather or reduce-scatter they make up,
    and counted in ``in_collective_matmuls``).

    Per row: ``count`` (instructions in the text) and ``bytes_per_device`` (their result
    bytes, each once), and as one step runs them: ``executions``, ``bytes_per_step``
    (result bytes times runs) and ``wire_bytes_per_step`` (what a device receives,
    :func:`jaxpar.planner.links.wire_bytes`: the unit the planner is compared in)."""
    rows: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
    for c in parse_collectives(hlo):
        axes = group_axes(c.groups, mesh)
        row = rows.setdefault((c.implements, axes), {
            "kind": c.implements, "axes": list(axes), "count": 0, "bytes_per_device": 0,
            "executions": 0, "bytes_per_step": 0, "wire_bytes_per_step": 0.0,
            "in_collective_matmuls": 0})
        row["count"] += 1
        row["bytes_per_device"] += c.bytes
        row["executions"] += c.runs
        row["bytes_per_step"] += c.bytes * c.runs
        row["wire_bytes_per_step"] += c.wire_bytes * c.runs
        row["in_collective_matmuls"] += (c.kind == "collective-permute"
                                         and c.implements != c.kind)
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



_ARRAY = re.compile(r"^\w+\[([\d,]*)\]")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_\w+->\w+")
_WINDOW = re.compile(r"window=\{size=([\dx]+)(?: pad=([\d_x]+))?")
_LHS_DILATE = re.compile(r"window=\{[^}]*\blhs_dilate=([\dx]+)")


def _conv_dot(rest: str) -> tuple[list[int], int]:
    """A TPU ``convolution`` that computes a ``dot_general``: (the lhs dimensions it
    contracts, the window positions each output sums over). The lhs's feature dimension
    (``f`` in ``dim_labels``) is contracted; a spatial dimension is contracted over its
    window, save for the two forms in which the TPU compiler writes a batch dimension
    (each output sees one position): a window padded by its size minus one on both
    sides, and an lhs dilated by the window's size. A window over an lhs dilated by ``d``
    sums the ``ceil(size / d)`` positions that are not holes."""
    labels = _DIM_LABELS.search(rest)
    contracting = [labels[1].index("f")] if labels and "f" in labels[1] else []
    window = 1
    if w := _WINDOW.search(rest):
        sizes = _ints(w[1].replace("x", ","))
        pads = w[2].split("x") if w[2] else ["0_0"] * len(sizes)
        dilated = _LHS_DILATE.search(rest)
        dilations = _ints(dilated[1].replace("x", ",")) if dilated else [1] * len(sizes)
        for size, pad, dilation in zip(sizes, pads, dilations, strict=False):
            lo, hi = (int(x) for x in pad.split("_"))
            window *= 1 if (lo, hi) == (size - 1, size - 1) else -(-size // max(dilation, 1))
    return contracting, window


def _dot_flops(module: Module, instr: Instruction) -> int | None:
    """``2 x output elements x contracted size`` of a ``dot`` (or a TPU ``convolution``
    that computes one); None for any other instruction."""
    if instr.op == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
        dims, window = _ints(contracting[1]) if contracting else [], 1
    elif instr.op == "convolution" and "dot_general" in instr.attrs:
        dims, window = _conv_dot(instr.attrs)
    else:
        return None
    lhs = module.by_name.get(instr.operands[0]) if instr.operands else None
    lhs_shape = _ints(a[1]) if lhs is not None and (a := _ARRAY.match(lhs.type)) else None
    out = _ARRAY.match(instr.type)
    k = window * (int(np.prod([lhs_shape[d] for d in dims])) if lhs_shape else 1)
    return 2 * int(np.prod(_ints(out[1]) if out else [0])) * k


def matmul_flops(hlo: str | Module, branch_share: float | None = None) -> dict[str, int]:
    """FLOPs of every ``dot`` in an optimized HLO module, each counted as often as it runs
    in one step.

    XLA's own cost analysis (:func:`flops`) counts a ``while`` loop's body once, so a model
    whose layers run under ``lax.scan`` looks ``n_layers`` times cheaper than it is (the
    TPU compiler writes dots as ``convolution``s: those are counted too, see
    :func:`_conv_dot`). Here a loop body counts its trip count times (read from the loop's
    counter: :func:`jaxpar.analysis.loops.loops`), fusions and calls once per call, and a
    ``conditional`` runs one branch per execution: its costliest, times ``branch_share``
    when given (the share of its executions that do work: a pipeline schedule's busy
    ticks; otherwise every execution is taken to run the costliest branch, an upper
    bound). A dot costs ``2 x output elements x contracted size``.

    Returns ``{"flops", "dots", "loops", "loops_without_trip_count"}``.
    """
    module = parse_module(hlo) if isinstance(hlo, str) else hlo
    found = computation_runs(module).loops
    trips = {lp.name: lp.trips or 1 for lp in found}
    memo: dict[str, int] = {}
    dots = 0

    def total(comp: str, seen: frozenset[str] = frozenset()) -> int:
        nonlocal dots
        if comp in memo:
            return memo[comp]
        out = 0
        for instr in module.computations.get(comp, []):
            own = _dot_flops(module, instr)
            if own is not None:
                dots += 1
                out += own
            branches = []
            for how, callee in called(instr):
                if callee in seen or how in ("condition", "to_apply"):
                    continue
                inner = total(callee, seen | {comp})
                if how == "body":
                    out += trips.get(instr.name, 1) * inner
                elif how in ("branch_computations", "true_computation", "false_computation"):
                    branches.append(inner)
                else:
                    out += inner
            if branches:
                out += round(max(branches) * (1.0 if branch_share is None else branch_share))
        memo[comp] = out
        return out

    flops_total = total(module.entry)
    return {"flops": flops_total, "dots": dots, "loops": len(found),
            "loops_without_trip_count": sum(1 for lp in found if lp.trips is None)}
