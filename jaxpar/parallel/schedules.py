"""1F1B and interleaved 1F1B pipeline schedules in SPMD JAX, with the backward pass inside.

The GPipe and circular pipeline of :mod:`jaxpar.parallel.pipeline` runs the forward pass
over all ``m`` microbatches and lets ``jax.grad`` run it backwards, so every stage keeps
the activations of all ``m`` microbatches. Here the backward pass is part of the schedule:
each stage runs, tick by tick, at most one forward and one backward (microbatch, chunk),
computes its own VJP, and frees the microbatch's stored input as soon as its backward is
done. With PipeDream-flush's one-forward-one-backward order (1F1B) a stage holds at most
``p`` microbatches' inputs however large ``m`` is; Megatron PTD-P's interleaved variant
gives each stage ``v`` chunks of layers and cuts the bubble to ``(p - 1) / (v * m)``.

Two parts:

* **The tick table** (pure Python, :func:`timeline`): for ``p`` stages, ``m``
  microbatches and ``v`` chunks per stage, which (microbatch, chunk) each stage runs
  forwards and backwards at each tick. A tick is one chunk-forward or one chunk-backward
  of one microbatch; forward and backward are counted as equally long. Each stage works
  through its own list of operations in order, running the next one as soon as its inputs
  exist (its predecessor ran one tick earlier at least), so the table is as tight as the
  order allows. Every schedule here takes ``2 * (m * v + p - 1)`` ticks, of which each
  stage is busy for ``2 * m * v`` and idle for ``2 * (p - 1)``: the bubble (idle over busy
  ticks) is ``(p - 1) / (v * m)``. The schedules differ in memory, not in time.

* **The executor** (:func:`pipeline_value_and_grad`): the table, compiled into per-stage
  index arrays (gathered by ``lax.axis_index``), drives one ``lax.scan`` over ticks inside
  ``jax.shard_map`` over the ``stage`` axis; other mesh axes stay automatic (GSPMD) or
  split the batch by hand (``batch_axes``). Each tick a stage runs its forward or its
  backward, then activations move one stage on and activation gradients one stage back by
  ``lax.ppermute``. When every other mesh axis is manual or of size 1, a ``lax.switch`` on
  the stage's own work runs only the branch it needs. Otherwise the stages run in
  lockstep: GSPMD puts collectives over the automatic axes (``fsdp``, ``tensor``) inside
  the work, and a collective that the stages reach in different branches never meets (a
  ``collective-permute`` spans every device); so every stage runs one and the same
  computation, a backward (forward recomputed, VJP) on its own forward's or backward's
  operands, whose results it keeps only as far as its work needs (see
  :func:`pipeline_value_and_grad`'s ``lockstep``). A backward
  recomputes its chunk from the stored input (``jax.vjp``) and pulls back the gradient
  that came from the next stage; the last chunk's backward runs head and loss instead,
  so its forward is folded into it. Stored inputs and arriving gradients live in two
  buffers with as many slots as the table needs at once: ``p`` and 1 for 1F1B, ``m`` and
  1 for GPipe. Weight gradients accumulate per stage, and :func:`pipelined_loss` wraps it
  all in a ``jax.custom_vjp``, so ``jax.value_and_grad`` of a whole model's loss takes
  its gradients from the schedule.

Parameter layout: a model of ``n = v * p * L`` layers (``L`` layers per chunk) is stored
as ``(v * L, p, ...)``: virtual stage ``k = c * p + s`` (chunk ``c`` of stage ``s``)
holds layers ``k * L, ..., k * L + L - 1`` at ``[c * L + j, s]``. With ``L = 1`` this is
the ``(repeat, stage, ...)`` layout of :func:`jaxpar.parallel.pipeline.to_pipeline_layout`;
with ``v = 1`` each stage holds a contiguous block. :func:`to_schedule_layout` converts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.errors import JaxparError

KINDS: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
Work = tuple[int, int]
"""One unit of work on a stage: ``(microbatch, chunk)``."""
_FIELDS = ("f_kind", "f_mb", "f_chunk", "f_slot", "b_kind", "b_mb", "b_chunk", "b_slot",
           "b_gslot", "ra_on", "ra_slot", "rg_on", "rg_slot")


# --- The tick table --------------------------------------------------------------------
def _check(kind: str, stages: int, microbatches: int, virtual: int) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches),
                        ("virtual", virtual)):
        if int(value) != value or value < 1:
            raise JaxparError(f"pipeline {name} must be a positive integer, got {value!r}")
    if kind not in KINDS:
        raise JaxparError(f"unknown pipeline schedule {kind!r}; use one of {', '.join(KINDS)}")
    if kind == "1f1b" and virtual != 1:
        raise JaxparError(f"schedule 1f1b runs one chunk per stage, got virtual={virtual}; "
                          "use interleaved_1f1b")
    if kind == "gpipe" and virtual > 1 and microbatches < stages:
        raise JaxparError(f"a circular gpipe schedule (virtual={virtual}) needs microbatches "
                          f">= stages, got microbatches={microbatches}, stages={stages}")
    if kind == "interleaved_1f1b" and microbatches % stages:
        raise JaxparError(f"interleaved_1f1b needs microbatches divisible by stages, got "
                          f"microbatches={microbatches}, stages={stages}")


def _stage_order(kind: str, p: int, m: int, v: int, s: int) -> list[tuple[str, int, int]]:
    """Stage ``s``'s operations in the order it runs them: ``("F" | "B", mb, chunk)``."""
    total = m * v
    if kind == "gpipe":  # every forward (chunk by chunk), then every backward
        fwd = [("F", k % m, k // m) for k in range(total)]
        return fwd + [("B", k % m, v - 1 - k // m) for k in range(total)]
    # Megatron's order: microbatches go in groups of p, each group through chunk 0, 1, ...
    # forwards, through chunk v - 1, ..., 0 backwards. Warm-up forwards fill the pipeline,
    # then one forward and one backward alternate, then cool-down backwards drain it.
    def work(k: int, forward: bool) -> Work:
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk

    warmup = min(total, 2 * (p - s - 1) + (v - 1) * p if v > 1 else p - s - 1)
    ops = [("F", *work(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [("F", *work(warmup + k, True)), ("B", *work(k, False))]
    return ops + [("B", *work(k, False)) for k in range(total - warmup, total)]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """What every stage runs at every tick, and what that costs.

    ``forward[t][s]`` and ``backward[t][s]`` are the ``(microbatch, chunk)`` stage ``s``
    runs forwards / backwards at tick ``t``, or ``None``. The data flow: the forward of
    ``(i, c)`` on stage ``s`` takes the output of ``(i, c)`` on stage ``s - 1`` (of
    ``(i, c - 1)`` on the last stage when ``s = 0``; the pipeline input for ``(i, 0)`` on
    stage 0); backwards run the other way, the last chunk of the last stage starting from
    the loss.
    """

    kind: str
    stages: int
    microbatches: int
    virtual: int
    forward: tuple[tuple[Work | None, ...], ...]
    backward: tuple[tuple[Work | None, ...], ...]

    @property
    def ticks(self) -> int:
        """Length of the schedule in ticks."""
        return len(self.forward)

    def when(self, direction: str) -> dict[tuple[int, int, int], int]:
        """``{(microbatch, chunk, stage): tick}`` of every forward (``"F"``) or backward."""
        rows = self.forward if direction == "F" else self.backward
        return {(*w, s): t for t, row in enumerate(rows) for s, w in enumerate(row) if w}

    def idle_ticks(self) -> list[int]:
        """Per stage, the ticks on which it runs neither a forward nor a backward."""
        return [sum(f is None and b is None for f, b in
                    zip((r[s] for r in self.forward), (r[s] for r in self.backward),
                        strict=True)) for s in range(self.stages)]

    def bubble(self) -> float:
        """Measured bubble: idle stage-ticks over busy stage-ticks (see :func:`bubble`)."""
        busy = 2 * self.stages * self.microbatches * self.virtual
        return sum(self.idle_ticks()) / busy

    def _producer(self, i: int, c: int, s: int) -> tuple[int, int, int] | None:
        if s > 0:
            return i, c, s - 1
        return (i, c - 1, self.stages - 1) if c > 0 else None

    def _consumer(self, i: int, c: int, s: int) -> tuple[int, int, int] | None:
        if s < self.stages - 1:
            return i, c, s + 1
        return (i, c + 1, 0) if c < self.virtual - 1 else None

    def _held(self, what: str) -> dict[tuple[int, int, int], tuple[int, int]]:
        """``{(i, c, s): (first, last)}``: ticks over which stage ``s`` keeps the input
        (``what="act"``) or the incoming gradient (``"grad"``) of ``(i, c)``, from the tick
        after its sender ran to its backward. The pipeline input (chunk 0 on stage 0) is
        not kept: it is read from ``x`` again. The loss makes the last chunk's gradient."""
        fwd, bwd = self.when("F"), self.when("B")
        if what == "act":
            return {key: (fwd[src] + 1, bwd[key]) for key in fwd
                    if (src := self._producer(*key)) is not None}
        return {key: (bwd[src] + 1, bwd[key]) for key in bwd
                if (src := self._consumer(*key)) is not None}

    def in_flight(self) -> list[int]:
        """Per stage, the peak number of (microbatch, chunk) whose forward has run and whose
        backward has not finished (counting the tick of the backward): the inputs, i.e.
        residuals, the stage must hold."""
        fwd, bwd = self.when("F"), self.when("B")
        peak = [0] * self.stages
        for s in range(self.stages):
            spans = [(fwd[k], bwd[k]) for k in fwd if k[2] == s]
            peak[s] = max(sum(a <= t <= b for a, b in spans) for t in range(self.ticks))
        return peak

    def slots(self, what: str = "act") -> tuple[dict[tuple[int, int, int], int], int]:
        """A buffer slot for every kept input (``what="act"``) or incoming gradient
        (``"grad"``): ``({(i, c, s): slot}, slots_per_stage)``.

        An input that arrives before its forward runs holds its slot from arrival, so
        ``slots_per_stage`` may exceed :meth:`in_flight`. Slots are given in order of
        arrival, each to the lowest free one (optimal for intervals)."""
        assigned, n_slots, held = {}, 0, self._held(what)
        for s in range(self.stages):
            ends: list[int] = []  # last tick each slot is in use
            spans = sorted((span, key) for key, span in held.items() if key[2] == s)
            for (first, last), key in spans:
                free = [k for k, end in enumerate(ends) if end < first]
                slot = free[0] if free else len(ends)
                if not free:
                    ends.append(last)
                ends[slot] = last
                assigned[key] = slot
            n_slots = max(n_slots, len(ends))
        return assigned, n_slots

    def render(self) -> str:
        """The timeline as text: one row per stage, one column per tick.

        ``F3`` / ``B3`` is microbatch 3's forward / backward (``F3.1``: of chunk 1 when
        ``v > 1``), ``.`` an idle tick."""
        def cell(t: int, s: int) -> str:
            parts = []
            for tag, w in (("F", self.forward[t][s]), ("B", self.backward[t][s])):
                if w:
                    parts.append(f"{tag}{w[0]}" + (f".{w[1]}" if self.virtual > 1 else ""))
            return "".join(parts) or "."

        cells = [[cell(t, s) for t in range(self.ticks)] for s in range(self.stages)]
        width = max(len(c) for row in cells for c in row)
        head = (f"{self.kind}: p={self.stages} m={self.microbatches} v={self.virtual}, "
                f"{self.ticks} ticks, bubble {100 * self.bubble():.1f}%")
        return "\n".join([head] + [f"stage {s}: " + " ".join(c.ljust(width) for c in row)
                                   for s, row in enumerate(cells)])

    def tables(self) -> dict[str, np.ndarray]:
        """The executor's index arrays, each ``(ticks, stages)`` int32.

        ``f_kind``: 0 no forward to run (none, or the last chunk's, which its backward
        recomputes), 1 one on a stored input, 2 one on the pipeline input. ``b_kind``: 0 no
        backward, else ``1 + first + 2 * last`` for a backward of the first / last virtual
        stage. ``*_mb, *_chunk, *_slot, b_gslot``: the work, the slots of its input and
        of its incoming gradient. ``ra_on, ra_slot`` / ``rg_on, rg_slot``: whether the
        activation / gradient sent on at the end of the tick is for this stage, and the
        slot that keeps it."""
        act, _ = self.slots("act")
        grad, _ = self.slots("grad")
        out = {k: np.zeros((self.ticks, self.stages), np.int32) for k in _FIELDS}
        for d, rows in (("f", self.forward), ("b", self.backward)):
            for t, row in enumerate(rows):
                for s, w in enumerate(row):
                    if w is None:
                        continue
                    key = (*w, s)
                    prod, cons = self._producer(*key), self._consumer(*key)
                    if d == "f":
                        kind = 0 if cons is None else 2 if prod is None else 1
                    else:
                        kind = 1 + (prod is None) + 2 * (cons is None)
                    for name, value in (("kind", kind), ("mb", w[0]), ("chunk", w[1]),
                                        ("slot", act.get(key, 0)), ("gslot", grad.get(key, 0))):
                        if name != "gslot" or d == "b":
                            out[f"{d}_{name}"][t, s] = value
                    target, r, slot = (cons, "ra", act) if d == "f" else (prod, "rg", grad)
                    if target is not None:
                        out[f"{r}_on"][t, target[2]] = 1
                        out[f"{r}_slot"][t, target[2]] = slot[target]
        return out


@functools.cache
def timeline(kind: str, stages: int, microbatches: int, virtual: int = 1) -> Timeline:
    """The tick table of schedule ``kind`` (``gpipe``, ``1f1b``, ``interleaved_1f1b``).

    Each stage runs its operations (:func:`_stage_order`) in order, one per tick, each as
    soon as what it needs was made on an earlier tick: a forward, its predecessor's
    forward; a backward, the stage's own forward and the successor's backward.

    Raises:
      JaxparError: for a bad size, ``1f1b`` with ``virtual > 1``, or ``interleaved_1f1b``
        with ``microbatches`` not a multiple of ``stages``.
    """
    _check(kind, stages, microbatches, virtual)
    p, m, v = stages, microbatches, virtual
    orders = [_stage_order(kind, p, m, v, s) for s in range(p)]
    shell = Timeline(kind, p, m, v, (), ())
    done: dict[tuple[str, int, int, int], int] = {}
    nxt, fwd_rows, bwd_rows = [0] * p, [], []
    while any(n < len(o) for n, o in zip(nxt, orders, strict=True)):
        t = len(fwd_rows)
        fwd_row: list[Work | None] = [None] * p
        bwd_row: list[Work | None] = [None] * p
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            d, i, c = orders[s][nxt[s]]
            if d == "F":
                needs = [("F", shell._producer(i, c, s))]
            else:
                needs = [("F", (i, c, s)), ("B", shell._consumer(i, c, s))]
            if all(k is None or done.get((tag, *k), t) < t for tag, k in needs):
                (fwd_row if d == "F" else bwd_row)[s] = (i, c)
                nxt[s] += 1
        for s in range(p):
            for d, row in (("F", fwd_row), ("B", bwd_row)):
                if row[s]:
                    done[(d, *row[s], s)] = t
        if not any(fwd_row) and not any(bwd_row):
            raise JaxparError(f"schedule {kind} deadlocks for p={p}, m={m}, v={v}")
        fwd_rows.append(tuple(fwd_row))
        bwd_rows.append(tuple(bwd_row))
    return Timeline(kind, p, m, v, tuple(fwd_rows), tuple(bwd_rows))


def ticks(stages: int, microbatches: int, virtual: int = 1) -> int:
    """Ticks of every schedule here: ``2 * (m * v + p - 1)``."""
    return 2 * (microbatches * virtual + stages - 1)


def idle_ticks(stages: int, microbatches: int = 1, virtual: int = 1) -> int:
    """Idle ticks of each stage: ``2 * (p - 1)`` (``p - 1`` forward and ``p - 1`` backward
    slots), whatever ``m`` and ``v``."""
    return 2 * (stages - 1)


def bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Bubble as idle over busy stage-ticks: ``(p - 1) / (v * m)`` (Megatron's measure; as
    a fraction of the whole step it is ``(p - 1) / (v * m + p - 1)``)."""
    return (stages - 1) / (virtual * microbatches)


def peak_in_flight(kind: str, stages: int, microbatches: int, virtual: int = 1) -> int:
    """Peak (microbatch, chunk) inputs a stage holds (stage 0, the worst): ``m * v`` for
    GPipe, ``min(m, p)`` for 1F1B, ``min(m * v, (v + 1) * p - 1)`` interleaved (its
    warm-up is ``2 * (p - 1) + (v - 1) * p`` forwards). An interleaved chunk has ``1 / v``
    of a stage's layers: with per-layer residuals that is ``1 + (p - 1) / (v * p)`` times
    1F1B's memory, with the chunk inputs the executor keeps about ``v + 1`` times."""
    _check(kind, stages, microbatches, virtual)
    if kind == "gpipe":
        return microbatches * virtual
    if virtual == 1:
        return min(microbatches, stages)
    return min(microbatches * virtual, (virtual + 1) * stages - 1)


# --- Parameter layout ------------------------------------------------------------------
def to_schedule_layout(tree: Any, stages: int, virtual: int = 1) -> Any:
    """Restack every ``(n_layers, ...)`` leaf as ``(v * L, p, ...)``: layer
    ``(c * p + s) * L + j`` lands at ``[c * L + j, s]`` (``L = n_layers / (v * p)``; see
    :func:`stack_layers`).

    Raises:
      JaxparError: when a leaf's layer count is not a multiple of ``stages * virtual``.
    """
    def one(a: jax.Array) -> jax.Array:
        if a.ndim < 1 or a.shape[0] % (stages * virtual):
            raise JaxparError(f"a stacked leaf of shape {a.shape} does not split into "
                              f"{stages} stages x {virtual} chunks")
        return stack_layers(a, stages, a.shape[0] // (stages * virtual))

    return jax.tree.map(one, tree)


def from_schedule_layout(tree: Any, virtual: int = 1) -> Any:
    """Inverse of :func:`to_schedule_layout`: ``(v * L, p, ...)`` -> ``(n_layers, ...)``."""
    return jax.tree.map(lambda a: unstack_layers(a, a.shape[0] // virtual), tree)


def stack_layers(value: Any, stages: int, layers_per_stage: int = 1) -> Any:
    """One array ``(n, ...)`` of stacked layers as ``(n // stages, stages, ...)``: layer
    ``(c * S + s) * L + j`` at ``[c * L + j, s]`` (``L = layers_per_stage``); a pure
    reshape when ``L = 1``. The storage layout of every pipeline schedule
    (:func:`jaxpar.parallel.pipeline.to_pipeline_layout`)."""
    n, per = value.shape[0], layers_per_stage
    if per == 1:
        return value.reshape(n // stages, stages, *value.shape[1:])
    value = value.reshape(n // (stages * per), stages, per, *value.shape[1:]).swapaxes(1, 2)
    return value.reshape(n // stages, stages, *value.shape[3:])


def unstack_layers(value: Any, layers_per_stage: int = 1) -> Any:
    """Inverse of :func:`stack_layers`: ``(rows, stages, ...)`` -> ``(layers, ...)``."""
    rows, stages, per = value.shape[0], value.shape[1], layers_per_stage
    if per > 1:
        value = value.reshape(rows // per, per, stages, *value.shape[2:]).swapaxes(1, 2)
    return value.reshape(rows * stages, *value.shape[(3 if per > 1 else 2):])


# --- The executor ----------------------------------------------------------------------
def _resolve(schedule: str | Timeline, stages: int, microbatches: int | None,
             virtual: int) -> Timeline:
    if isinstance(schedule, Timeline):
        tl = schedule
    else:
        if microbatches is None:
            raise JaxparError("pass microbatches=, or a Timeline as schedule=")
        tl = timeline(schedule, stages, microbatches, virtual)
    if tl.stages != stages:
        raise JaxparError(f"the schedule has {tl.stages} stages, the mesh's stage axis "
                          f"{stages}")
    return tl


def _lockstep_variants(tabs: dict[str, np.ndarray], embedded: bool
                       ) -> tuple[list[tuple[bool, bool, bool]], np.ndarray]:
    """The computations a lockstep executor runs, and which one at each tick: ``(variants,
    index per tick)``, a variant ``(grad, head, embed)``: a VJP (a backward somewhere),
    the head and loss (the last chunk's backward somewhere), the embedding (a stage starts
    from the pipeline input, with ``embed_fn``).

    Raises:
      JaxparError: for a timeline with a forward and a backward on one stage in one tick.
    """
    fwd, bwd = tabs["f_kind"] > 0, tabs["b_kind"] > 0
    if (fwd & bwd).any():
        raise JaxparError("the schedule runs a forward and a backward on one stage in one "
                          "tick, which a lockstep executor cannot: pass lockstep=False, or "
                          "one operation per stage and tick")
    from_x = (tabs["f_kind"] == 2) | np.isin(tabs["b_kind"], (2, 4))
    keys = [(bool(b), bool(h), bool(embedded and e)) for b, h, e in zip(
        bwd.any(1), (tabs["b_kind"] >= 3).any(1), from_x.any(1), strict=True)]
    variants = sorted(set(keys))
    return variants, np.array([variants.index(k) for k in keys], np.int32)


def runs_lockstep(mesh: Mesh, stage_axis: str = "stage", batch_axes: tuple[str, ...] = ()
                  ) -> bool:
    """Whether :func:`pipeline_value_and_grad` runs its stages in lockstep by default: a
    mesh axis other than ``stage_axis`` and ``batch_axes`` has more than one device."""
    manual = (stage_axis, *batch_axes)
    return any(n > 1 for a, n in mesh.shape.items() if a not in manual)


def pipeline_value_and_grad(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: Any,
    loss_fn: Callable[[Any, jax.Array, Any], jax.Array],
    head_params: Any,
    targets: Any,
    *,
    mesh: Mesh,
    schedule: str | Timeline = "1f1b",
    microbatches: int | None = None,
    virtual: int = 1,
    embed_fn: Callable[[Any, Any], jax.Array] | None = None,
    embed_params: Any = None,
    stage_axis: str = "stage",
    batch_axes: tuple[str, ...] = (),
    unroll: int | bool = 1,
    lockstep: bool | None = None,
) -> tuple[jax.Array, Any, Any, Any]:
    """Loss and gradients of a pipelined layer stack, forward and backward run by a schedule.

    The loss is ``mean_i loss_fn(head_params, layers(h_i), targets_i)`` over microbatches
    ``i`` (rows ``i, i + m, i + 2m, ...`` of ``x`` and ``targets``), where ``h_i`` is
    ``x_i``, or ``embed_fn(embed_params, x_i)``, and ``layers`` applies the ``n`` layers
    in order, ``stage_fn(layer_params, h)`` each.

    Args:
      stage_fn: ``stage_fn(layer_params, h) -> h`` for one layer.
      params: pytree of leaves ``(v * L, p, ...)`` (:func:`to_schedule_layout`), whose
        ``p`` axis is (or will be) sharded over ``stage_axis``.
      x: pipeline input, pytree of arrays with leading dimension ``batch``, a multiple of
        ``m``; a single array unless ``embed_fn`` is given.
      loss_fn: ``loss_fn(head_params, y, targets_i) -> scalar`` for one microbatch, run on
        the last stage after the last layer (the head and the loss).
      head_params: pytree of the head's parameters, replicated over ``stage_axis``.
      targets: pytree of arrays with leading dimension ``batch``, split like ``x``.
      mesh: the mesh; ``stage_axis`` must have size ``p``. Other axes stay automatic
        (GSPMD): shard ``x`` and ``targets`` over them for data parallelism.
      schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, or a :class:`Timeline`.
      microbatches, virtual: ``m`` and ``v``, when ``schedule`` is a name.
      embed_fn: optional ``embed_fn(embed_params, x_i) -> h`` run on stage 0 before the
        first layer (an embedding lookup, say). Then the input gradient is never built
        for the whole batch: its VJP is applied per microbatch on stage 0.
      embed_params: the parameters of ``embed_fn``, replicated over ``stage_axis``.
      batch_axes: mesh axes over which the microbatches' rows are split by hand (data
        parallelism inside the ``shard_map``): gradients are then summed over them once,
        after the schedule, instead of in every backward, as GSPMD does for axes left
        automatic. Parameters must be replicated over them.
      unroll: passed to the ``lax.scan`` over ticks.
      lockstep: run every stage through the same computation each tick (``True``), or
        only the work of its own stage, chosen by a ``lax.switch`` (``False``). ``None``:
        lockstep when a mesh axis other than ``stage_axis`` and ``batch_axes`` has more
        than one device. GSPMD then places collectives over that axis inside each stage's
        work (weight gathers, tensor-parallel reductions and reshards); stages running
        different branches would issue different collectives, and a ``collective-permute``
        (a tensor-sharded fused q/k/v split, say) waits for every device, so the step
        deadlocks. In lockstep each tick runs one chunk with its VJP on every stage (the
        forward alone on ticks without a backward anywhere, the head and loss only on
        ticks where the last chunk's backward runs), a stage's own forward taking the
        primal output; a tick lasts as long as its slowest stage either way, so it costs
        devices idle time, not time, but more work where devices share processors (the
        simulated CPU devices).

    Returns:
      ``(loss, param_grads, head_grads, input_grads)``: the mean loss and the gradients of
      ``params`` (same layout), ``head_params``, and of ``x`` (``embed_params`` when
      ``embed_fn`` is given).
    """
    leaves = jax.tree.leaves(params)
    p = int(mesh.shape[stage_axis])
    if not leaves or any(a.ndim < 2 or a.shape[:2] != leaves[0].shape[:2] for a in leaves):
        raise JaxparError("pipeline params must all lead with (chunks x layers, stages), got "
                          f"{sorted({tuple(a.shape) for a in leaves})}")
    tl = _resolve(schedule, p, microbatches, virtual)
    m, v, rows = tl.microbatches, tl.virtual, int(leaves[0].shape[0])
    if leaves[0].shape[1] != p or rows % v:
        raise JaxparError(f"params lead with {leaves[0].shape[:2]}, expected (v * L, {p}) "
                          f"with v={v}")
    per, batch = rows // v, jax.tree.leaves(x)[0].shape[0]
    if batch % m:
        raise JaxparError(f"batch size {batch} is not divisible by {m} microbatches")
    mb, shards = batch // m, int(np.prod([mesh.shape[a] for a in batch_axes]))
    if mb % shards:
        raise JaxparError(f"microbatch size {mb} is not divisible by the {shards} devices "
                          f"of batch_axes {batch_axes}")
    embed = embed_fn or (lambda _, xi: xi)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((mb // shards, *a.shape[1:]), a.dtype),
                       x)
    h_aval = jax.eval_shape(embed, embed_params, one)
    (_, n_act), (_, n_grad) = tl.slots("act"), tl.slots("grad")
    tabs = tl.tables()
    manual = (stage_axis, *batch_axes)
    if lockstep is None:
        lockstep = runs_lockstep(mesh, stage_axis, batch_axes)
    if lockstep:
        variants, steps = _lockstep_variants(tabs, embed_fn is not None)
    # Only the backward variants that occur are compiled; b_kind becomes a branch index.
    kinds = sorted(set(np.unique(tabs["b_kind"])) - {0})
    tabs["b_kind"] = np.searchsorted([0, *kinds], tabs["b_kind"]).astype(np.int32)
    table = np.stack([tabs[k] for k in _FIELDS], axis=-1)  # (ticks, p, fields)
    # Microbatch i is rows i, i + m, ...: a batch sharded in blocks over the data axes
    # splits every microbatch evenly over them, and the reshape is free.
    split = lambda t: jax.tree.map(lambda a: a.reshape(mb, m, *a.shape[1:]), t)
    ring = range(p if v > 1 else p - 1)
    fwd_perm = [(s, (s + 1) % p) for s in ring]
    bwd_perm = [((s + 1) % p, s) for s in ring]

    def run_chunk(pc: Any, h: jax.Array) -> jax.Array:
        if per == 1:
            return stage_fn(jax.tree.map(lambda a: a[0], pc), h).astype(h.dtype)
        return jax.lax.scan(lambda h, lp: (stage_fn(lp, h).astype(h.dtype), None), h, pc)[0]

    def per_stage(params, head_params, embed_params, xs, ts):
        s = jax.lax.axis_index(stage_axis)
        def vary(tree: Any) -> Any:  # make device-varying over every manual axis
            def one(a):
                missing = tuple(set(manual) - jax.typeof(a).manual_axis_type.varying)
                return jax.lax.pcast(a, missing, to="varying") if missing else a
            return jax.tree.map(one, tree)

        take = lambda buf, k, axis=0: jax.lax.dynamic_index_in_dim(buf, k, axis, False)
        put = lambda buf, val, k, axis=0: jax.lax.dynamic_update_index_in_dim(buf, val, k, axis)
        zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
        mine = take(jnp.asarray(table), s, 1)
        chunks = vary(jax.tree.map(lambda a: a[:, 0].reshape(v, per, *a.shape[2:]), params))
        pick = lambda c: jax.tree.map(lambda a: take(a, c), chunks)
        # Varying copies: the VJPs of the parameters stay on this device, no collectives.
        head, emb = vary(head_params), vary(embed_params)
        zero = vary(jnp.zeros((), jnp.float32))
        bufs = [vary(jnp.zeros((max(n, 1), *h_aval.shape), h_aval.dtype))
                for n in (n_act, n_grad)]
        d_in = zeros(emb) if embed_fn else vary(zeros(xs))
        carry = (*bufs, zeros(chunks), zeros(head), d_in, zero)

        def backward(kind: int) -> Callable[..., tuple]:
            first, last = bool((kind - 1) % 2), kind >= 3

            def run(pc, hb, gb, i, tgt):
                def f(pc, hp, ep, h):
                    y = run_chunk(pc, embed(ep, h) if first else h)
                    return loss_fn(hp, y, tgt).astype(jnp.float32) / m if last else y

                h = jax.tree.map(lambda a: take(a, i, 1), xs) if first else hb
                if first and embed_fn:
                    out, vjp = jax.vjp(lambda pc, hp, ep: f(pc, hp, ep, h), pc, head, emb)
                    (dpc, dhp, dep), dh = vjp(jnp.ones_like(out) if last else gb), zeros(hb)
                else:
                    out, vjp = jax.vjp(f, pc, head, emb, h)
                    dpc, dhp, dep, dh = vjp(jnp.ones_like(out) if last else gb)
                return dpc, dhp, dep, dh, out if last else zero

            return run

        def idle(pc, hb, gb, i, tgt):
            return zeros(pc), zeros(head), zeros(emb), zeros(hb), zero

        def hand_on(act, grd, y, dh, slots):
            """Activations one stage on, activation gradients one stage back, each into
            its receiving slot where the table says one arrives."""
            ra_on, ra_slot, rg_on, rg_slot = slots
            if fwd_perm:
                y = jax.lax.ppermute(y, stage_axis, fwd_perm)
                dh = jax.lax.ppermute(dh, stage_axis, bwd_perm)
            act = put(act, jnp.where(ra_on == 1, y, take(act, ra_slot)), ra_slot)
            grd = put(grd, jnp.where(rg_on == 1, dh, take(grd, rg_slot)), rg_slot)
            return act, grd

        def tick(carry, row):
            act, grd, gacc, hacc, d_in, loss = carry
            f_kind, f_mb, f_c, f_slot, b_kind, b_mb, b_c, b_slot, b_gslot, ra_on, ra_slot, \
                rg_on, rg_slot = (row[k] for k in range(len(_FIELDS)))
            # Forward, on what arrived earlier or on the pipeline input (stage 0, chunk 0).
            y = jax.lax.switch(f_kind, (
                lambda: zeros(take(act, 0)),
                lambda: run_chunk(pick(f_c), take(act, f_slot)),
                lambda: run_chunk(pick(f_c), embed(emb, jax.tree.map(
                    lambda a: take(a, f_mb, 1), xs)))))
            # Backward: recompute the chunk from its input and pull the cotangent from the
            # next stage back through it; the last chunk starts from the head and loss.
            tgt = jax.tree.map(lambda a: take(a, b_mb, 1), ts)
            dpc, dhp, dep, dh, value = jax.lax.switch(
                b_kind, [idle] + [backward(k) for k in kinds],
                pick(b_c), take(act, b_slot), take(grd, b_gslot), b_mb, tgt)
            gacc = jax.tree.map(lambda a, d: put(a, take(a, b_c) + d, b_c), gacc, dpc)
            hacc = jax.tree.map(jnp.add, hacc, dhp)
            if embed_fn:
                d_in = jax.tree.map(jnp.add, d_in, dep)
            else:  # only stage 0's chunk 0 writes the input gradient of microbatch b_mb
                done = (s == 0) & (b_c == 0) & (b_kind > 0)
                d_in = put(d_in, jnp.where(done, dh, take(d_in, b_mb, 1)), b_mb, 1)
            act, grd = hand_on(act, grd, y, dh, (ra_on, ra_slot, rg_on, rg_slot))
            return (act, grd, gacc, hacc, d_in, loss + value), None

        # Lockstep (see ``lockstep``): a branch index the same on every device.
        firsts = jnp.asarray([0] + [(k - 1) % 2 for k in kinds], jnp.int32)
        lasts = jnp.asarray([0] + [int(k >= 3) for k in kinds], jnp.int32)

        def variant(grad: bool, with_head: bool, with_embed: bool) -> Callable[..., tuple]:
            def run(pc, h_act, x_i, gb, tgt, from_x, is_b, is_last):
                # Without embed_fn the pipeline input is an activation: pick it here, so the
                # input gradient is the gradient of h.
                h_in = h_act if embed_fn else jnp.where(from_x, x_i, h_act)

                def f(pc, hp, ep, h):
                    if embed_fn and with_embed:
                        h = jnp.where(from_x, embed(ep, x_i), h)
                    y = run_chunk(pc, h)
                    return y, (loss_fn(hp, y, tgt).astype(jnp.float32) / m if with_head
                               else zero)

                if not grad:
                    y, _ = f(pc, head, emb, h_in)
                    return y, zeros(pc), zeros(head), zeros(emb), zeros(h_in), zero
                (y, value), vjp = jax.vjp(f, pc, head, emb, h_in)
                dpc, dhp, dep, dh = vjp((jnp.where(is_b & ~is_last, gb, 0).astype(gb.dtype),
                                         jnp.where(is_last, 1.0, 0.0).astype(value.dtype)))
                keep = lambda on, t: jax.tree.map(lambda a: jnp.where(on, a, 0), t)
                return (y, keep(is_b, dpc), keep(is_last, dhp), keep(is_b & from_x, dep), dh,
                        jnp.where(is_last, value, 0))

            return run

        def tick_lockstep(carry, xs_t):
            row, step = xs_t
            act, grd, gacc, hacc, d_in, loss = carry
            f_kind, f_mb, f_c, f_slot, b_kind, b_mb, b_c, b_slot, b_gslot, ra_on, ra_slot, \
                rg_on, rg_slot = (row[k] for k in range(len(_FIELDS)))
            # Each stage runs at most one of its forward and backward per tick: this one.
            is_b = b_kind > 0
            c, i = jnp.where(is_b, b_c, f_c), jnp.where(is_b, b_mb, f_mb)
            from_x = jnp.where(is_b, take(firsts, b_kind) == 1, f_kind == 2)
            is_last = is_b & (take(lasts, b_kind) == 1)
            x_i = jax.tree.map(lambda a: take(a, i, 1), xs)
            tgt = jax.tree.map(lambda a: take(a, b_mb, 1), ts)
            y, dpc, dhp, dep, dh, value = jax.lax.switch(
                step, [variant(*key) for key in variants], pick(c),
                take(act, jnp.where(is_b, b_slot, f_slot)), x_i, take(grd, b_gslot), tgt,
                from_x, is_b, is_last)
            gacc = jax.tree.map(lambda a, d: put(a, take(a, c) + d, c), gacc, dpc)
            hacc = jax.tree.map(jnp.add, hacc, dhp)
            if embed_fn:
                d_in = jax.tree.map(jnp.add, d_in, dep)
            else:  # only stage 0's chunk 0 (input from x) writes the input gradient
                d_in = put(d_in, jnp.where(is_b & from_x, dh, take(d_in, b_mb, 1)), b_mb, 1)
            act, grd = hand_on(act, grd, y, dh, (ra_on, ra_slot, rg_on, rg_slot))
            return (act, grd, gacc, hacc, d_in, loss + value), None

        if lockstep:
            carry, _ = jax.lax.scan(tick_lockstep, carry, (mine, jnp.asarray(steps)),
                                    unroll=unroll)
        else:
            carry, _ = jax.lax.scan(tick, carry, mine, unroll=unroll)
        _, _, gacc, hacc, d_in, loss = carry
        grads = jax.tree.map(lambda a: a.reshape(v * per, 1, *a.shape[2:]), gacc)
        # Only the last stage has a loss and head gradients, only stage 0 input gradients;
        # the loss and gradients are means over the batch shards.
        def mean(tree: Any, axes: tuple[str, ...] = manual) -> Any:
            return jax.tree.map(lambda a: jax.lax.psum(a, axes) / shards if axes else a, tree)

        return (mean(loss), mean(grads, batch_axes), mean(hacc),
                mean(d_in, manual if embed_fn else (stage_axis,)))

    rows_spec = P(batch_axes or None)
    mapped = jax.shard_map(
        per_stage, mesh=mesh, axis_names={stage_axis, *batch_axes},
        in_specs=(P(None, stage_axis), P(), P(), rows_spec, rows_spec),
        out_specs=(P(), P(None, stage_axis), P(), P() if embed_fn else rows_spec))
    loss, grads, head_grads, d_in = mapped(params, head_params, embed_params, split(x),
                                           split(targets))
    if embed_fn is None:
        d_in = jax.tree.map(lambda d, a: d.reshape(a.shape), d_in, x)
    return loss, grads, head_grads, d_in


def pipelined_loss(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    loss_fn: Callable[[Any, jax.Array, Any], jax.Array],
    **options: Any,
) -> Callable[..., jax.Array]:
    """``f(params, head_params, x, targets, embed_params=None) -> loss`` whose gradient
    comes from the schedule.

    A ``jax.custom_vjp``: its forward pass runs :func:`pipeline_value_and_grad` (loss
    *and* gradients; ``options`` are passed on) and keeps the gradients, its backward pass
    returns them times the incoming cotangent. So ``jax.value_and_grad`` of a model loss
    that computes ``x`` (with an embedding, say) and calls ``f`` gets the schedule's
    gradients, and ``x``'s gradient flows on into the embedding; with
    ``options["embed_fn"]``, ``embed_params`` get theirs and ``x`` none. ``targets`` get
    no gradient. Calling ``f`` outside differentiation runs the whole schedule too.
    """
    embedded = options.get("embed_fn") is not None

    def run(params, head_params, x, targets, embed_params):
        return pipeline_value_and_grad(stage_fn, params, x, loss_fn, head_params, targets,
                                       embed_params=embed_params, **options)

    @jax.custom_vjp
    def f(params, head_params, x, targets, embed_params):
        return run(params, head_params, x, targets, embed_params)[0]

    def fwd(*args):
        loss, grads, head_grads, d_in = run(*args)
        return loss, (grads, head_grads, d_in)

    def bwd(saved, ct):
        grads, head_grads, d_in = jax.tree.map(lambda a: (a * ct).astype(a.dtype), saved)
        return (grads, head_grads, None, None, d_in) if embedded else (
            grads, head_grads, d_in, None, None)

    f.defvjp(fwd, bwd)
    return lambda params, head_params, x, targets, embed_params=None: f(
        params, head_params, x, targets, embed_params)
