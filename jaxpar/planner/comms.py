"""The collectives of one training step, and how long they take.

Collectives are listed as XLA emits them for the reference transformer:

* gradient reduction over the data-parallel axes: an all-reduce, or a reduce-scatter onto
  the axes the stored gradient is split over (ZeRO 2-3, FSDP). XLA:CPU has no
  reduce-scatter; it all-reduces the full gradient and slices (``backend="cpu"``).
  Expert weights are not reduced over the axis that splits their experts. The shards of
  a ``context`` axis compute partial gradients of the same weights: one more all-reduce
  over it. Under gradient accumulation each runs at every microbatch (XLA places it in
  the loop), but over the axes accumulated by hand (:func:`accumulated_by_hand`), once;
* all-gathers of weights stored split over data-parallel axes (FSDP, ZeRO-3) to their
  compute layout, in the forward and again in the backward pass; but the embedding table,
  looked up where it lies (:mod:`jaxpar.parallel.embedding`): under FSDP the token ids
  are all-gathered over the axes splitting its columns and the rows moved by two
  all-to-alls (forward and backward), and its gradient is not reduced over those axes;
  with ``plan.vocab_over_fsdp`` the ids are gathered and the looked-up rows summed over
  the axes splitting the vocabulary, and the output head is never gathered: the final
  hidden states are (twice), their gradient is reduced, the targets gathered and the
  softmax's maximum and sum reduced per token;
* ZeRO++ hpZ: weights stored split over ``data`` are all-gathered over it once a step
  (exposed: the first layer waits for it), and the per-layer gathers run over the other
  axes alone;
* ZeRO 1-2: one all-gather of the updated parameters from the sharded master weights;
* ZeRO++ (:mod:`jaxpar.parallel.zeropp`): qwZ gathers each weight once a step in int8
  (a byte an element and an f32 scale a row); qgZ replaces the gradient reduction by
  int8 all-to-alls, one per splitting axis from the innermost, each on the block the
  last left, and an int8 all-to-all and all-gather over each data-parallel axis the
  gradient is whole over, once a step after the backward pass;
* Megatron tensor parallelism: all-reduces of the ``(tokens, d_model)`` activations: 2 per
  layer forward (attention and MLP outputs) and, in the backward pass, one per
  column-parallel projection (q, k, v, gate, up: 5) on XLA:CPU, one per sublayer (2) on
  TPU and GPU, whose XLA reassociates the sum of all-reduces; plus one for the vocab-parallel
  embedding and one for the head's input gradient; remat reruns the forward's 2. Under
  sequence parallelism each becomes a reduce-scatter and an all-gather of the same
  activations: the same bytes on the wire. A mixture of experts all-reduces its experts'
  outputs, ``dispatched slots x d_model``, in place of the MLP's;
* context parallelism, per layer: ``allgather`` all-gathers K and V forward (again when
  remat reruns the layer) and reduce-scatters their gradients backward; ``ring`` passes a
  K/V block ``context - 1`` times forward and a block of K/V cotangents ``context - 1``
  times backward (``collective-permute``), and reruns the forward ring under remat;
* expert parallelism, per MoE layer: an all-to-all to dispatch tokens to their experts
  and one to combine the results, forward and backward (and again under remat), each
  moving the device's dispatch buffer (``tokens x experts_per_token x capacity factor x
  d_model``). With the sequence also split over ``context``, the dispatch einsum sums
  over it: one all-reduce of that buffer forward and one backward;
* pipeline: collective-permutes of a microbatch's activations, forwards and backwards
  (:func:`_collect` says how many); under FSDP each iteration of a GSPMD schedule
  gathers its chunk's weights and reduces their gradients (:func:`_layer_passes`).

Per-layer collectives sit inside the layer scan's loop body, so the optimized HLO text holds
them once; ``bytes_per_device`` reports them that way (what :func:`jaxpar.analysis.hlo.
parse_collectives` reads), and ``bytes_per_step`` multiplies by the executions.
``exposed_bytes_per_step`` is the part the compute waits for (tensor-parallel and
sequence-parallel collectives, the context all-gather, the expert all-to-alls, pipeline
sends); the rest (gradient reductions, weight gathers, the context ring, whose transfers
XLA overlaps with the block computations) can hide under compute.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from jaxpar.planner.activations import attention_kind
from jaxpar.planner.candidate import (
    Candidate,
    Local,
    dtype_bytes,
    local_sizes,
    pipe_microbatches,
    pipe_repeats,
    scheduled_backward,
)
from jaxpar.planner.layout import Layout, Placed
from jaxpar.planner.links import Transfer, wire_bytes
from jaxpar.planner.lowering import RING, Lowering
from jaxpar.planner.model import ModelSpec
from jaxpar.planner.roofline import recomputed_parts
from jaxpar.sharding.mesh import MESH_AXES


class _Rows:
    """Collective rows grouped by (kind, axes), as the HLO text groups them."""

    def __init__(self, lay: Layout, lowering: Lowering = RING):
        self.lay = lay
        self.lowering = lowering
        self._axes: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.combined: dict[tuple[str, tuple[str, ...], int, str], float] = {}
        self.rows: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
        self._shared: set[tuple[str, tuple[str, ...]]] = set()  # rows of another's: see copy

    def add(self, kind: str, axes: tuple[str, ...], nbytes: float, static: int, runs: int,
            exposed: bool = False, phase: str = "", weight: bool | None = None,
            layer_input: float = float("inf")) -> None:
        """One collective: ``nbytes`` result bytes, ``static`` instructions in the HLO
        text, ``runs`` executions per step; ``phase`` is what compute it can hide under
        (:data:`~jaxpar.planner.links.PHASES`; default ``exposed`` when ``exposed``, else
        ``forward``).
        ``weight``: a weight's gather or its gradient's reduction (True for a layer's
        weight, False for one outside the layers), run as the compiler's
        :class:`~jaxpar.planner.lowering.Lowering` says; None: an activation's, as a
        ring. ``layer_input``: the bytes of a layer's input on a device (what decides
        whether the compiler runs a weight's collective inside its matmul)."""
        if nbytes <= 0:
            return
        named = self._axes.get(axes)
        if named is None:
            named = tuple(a for a in MESH_AXES if a in axes and self.lay.sizes[a] > 1)
            self._axes[axes] = named
        axes = named
        if not axes:
            return
        phase = phase or ("exposed" if exposed else "forward")
        n = math.prod(self.lay.sizes[a] for a in axes)
        scale = (1.0 if weight is None
                 else self.lowering.wire_factor(kind, n, phase, weight, layer_input))
        # Collectives of one kind, axes and phase that run as often are combined into one
        # (XLA's combiners do the same for the per-tensor gathers and reductions).
        key = (kind, axes, runs, phase, scale)
        self.combined[key] = self.combined.get(key, 0.0) + nbytes
        row = self.rows.get((kind, axes))
        if row is None:
            row = self.rows[(kind, axes)] = {
                "kind": kind, "axes": list(axes), "count": 0, "bytes_per_device": 0.0,
                "bytes_per_step": 0.0, "executions": 0, "exposed_bytes_per_step": 0.0,
                "wire_bytes_per_step": 0.0}
        elif (kind, axes) in self._shared:
            row = self.rows[(kind, axes)] = {**row, "axes": list(row["axes"])}
            self._shared.discard((kind, axes))
        row["count"] += static
        row["bytes_per_device"] += nbytes * static
        row["bytes_per_step"] += nbytes * runs
        row["executions"] += runs
        row["wire_bytes_per_step"] += runs * scale * wire_bytes(kind, nbytes, n)
        if exposed:
            row["exposed_bytes_per_step"] += nbytes * runs

    def copy(self) -> _Rows:
        """A copy to add more collectives to, leaving this one as it is (it shares the
        rows until :meth:`add` or :meth:`sorted` copies them)."""
        out = _Rows(self.lay, self.lowering)
        out._axes = self._axes  # the same layout names the same axes
        out.combined = dict(self.combined)
        out.rows = dict(self.rows)
        out._shared = set(self.rows)
        return out

    @property
    def transfers(self) -> list[Transfer]:
        """The step's transfers, combined (see :meth:`add`)."""
        out = []
        for key, nbytes in self.combined.items():
            tr = _TRANSFERS.get((key, nbytes))
            if tr is None:
                if len(_TRANSFERS) >= 16 * _CACHE_MAX:
                    _TRANSFERS.clear()
                tr = _TRANSFERS[(key, nbytes)] = Transfer(*key[:2], nbytes, *key[2:])
            out.append(tr)
        return out

    def sorted(self) -> list[dict[str, Any]]:
        """The rows by kind and axes, none shared with another's (see :meth:`copy`)."""
        for key in self._shared:
            self.rows[key] = {**self.rows[key], "axes": list(self.rows[key]["axes"])}
        self._shared.clear()
        return sorted(self.rows.values(), key=lambda r: (r["kind"], r["axes"]))


