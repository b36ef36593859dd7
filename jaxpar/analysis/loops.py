"""How many times each computation of an optimized HLO module runs in one step.

A compiled training step keeps its layers in ``while`` loops (``lax.scan``), so an
instruction written once in the HLO text may run ``n_layers`` times (and a loop nested in
another, the product of both). XLA:CPU records a loop's trip count in its
``backend_config`` (``known_trip_count``); the TPU compiler does not, and it unrolls or
peels loops so that a counter may start at 1 or step by 2. Here the trip count is read
from the loop itself: the induction variable's start (the tuple the ``while`` is given),
its step (what the body adds to it) and its bound (what the condition compares it with),
through the copies, bitcasts and fusions the compiler wraps them in.

:func:`computation_runs` gives every computation's executions per step: the entry once, a
loop body its trip count times its caller's runs, fusions and calls as often as their
caller. A ``conditional``'s branches are counted as often as the conditional (an upper
bound: which branch runs is decided at run time). Loops whose trip count cannot be read
are counted once and listed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_HEADER = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
                    r"(?P<op>[\w\-]+)\((?P<rest>.*)$")
_CALLED = re.compile(r"\b(calls|body|condition|branch_computations|true_computation|"
                     r"false_computation|called_computations|to_apply)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")
_NAME = re.compile(r"%([\w.\-]+)")
_KNOWN_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
TUPLE_INDEX = re.compile(r"\bindex=(\d+)")
"""A ``get-tuple-element``'s element number."""
_DIRECTION = re.compile(r"\bdirection=(\w+)")
PASS_THROUGH = frozenset({"copy", "bitcast", "convert", "reshape", "copy-start", "copy-done",
                          "all-reduce-done", "opt-barrier"})
"""Ops whose result holds their first operand's values (copied, recast or regrouped)."""
_APPLIERS = {"all-reduce", "all-reduce-start", "reduce-scatter", "reduce", "reduce-window",
             "scatter", "select-and-scatter", "sort", "map"}
"""Ops whose ``to_apply`` computation combines elements (not run in their place)."""
_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "EQ": "EQ", "NE": "NE"}


@dataclass
class Instruction:
    """One HLO instruction: its name, result type, opcode, operand names, the text after
    its operands (attributes), and the computation it belongs to."""

    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str
    computation: str
    root: bool = False
    line: str = ""


@dataclass
class Module:
    """An HLO module's computations (name -> instructions in order) and its entry."""

    computations: dict[str, list[Instruction]] = field(default_factory=dict)
    entry: str = ""
    by_name: dict[str, Instruction] = field(default_factory=dict)
    _users: dict[str, list[Instruction]] | None = None
    _runners: dict[str, list[Instruction]] | None = None
    _runs: Runs | None = None

    def users(self, name: str) -> list[Instruction]:
        """The instructions that take ``name`` as an operand."""
        if self._users is None:
            self._users = {}
            for instrs in self.computations.values():
                for instr in instrs:
                    for operand in instr.operands:
                        self._users.setdefault(operand, []).append(instr)
        return self._users.get(name, [])

    def runners(self, computation: str) -> list[Instruction]:
        """The instructions that run ``computation`` in their place: fusions, calls and
        async starts (not the collectives and reductions that apply it to elements)."""
        if self._runners is None:
            self._runners = {}
            for instrs in self.computations.values():
                for instr in instrs:
                    if instr.op in _APPLIERS:
                        continue
                    for how, callee in called(instr):
                        if how in ("calls", "to_apply"):
                            self._runners.setdefault(callee, []).append(instr)
        return self._runners.get(computation, [])

    def root(self, computation: str) -> Instruction | None:
        """The ROOT instruction of ``computation``."""
        for instr in self.computations.get(computation, []):
            if instr.root:
                return instr
        return None

    def parameter(self, computation: str, number: int) -> Instruction | None:
        """``parameter(number)`` of ``computation``."""
        for instr in self.computations.get(computation, []):
            if instr.op == "parameter" and instr.attrs.startswith(f"{number})"):
                return instr
        return None