_CACHE_MAX = 4096  # entries a cache of this module holds before it starts again
_TRANSFERS: dict[tuple, Transfer] = {}  # made so far: finding one costs less than making it


class _Tokens(NamedTuple):
    """What a transformer's embedding lookup and output head move activations by: the
    per-device sizes, the model width, the pipeline's microbatches, and whether the head
    is the embedding table."""

    loc: Local
    d_model: int
    pipe_micro: int
    tied: bool


def _lookup(rows: _Rows, lay: Layout, p: Placed, tokens: _Tokens, micro: int,
            wire: int) -> Placed:
    """The embedding lookup of :mod:`jaxpar.parallel.embedding` on a table whose ``embed``
    dimension is split over data-parallel axes (FSDP): the token ids are all-gathered over
    those axes and the rows moved to the batch-split layout by an all-to-all (another in
    the backward pass), instead of gathering the table and reducing its gradient over
    them. Returns the table as the rest of the step sees it: its compute layout keeps
    those axes, and its gradient is reduced over the others only."""
    loc, d_model, n_pipe, _ = tokens
    axes = p.base_dp_axes
    split = math.prod(lay.sizes[a] for a in axes)
    runs = micro * n_pipe
    rows.add("all-gather", axes, loc.tokens * split * 4, 1, runs, exposed=True)
    rows.add("all-to-all", axes, loc.tokens * d_model * wire, 2, 2 * runs, exposed=True)
    return dataclasses.replace(p, compute=p.compute // split,
                               store_dp_axes=tuple(a for a in p.store_dp_axes
                                                   if a not in axes),
                               base_dp_axes=(), owned_axes=(*p.owned_axes, *axes))