def _split_operands(rest: str) -> tuple[list[str], str]:
    """The operand names at the top level of an instruction's argument list, and the
    attributes after its closing parenthesis."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                return _NAME.findall(rest[:i]), rest[i + 1:]
            depth -= 1
    return _NAME.findall(rest), ""


def parse_module(hlo_text: str) -> Module:
    """The computations and instructions of an HLO module's text."""
    module = Module()
    comp = ""  # instructions before any computation's header (a fragment) go under ""
    for line in hlo_text.splitlines():
        if m := _HEADER.match(line):
            comp = m["name"]
            module.computations[comp] = []
            if m[1]:
                module.entry = comp
            continue
        if not (m := _INSTR.match(line)):
            continue
        if m["op"] == "parameter" or m["op"] == "constant":
            operands, attrs = [], m["rest"]
        else:
            operands, attrs = _split_operands(m["rest"])
        instr = Instruction(m["name"], m["type"], m["op"], operands, attrs, comp,
                            bool(m["root"]), line.strip())
        module.computations.setdefault(comp, []).append(instr)
        module.by_name[instr.name] = instr
    return module


def called(instr: Instruction) -> list[tuple[str, str]]:
    """(how, computation) for each computation an instruction calls."""
    return [(how, callee) for how, target in _CALLED.findall(instr.attrs)
            for callee in re.findall(r"%?([\w.\-]+)", target)]


def _source(module: Module, name: str, env: dict[str, str]) -> Instruction | None:
    """What ``name`` is, seen through copies, bitcasts and conversions, and through a
    parameter to the operand it is bound to (in ``env``, or by the one instruction that
    runs its computation: a fusion, a call, an async start)."""
    for _ in range(64):
        instr = module.by_name.get(name)
        if instr is None:
            return None
        if instr.op in PASS_THROUGH and instr.operands:
            name = instr.operands[0]
        elif instr.op == "parameter" and name in env:
            name = env[name]
        elif instr.op == "parameter":
            number = re.match(r"(\d+)\)", instr.attrs)
            runners = module.runners(instr.computation)
            if not number or len(runners) != 1 or int(number[1]) >= len(runners[0].operands):
                return instr
            name = runners[0].operands[int(number[1])]
        else:
            return instr
    return None


def _integer(module: Module, name: str, env: dict[str, str]) -> int | None:
    """The integer constant ``name`` holds, or None."""
    instr = _source(module, name, env)
    if instr is not None and instr.op == "constant" and re.match(r"[su]\d+\[\]", instr.type):
        found = re.match(r"(-?\d+)\)", instr.attrs)
        return int(found[1]) if found else None
    return None


def parameter_element(module: Module, name: str, env: dict[str, str] | None = None
                      ) -> int | None:
    """Which element of its computation's tuple parameter ``name`` is (through copies,
    and fusion parameters bound in ``env``), or None when it is something else."""
    instr = _source(module, name, env or {})
    if instr is not None and instr.op == "get-tuple-element" and instr.operands:
        source = module.by_name.get(instr.operands[0])
        index = TUPLE_INDEX.search(instr.attrs)
        if source is not None and source.op == "parameter" and index:
            return int(index[1])
    return None


def _through_fusion(module: Module, name: str, env: dict[str, str]
                    ) -> tuple[Instruction | None, dict[str, str]]:
    """The instruction that computes ``name``: a fusion's root, with the fused
    computation's parameters bound to the fusion's operands."""
    instr = _source(module, name, env)
    for _ in range(8):
        if instr is None or instr.op != "fusion":
            return instr, env
        callee = next((c for how, c in called(instr) if how == "calls"), None)
        root = module.root(callee) if callee else None
        if root is None:
            return None, env
        env = dict(env)
        for number, operand in enumerate(instr.operands):
            param = module.parameter(callee, number)
            if param is not None:
                env[param.name] = operand
        instr = _source(module, root.name, env)
    return None, env


def producer(module: Module, name: str) -> Instruction | None:
    """What computes ``name``: seen through copies, bitcasts and conversions, through a
    parameter to the operand of the one instruction that runs its computation, and into a
    fusion's root."""
    return _through_fusion(module, name, {})[0]


@dataclass(frozen=True)
class Loop:
    """A ``while`` instruction: the computation holding it, its body, and its trip count
    (None when it cannot be read), with how it was read (``xla``: XLA's
    ``known_trip_count``; ``induction``: start, step and bound of the counter)."""

    name: str
    computation: str
    body: str
    trips: int | None
    how: str
    start: int | None = None
    step: int | None = None
    bound: int | None = None


def _count(start: int, step: int, bound: int, direction: str) -> int | None:
    """Trips of ``for (i = start; i <direction> bound; i += step)``."""
    if step == 0:
        return None
    if direction in ("LT", "LE") and step > 0:
        span = bound - start + (1 if direction == "LE" else 0)
        return max(0, math.ceil(span / step))
    if direction in ("GT", "GE") and step < 0:
        span = start - bound + (1 if direction == "GE" else 0)
        return max(0, math.ceil(span / -step))
    if direction == "NE" and (bound - start) % step == 0 and (bound - start) // step >= 0:
        return (bound - start) // step
    return None


def _induction(module: Module, loop: Instruction, body: str, condition: str
               ) -> tuple[int, int, int, str] | None:
    """(start, step, bound, direction) of the loop's counter, read from its condition
    (``counter <direction> constant``), its body (``counter + constant``) and the tuple
    it starts from."""
    compare, env = _through_fusion(module, (module.root(condition) or loop).name, {})
    if compare is None or compare.op != "compare" or len(compare.operands) != 2:
        return None
    direction = _DIRECTION.search(compare.attrs)
    if not direction:
        return None
    lhs, rhs = compare.operands
    index, bound, way = (parameter_element(module, lhs, env), _integer(module, rhs, env),
                         direction[1])
    if index is None or bound is None:
        index, bound, way = (parameter_element(module, rhs, env), _integer(module, lhs, env),
                             _FLIP[way])
    if index is None or bound is None:
        return None
    update = module.root(body)
    if update is None or update.op != "tuple" or index >= len(update.operands):
        return None
    add, env = _through_fusion(module, update.operands[index], {})
    if add is None or add.op not in ("add", "subtract") or len(add.operands) != 2:
        return None
    a, b = add.operands
    step = None
    if parameter_element(module, a, env) == index:
        step = _integer(module, b, env)
    elif add.op == "add" and parameter_element(module, b, env) == index:
        step = _integer(module, a, env)
    if step is None:
        return None
    step = -step if add.op == "subtract" else step
    init = _source(module, loop.operands[0], {}) if loop.operands else None
    if init is None or init.op != "tuple" or index >= len(init.operands):
        return None
    start = _integer(module, init.operands[index], {})
    return None if start is None else (start, step, bound, way)


def loops(module: Module) -> list[Loop]:
    """Every ``while`` loop of the module with its trip count."""
    out = []
    for comp, instrs in module.computations.items():
        for instr in instrs:
            if instr.op != "while":
                continue
            callees = dict(called(instr))
            body, condition = callees.get("body", ""), callees.get("condition", "")
            if known := _KNOWN_TRIP.search(instr.attrs):
                out.append(Loop(instr.name, comp, body, int(known[1]), "xla"))
                continue
            found = _induction(module, instr, body, condition)
            trips = _count(*found) if found else None
            out.append(Loop(instr.name, comp, body, trips,
                            "induction" if trips is not None else "unknown",
                            *(found[:3] if found else ())))
    return out


@dataclass
class Runs:
    """Executions per step of each computation (``runs``), and the loops read."""

    runs: dict[str, int]
    loops: list[Loop]

    @property
    def unknown(self) -> list[Loop]:
        """Loops whose trip count could not be read (their bodies are counted once)."""
        return [lp for lp in self.loops if lp.trips is None]


def computation_runs(module: Module | str) -> Runs:
    """How many times each computation runs in one execution of the module's entry
    (worked out once per :class:`Module`)."""
    if isinstance(module, str):
        module = parse_module(module)
    if module._runs is not None:
        return module._runs
    found = loops(module)
    trips = {lp.name: lp.trips for lp in found}
    callers: dict[str, list[tuple[str, int]]] = {}
    for comp, instrs in module.computations.items():
        for instr in instrs:
            for how, callee in called(instr):
                if how == "body":
                    factor = trips.get(instr.name) or 1
                elif how == "condition":
                    factor = (trips.get(instr.name) or 0) + 1
                else:
                    factor = 1
                callers.setdefault(callee, []).append((comp, factor))
    runs: dict[str, int] = {}

    def times(name: str, seen: frozenset[str]) -> int:
        if name == module.entry:
            return 1
        if name not in runs:
            runs[name] = sum(times(c, seen | {name}) * f
                             for c, f in callers.get(name, []) if c not in seen)
        return runs[name]

    for comp in module.computations:
        times(comp, frozenset())
    runs[module.entry] = 1
    module._runs = Runs(runs, found)
    return module._runs