def _vocab_split(rows: _Rows, lay: Layout, p: Placed, tokens: _Tokens, micro: int,
                 wire: int, backend: str) -> None:
    """The activations that move when the vocabulary is split over data-parallel axes
    (``plan.vocab_over_fsdp``; the table and head themselves stay): for the embedding
    table, the token ids all-gathered over those axes and the looked-up rows summed over
    them; for the output head, the final hidden states all-gathered (forward, and again
    for the head's gradient), their gradient reduced back, the targets gathered and two
    ``(tokens,)`` reductions of the softmax (maximum and sum)."""
    loc, d_model, n_pipe, tied = tokens
    axes = tuple(a for a in p.owned_axes if a in lay.dp_axes)
    split = math.prod(lay.sizes[a] for a in axes)
    runs = micro * n_pipe
    rows_b = loc.tokens * split * d_model * wire
    ids_b = loc.tokens * split * 4

    def reduce(nbytes: float) -> None:
        if backend == "cpu":
            rows.add("all-reduce", axes, nbytes, 1, runs, exposed=True)
        else:
            rows.add("reduce-scatter", axes, nbytes / split, 1, runs, exposed=True)

    if p.tensor.path == "embed":
        rows.add("all-gather", axes, ids_b, 1, runs, exposed=True)
        reduce(rows_b)
    if p.tensor.path != "embed" or tied:
        rows.add("all-gather", axes, rows_b, 2, 2 * runs, exposed=True)
        rows.add("all-gather", axes, ids_b, 1, runs, exposed=True)
        rows.add("all-reduce", axes, ids_b, 2, 2 * runs, exposed=True)
        reduce(rows_b)


def _split_all_reduce(rows: _Rows, cand: Candidate, axes: tuple[str, ...], n: int,
                      per_layer: bool, layer_input: float) -> bool:
    """Whether a gradient's reduction over ``axes``, which the compiler runs as an
    all-reduce (:mod:`jaxpar.planner.lowering`), crosses slices: then it runs as a
    reduce-scatter and an all-gather, the same bytes on the links."""
    form = rows.lowering.form("reduce-scatter", n, "gradient", per_layer, layer_input)
    dcn = dict(cand.dcn)
    return form == "all-reduce" and any(dcn.get(a, 1) > 1 for a in axes)


def _weights(rows: _Rows, lay: Layout, cand: Candidate, layers: int, wire: int,
             backend: str, tokens: _Tokens | None = None) -> None:
    """Weight gathers and gradient reductions (``tokens``: a transformer's, for the
    activations its embedding lookup and head move: see :func:`_lookup` and
    :func:`_vocab_split`)."""
    micro = cand.microbatches
    by_hand = accumulated_by_hand(cand, lay)
    passes = _layer_passes(cand, lay, layers)
    layer_input = (tokens.loc.tokens * tokens.d_model * wire if tokens else float("inf"))
    # With a tensor axis the TPU compiler runs the weights' gathers as rings (its
    # collective matmuls go to the tensor axis's activations), its gradients' reductions
    # still in the matmul (jaxpar.planner.lowering).
    gather_input = 0.0 if lay.sizes.get("tensor", 1) > 1 else layer_input
    for p in lay.placed:
        if tokens and "vocab" in p.tensor.names and set(p.owned_axes) & set(lay.dp_axes):
            _vocab_split(rows, lay, p, tokens, micro, wire, backend)
        elif (tokens and p.tensor.path == "embed" and p.base_dp_axes and not tokens.tied
                and "int8" not in (cand.quantize_gather, cand.quantize_reduce)):
            p = _lookup(rows, lay, p, tokens, micro, wire)
        # A stacked layer weight: the loop body moves one layer's slice, ``per`` times a
        # pass over the layers, ``loops`` times a microbatch (more in a pipeline).
        per = layers if p.tensor.per_layer else 1
        loops = passes if p.tensor.per_layer else 1
        compute, base = p.compute / per, p.base / per
        # Weights stored split over data-parallel axes: gathered for forward and backward
        # (per microbatch); the embedding and head once when not inside the layer loop.
        if p.store_dp_axes and "int8" in (cand.quantize_gather, cand.quantize_reduce):
            # ZeRO++: once a step; under qwZ a byte an element plus an f32 scale a row
            # (rows of a model dimension or more: a 1/64 or smaller overhead is taken).
            width = 1 + 4 / 64 if cand.quantize_gather == "int8" else wire
            rows.add("all-gather", p.store_dp_axes, compute * per * width, 1, micro,
                     phase="forward")
        elif p.store_dp_axes:
            axes = p.store_dp_axes
            if cand.hpz and "data" in axes:  # ZeRO++ hpZ: across slices once a step
                axes = tuple(a for a in axes if a != "data")
                inner = math.prod(lay.sizes[a] for a in axes)
                rows.add("all-gather", ("data",), compute * per * wire / inner, 1, 1,
                         phase="exposed")
            nbytes = compute * wire
            layer = p.tensor.per_layer
            rows.add("all-gather", axes, nbytes, 1, loops * micro, phase="forward",
                     weight=layer, layer_input=gather_input)
            rows.add("all-gather", axes, nbytes, 1 if layer else 0, loops * micro,
                     phase="backward", weight=layer, layer_input=layer_input)
        # ZeRO 1-2: the updated master shards are gathered into the working parameters.
        if cand.zero_stage in (1, 2) and p.zero_axes:
            rows.add("all-gather", p.zero_axes, base * per * wire, 1, 1, phase="update",
                     weight=False)
        # Gradient reduction over every data-parallel axis, except the axes that split
        # the tensor's experts; then over the context axis, on its own (as XLA emits it).
        reduce_axes = tuple(a for a in lay.dp_axes
                            if lay.sizes[a] > 1 and a not in p.owned_axes)
        if tokens and p.tensor.path in _LAST_STAGE and _ticked(cand, lay):
            # A tick-by-tick schedule's head and final norm: their gradients are summed
            # over the stages (only the last has them) with the loss, once, and with the
            # data axis the schedule splits by hand, in the same all-reduce.
            full = compute * wire
            if "data" in manual_data_axes(cand, lay):
                rows.add("all-reduce", ("data", "stage"), full, 1, micro, phase="gradient")
                continue
            rows.add("all-reduce", ("stage",), full, 1, micro, phase="gradient")
        grad_split = p.store_dp_axes if cand.zero_stage < 2 else (p.base_dp_axes + p.zero_axes)
        grad_split = tuple(a for a in grad_split if a in reduce_axes)
        rest = tuple(a for a in reduce_axes if a not in grad_split)
        full = compute * wire
        n = math.prod(lay.sizes[a] for a in grad_split)
        if cand.quantize_reduce == "int8" and reduce_axes:
            # ZeRO++ qgZ, once a step after the backward pass (nothing to hide under): an
            # int8 all-to-all per splitting axis, innermost first, each on what the last
            # left; then an int8 all-to-all and all-gather over the other axes.
            left = compute * per * (1 + 4 / 64)
            for axis in sorted(grad_split, key=MESH_AXES.index, reverse=True):
                rows.add("all-to-all", (axis,), left, 1, 1, phase="exposed")
                left /= lay.sizes[axis]
            for axis in rest:
                rows.add("all-to-all", (axis,), left, 1, 1, phase="exposed")
                rows.add("all-gather", (axis,), left, 1, 1, phase="exposed")
            rows.add("all-reduce", lay.cp_axes, full / n, 1, per * micro, phase="gradient")
            continue
        if grad_split and cand.hpz and "data" in grad_split and p.store_dp_axes:
            # hpZ: the in-slice copy's gradient is reduced inside the slice first, then
            # its shard across slices (the DCN carries 1 / n_inner of it)
            inner_axes = tuple(a for a in grad_split if a != "data")
            inner = math.prod(lay.sizes[a] for a in inner_axes)
            runs = per * micro
            if backend == "cpu":
                rows.add("all-reduce", inner_axes, full, 1, runs, phase="gradient")
                rows.add("all-reduce", ("data",), full / inner, 1, runs, phase="gradient")
            else:
                rows.add("reduce-scatter", inner_axes, full / inner, 1, runs, phase="gradient")
                rows.add("reduce-scatter", ("data",), full / n, 1, runs, phase="gradient")
        elif grad_split:
            runs = loops * gradient_runs(cand, lay, grad_split)
            if backend == "cpu":
                rows.add("all-reduce", grad_split, full, 1, runs, phase="gradient")
            elif _split_all_reduce(rows, cand, grad_split, n, p.tensor.per_layer,
                                   layer_input):
                # Across slices the compiler's all-reduce runs as a reduce-scatter and an
                # all-gather of the sum (Llama 3.1 405B on 2 x v6e-256, fsdp 512: the
                # gathers 1.5x and the reduce-scatters half the bytes listed as one).
                rows.add("reduce-scatter", grad_split, full / n, 1, runs, phase="gradient")
                rows.add("all-gather", grad_split, full, 1, runs, phase="gradient")
            else:
                rows.add("reduce-scatter", grad_split, full / n, 1, runs, phase="gradient",
                         weight=p.tensor.per_layer, layer_input=layer_input)
        # Under gradient accumulation the reductions run at every microbatch, but over the
        # axes accumulated by hand, once after the loop (parallel/accumulation.py).
        once = tuple(a for a in rest if a in by_hand)
        looped = tuple(a for a in rest if a not in by_hand)
        # (A weight stored whole over these axes: a pipeline's loop reduces its gradient
        # at every iteration too, but the planner prices it once a pass over the layers,
        # the way the published pipelined runs it is fitted on reduce theirs.)
        rows.add("all-reduce", looped, full / n, 1, per * gradient_runs(cand, lay, looped),
                 phase="gradient")
        rows.add("all-reduce", once, full / n, 1, per, phase="gradient")
        rows.add("all-reduce", lay.cp_axes, full / n, 1,
                 per * gradient_runs(cand, lay, lay.cp_axes), phase="gradient")


def _layer_passes(cand: Candidate, lay: Layout, layers: int) -> int:
    """How often a microbatch's loops run a stage's ``layers`` layers, each pass gathering
    a layer's weights and reducing its gradient: once without stages; in a GSPMD pipeline
    (``gpipe``, ``circular``) at every iteration, ``R M + S - 1`` of them, each running a
    chunk of ``layers / R`` layers (bubble iterations included: they compute on zeros, and
    gather all the same)."""
    stages = lay.sizes.get("stage", 1)
    if stages <= 1 or scheduled_backward(cand):
        return layers
    repeats = pipe_repeats(cand, layers * stages, stages)
    iterations = repeats * pipe_microbatches(cand, stages) + stages - 1
    return iterations * max(layers // repeats, 1)


_LAST_STAGE = ("final_norm/scale", "lm_head/kernel")
"""The reference transformer's tensors a pipeline runs on its last stage, after the
layers (the embedding runs before them, outside the schedule)."""


def _ticked(cand: Candidate, lay: Layout) -> bool:
    """Whether a pipeline runs forward and backward tick by tick (1F1B) on ``lay``."""
    return lay.sizes.get("stage", 1) > 1 and scheduled_backward(cand)


def manual_data_axes(cand: Candidate, lay: Layout) -> tuple[str, ...]:
    """The data-parallel axes a tick-by-tick schedule splits its microbatches over by hand
    (:func:`jaxpar.parallel.pipeline.manual_batch_axes`): ``data`` when it has more than
    one device and ZeRO-3 does not shard the weights over it."""
    if not _ticked(cand, lay) or lay.sizes.get("data", 1) <= 1 or cand.zero_stage >= 3:
        return ()
    return ("data",)


def accumulated_by_hand(cand: Candidate, lay: Layout) -> tuple[str, ...]:
    """The data-parallel axes whose gradient reduction waits for the end of gradient
    accumulation (:func:`jaxpar.parallel.accumulation.local_axes`): ``data`` under
    ``microbatches > 1`` when no weight is stored split over it, ZeRO stage 0 or 1, no
    stage, context or expert axis and no ZeRO++; the other axes' reductions run at every
    microbatch."""
    if (cand.microbatches <= 1 or cand.zero_stage >= 2
            or "int8" in (cand.quantize_gather, cand.quantize_reduce)
            or cand.offload_params or lay.sizes.get("data", 1) <= 1
            or "data" not in lay.dp_axes
            or any(lay.sizes.get(a, 1) > 1 for a in ("stage", "context", "expert"))):
        return ()
    if any("data" in p.store_dp_axes for p in lay.placed):
        return ()
    return ("data",)


def gradient_runs(cand: Candidate, lay: Layout, axes: tuple[str, ...]) -> int:
    """How many times a step reduces a gradient over ``axes``: once, or at every
    microbatch of gradient accumulation, where XLA places the reduction inside the loop
    (its accumulator laid out like the parameters) unless the axes are
    :func:`accumulated_by_hand`."""
    named = {a for a in axes if lay.sizes.get(a, 1) > 1}
    if cand.microbatches <= 1 or not named or named <= set(accumulated_by_hand(cand, lay)):
        return 1
    return cand.microbatches


def _weight_rows(lay: Layout, cand: Candidate, layers: int, wire: int, backend: str,
                 tokens: _Tokens, lowering: Lowering = RING) -> _Rows:
    """:func:`_weights` into new rows, remembered by what it reads (the search asks
    again for candidates that differ in what it does not): a copy to add to."""
    key = (id(lay), layers, wire, backend, cand.microbatches, cand.zero_stage,
           cand.quantize_gather, cand.quantize_reduce, cand.hpz, tokens.loc.tokens,
           tokens.d_model, tokens.pipe_micro, tokens.tied, cand.pipeline_schedule,
           cand.pipeline_repeats, cand.dcn, lowering)
    hit = _WEIGHT_ROWS.get(key)
    if hit is None or hit[0] is not lay:
        rows = _Rows(lay, lowering)
        _weights(rows, lay, cand, layers, wire, backend, tokens=tokens)
        if len(_WEIGHT_ROWS) >= _CACHE_MAX:
            _WEIGHT_ROWS.clear()
        hit = _WEIGHT_ROWS[key] = (lay, rows)  # holding lay keeps its id from reuse
    return hit[1].copy()


_WEIGHT_ROWS: dict[tuple, tuple[Layout, _Rows]] = {}


def _tensor(rows: _Rows, spec: ModelSpec, lay: Layout, cand: Candidate, loc: Local,
            runs_layer: int, runs_step: int, wire: int, backend: str) -> None:
    """Megatron tensor parallelism's activation all-reduces (or, with sequence
    parallelism, reduce-scatter + all-gather pairs; XLA:CPU all-reduces in place of the
    reduce-scatter)."""
    # Remat under jaxpar's policies reruns the forward's all-reduces (they are not saved);
    # another framework's selective policy (``recompute=...``) only when it recomputes a
    # row-parallel projection's output.
    remat = cand.remat != "none"
    if cand.remat.startswith("recompute="):
        remat = bool({"wo", "down"} & set(recomputed_parts(cand.remat)))
    tokens_b = loc.tokens * spec.d_model * wire
    # Backward input gradients of the column-parallel projections: XLA:CPU reduces each
    # (q, k, v; gate, up); TPU and GPU XLA reassociate the sum of all-reduces into one
    # all-reduce of the sum, one per sublayer, as Megatron does by hand.
    attn_in, mlp_in = (3, 2) if backend == "cpu" else (1, 1)
    again = 1 if remat else 0
    # (bytes, reductions, gathers) per layer: attention, then the MLP. Reductions: the
    # forward's one per sublayer, the backward's input gradients, remat's rerun. Under
    # sequence parallelism the gathers are the forward's one before each sublayer, the
    # backward's one (the transpose of the forward's reduce-scatter) and remat's rerun.
    if spec.is_moe:
        expert_b = loc.dispatched * spec.d_model * wire
        parts = [(tokens_b, 1 + attn_in + again, 2 + again),
                 (expert_b, 1 + mlp_in + again, 2 + again)]
    else:
        parts = [(tokens_b, 2 + attn_in + mlp_in + 2 * again, 4 + 2 * again)]
    tp, sp = lay.tp_axes, loc.seq_parallel
    # On a TPU, XLA runs these asynchronously and decomposes the neighbouring matmuls
    # (collective matmul), so they overlap the layer's compute; elsewhere the matmul
    # waits for them.
    overlapped = backend == "tpu"
    # The vocab-parallel embedding's output and the head's input gradient.
    for nbytes, n, gathers, runs in [*((b, r, g, runs_layer) for b, r, g in parts),
                                     (tokens_b, 2, 2, runs_step)]:
        phase = "backward" if overlapped else "exposed"
        if not sp:
            rows.add("all-reduce", tp, nbytes, n, n * runs, exposed=True, phase=phase)
            continue
        if backend == "cpu":
            rows.add("all-reduce", tp, nbytes, n, n * runs, exposed=True, phase=phase)
        else:
            rows.add("reduce-scatter", tp, nbytes / loc.tp, n, n * runs, exposed=True,
                     phase=phase)
        rows.add("all-gather", tp, nbytes, gathers, gathers * runs, exposed=True,
                 phase=phase)


def _context(rows: _Rows, spec: ModelSpec, lay: Layout, cand: Candidate, loc: Local,
             runs_layer: int, wire: int, fused: bool = False) -> None:
    """Keys and values across the context axis, per layer. The ring on a fused kernel
    (``fused``: splash, cuDNN) also sends each block's f32 key and value gradients along
    with it in the backward pass, ``context`` times (the last send takes them home)."""
    remat = cand.remat != "none"
    kv_block = loc.tokens * loc.kv_heads * spec.head_dim * wire  # one of K or V, local
    if cand.context_attention == "ring":
        steps = loc.context - 1
        fwd = steps * (2 if remat else 1)
        rows.add("collective-permute", lay.cp_axes, kv_block, 2 * (1 + (1 if remat else 0)),
                 2 * fwd * runs_layer, phase="forward")
        rows.add("collective-permute", lay.cp_axes, kv_block, 2, 2 * steps * runs_layer,
                 phase="backward")
        if fused:
            grads = loc.tokens * loc.kv_heads * spec.head_dim * 4
            rows.add("collective-permute", lay.cp_axes, grads, 2,
                     2 * loc.context * runs_layer, phase="backward")
    else:
        gathers = 2 if remat else 1
        rows.add("all-gather", lay.cp_axes, kv_block * loc.context, 2 * gathers,
                 2 * gathers * runs_layer, exposed=True)
        rows.add("reduce-scatter", lay.cp_axes, kv_block, 2, 2 * runs_layer, exposed=True)


def _experts(rows: _Rows, spec: ModelSpec, lay: Layout, cand: Candidate, loc: Local,
             runs_layer: int, wire: int) -> None:
    """Token dispatch and combine over the expert axis, per MoE layer."""
    n = 4 + (2 if cand.remat != "none" else 0)
    buf = loc.dispatched * spec.d_model * wire
    rows.add("all-to-all", ("expert",), buf, n, n * runs_layer, exposed=True)
    # The dispatch einsum contracts the sequence, split over context: partial sums.
    rows.add("all-reduce", lay.cp_axes, buf, 2, 2 * runs_layer, exposed=True)


def collectives(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int,
                backend: str = "tpu", lowering: Lowering = RING) -> list[dict[str, Any]]:
    """The collectives of one step grouped by (kind, axes); see :func:`transfers`."""
    return _collect(spec, lay, cand, global_batch, seq, backend, lowering).sorted()


def transfers(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int,
              backend: str = "tpu", lowering: Lowering = RING
              ) -> tuple[list[dict[str, Any]], list[Transfer]]:
    """The step's collectives both ways: rows grouped by (kind, axes), as the HLO text
    groups them, and each :class:`Transfer` with its phase, for the time model.
    ``lowering``: how the compiler runs weight gathers and gradient reductions (their
    ``wire_bytes_per_step`` and each transfer's ``wire_scale``)."""
    rows = _collect(spec, lay, cand, global_batch, seq, backend, lowering)
    return rows.sorted(), rows.transfers


def _collect(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int,
             backend: str = "tpu", lowering: Lowering = RING) -> _Rows:
    """The collectives of one step, grouped by (kind, axes).

    Each row: ``kind``, ``axes``, ``count`` (instructions in the HLO text),
    ``bytes_per_device`` (their result bytes, loop bodies once, as the HLO text reads),
    ``bytes_per_step`` / ``executions`` (what actually runs, every layer and microbatch)
    and ``exposed_bytes_per_step`` (the part on the critical path; see the module
    docstring).
    """
    c = dtype_bytes(cand.precision)
    wire = 4 if backend == "cpu" else c  # XLA:CPU upcasts bf16 before communicating
    stages = lay.sizes.get("stage", 1)
    layers = spec.n_layers // stages if spec.n_layers else 1
    micro = cand.microbatches
    rows = _Rows(lay, lowering)
    if not spec.is_transformer:
        _weights(rows, lay, cand, layers, wire, backend)
        return rows
    loc = local_sizes(spec, lay, cand, global_batch, seq)
    n_pipe = pipe_microbatches(cand, stages) if stages > 1 else 1
    rows = _weight_rows(lay, cand, layers, wire, backend,
                        _Tokens(loc, spec.d_model, n_pipe, spec.tie_embeddings), lowering)
    runs_layer = layers * micro * n_pipe
    if lay.tp_axes:
        _tensor(rows, spec, lay, cand, loc, runs_layer, micro * n_pipe, wire, backend)
    if lay.cp_axes:
        _context(rows, spec, lay, cand, loc, runs_layer, wire,
                 fused=attention_kind(spec, cand, backend, seq) in ("splash", "cudnn"))
    if spec.is_moe:
        _experts(rows, spec, lay, cand, loc, runs_layer, wire)
    if stages > 1:
        m = pipe_microbatches(cand, stages)
        iters = pipe_repeats(cand, spec.n_layers, stages) * m + stages - 1
        send = loc.tokens * spec.d_model * c / loc.residual_split  # split under SP
        # Activations forwards, gradients backwards: once an iteration each way, or under
        # 1F1B at every one of its 2 x iterations ticks. (GSPMD's loop sends the
        # gradients twice an iteration on XLA:CPU, GPUs and TPUs alike, 1.5 x these bytes;
        # priced as the published pipelined runs the planner is fitted on send them.)
        sends = 4 * iters if scheduled_backward(cand) else 2 * iters
        rows.add("collective-permute", ("stage",), send, 2, sends * micro, exposed=True)
        if scheduled_backward(cand):
            # The layers' input gradient, made on stage 0, is summed over the stages once
            # the schedule is done (every microbatch's rows at once).
            rows.add("all-reduce", ("stage",), loc.tokens * m * spec.d_model * c, 1, micro,
                     phase="exposed")
    return rows
