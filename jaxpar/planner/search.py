"""The search: enumerate meshes and knobs, drop what does not fit, rank by step time.

Mesh shapes: a ``context`` size (a power of two, for long sequences or batches smaller
than the machine) and an ``expert`` size (a divisor of the number of experts, for a
mixture of experts) inside one slice, on the fast ICI links since they communicate in
every layer; then every split of the rest of the slice over ``data x stage x fsdp x
tensor`` (tensor parallelism stays inside an ICI domain, at most 16 ways, and must divide
heads, KV heads, the MLP width and vocab; stages must divide the layers, and do not
combine with experts or context parallelism) times every split of the slices over
``data x stage x fsdp`` (DCN), and for a mixture of experts over ``expert`` too (an
eight-GPU node holds too few experts of a large model; expert parallelism across nodes
is the usual remedy, paid for by all-to-alls over the slower network). For each mesh:
ZeRO stages 0-3, the remat policies, sequence parallelism on and off (with tensor
parallelism), both context attention kinds (with a context axis), and the fewest
gradient-accumulation microbatches that fit in HBM (more only cost time). A microbatch
count is first checked for memory alone and priced in full only where it fits (or is
needed to report the leanest plans); policies dominated by a lighter one that fitted are
capped. Branch and bound: once enough plans fit, a candidate whose computation alone
(:func:`jaxpar.planner.cost.step_time_floor`) is slower than every plan it could displace
is not priced; the ranking is the same as without it, at a fraction of the estimates.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

from jaxpar.errors import JaxparError
from jaxpar.planner import offload as offload_lib
from jaxpar.planner.catalog import Machine
from jaxpar.planner.cost import (
    Candidate,
    Estimate,
    check_divisible,
    device_memory,
    estimate,
    step_time_floor,
)
from jaxpar.planner.model import ModelSpec
from jaxpar.planner.roofline import recomputed_parts

REMATS = ("none", "dots_with_no_batch_dims_saveable", "save_attention_and_mlp_outputs", "full")
"""Remat policies tried, each recomputing a superset of the one before."""
MAX_TENSOR = 16
MAX_STAGES = 16
MIN_CONTEXT_SEQ = 16384
"""Sequences shorter than this are not split over a context axis unless the batch is too
small to give every device a sequence: below it, remat and data/FSDP splits bring the
activations into HBM, and context parallelism would only add key/value traffic."""
MIN_CONTEXT_SHARD = 1024
"""Fewest positions of a sequence one context shard holds (smaller shards leave attention
blocks too small to keep a chip busy)."""
TIE_MARGIN = 0.01
"""How much slower than the plan it would displace a candidate's computation alone must
be for the search to skip pricing it: more than :func:`_rank`'s tie step (0.5% of the
fastest plan), so a skipped candidate could not have tied into the ranking."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(n: int, k: int) -> Iterator[tuple[int, ...]]:
    """Every ordered ``k``-tuple of positive integers whose product is ``n``."""
    if k == 1:
        yield (n,)
        return
    for d in _divisors(n):
        for rest in _splits(n // d, k - 1):
            yield (d, *rest)


def context_sizes(spec: ModelSpec, machine: Machine, seq: int, global_batch: int,
                  allowed: Sequence[int] | None = None) -> list[int]:
    """Context sizes worth trying: 1, and powers of two that divide a slice, split the
    sequence into ``2 x context`` chunks of at least :data:`MIN_CONTEXT_SHARD` / 2
    positions, for sequences of :data:`MIN_CONTEXT_SEQ` or more (or a batch smaller than
    the machine). ``allowed`` restricts the choice."""
    out = [1]
    if spec.is_transformer and seq and (seq >= MIN_CONTEXT_SEQ or global_batch < machine.count):
        c = 2
        while c <= machine.per_slice and seq % (2 * c) == 0 and seq // c >= MIN_CONTEXT_SHARD:
            if machine.per_slice % c == 0:
                out.append(c)
            c *= 2
    return [c for c in out if allowed is None or c in allowed]


def expert_sizes(spec: ModelSpec, machine: Machine, allowed: Sequence[int] | None = None
                 ) -> list[int]:
    """Expert sizes worth trying: the divisors of ``n_experts`` that divide a slice (1
    only for a dense model, or dropless experts, which gather rather than exchange
    tokens). ``allowed`` restricts the choice."""
    out = [1]
    if spec.is_moe and spec.capacity_factor:
        out = [e for e in _divisors(spec.n_experts) if machine.per_slice % e == 0]
    return [e for e in out if allowed is None or e in allowed]


def meshes(spec: ModelSpec, machine: Machine, *, stages: bool = True, seq: int = 0,
           global_batch: int = 0, contexts: Sequence[int] | None = None,
           experts: Sequence[int] | None = None
           ) -> Iterator[tuple[dict[str, int], dict[str, int]]]:
    """(ICI sizes, DCN sizes) pairs worth evaluating for ``spec`` on ``machine``
    (``stages=False``: no pipeline axis; ``contexts``/``experts``: the sizes of those
    axes allowed, default: see :func:`context_sizes` and :func:`expert_sizes`)."""
    per_slice = machine.per_slice
    layers = spec.n_layers or 1
    for context in context_sizes(spec, machine, seq, global_batch or machine.count, contexts):
        for expert in expert_sizes(spec, machine, experts):
            if per_slice % (context * expert):
                continue
            no_stages = not stages or not spec.is_transformer or context > 1 or spec.is_moe
            for data, stage, fsdp, tensor in _splits(per_slice // (context * expert), 4):
                if tensor > min(MAX_TENSOR, machine.chip.domain) or stage > MAX_STAGES:
                    continue
                if stage > 1 and (no_stages or layers % stage):
                    continue
                for d_data, d_stage, d_fsdp, d_expert in _dcn_splits(spec, machine, expert,
                                                                      experts):
                    total_stage = stage * d_stage
                    if total_stage > 1 and (no_stages or layers % total_stage
                                            or total_stage > MAX_STAGES):
                        continue
                    yield ({"data": data, "stage": stage, "fsdp": fsdp, "expert": expert,
                            "context": context, "tensor": tensor},
                           {"data": d_data, "stage": d_stage, "fsdp": d_fsdp,
                            "expert": d_expert})


def _dcn_splits(spec: ModelSpec, machine: Machine, expert: int,
                allowed: Sequence[int] | None) -> Iterator[tuple[int, ...]]:
    """Splits of the slices over ``data x stage x fsdp x expert``: the expert axis may
    cross slices (expert parallelism across GPU nodes, over InfiniBand, is common
    practice), as long as its total size still divides the experts."""
    if not spec.is_moe or not spec.capacity_factor or machine.slices == 1:
        for split in _splits(machine.slices, 3):
            yield (*split, 1)
        return
    for split in _splits(machine.slices, 4):
        total = expert * split[3]
        if spec.n_experts % total == 0 and (allowed is None or total in allowed):
            yield split


@dataclasses.dataclass
class SearchResult:
    """Ranked plans (fitting ones first, by step time) and how many were looked at.

    ``baselines`` holds, for ``"context"`` and ``"expert"``, the best plan without that
    axis (the fastest that fits, else the one needing least memory; None when no such
    plan was evaluated); :func:`reason` compares a winner that uses the axis with it.
    """

    plans: list[Estimate]
    evaluated: int
    rejected: dict[str, int]
    baselines: dict[str, Estimate | None] = dataclasses.field(default_factory=dict)
    skipped: int = 0
    """Of ``evaluated``, the fitting candidates not priced: slower on computation alone
    than every plan they could displace."""
    priced: int = 0
    """Candidates priced in full (:func:`jaxpar.planner.cost.estimate`)."""


class _Baseline:
    """The fastest fitting, and the leanest, of the plans without one axis."""

    def __init__(self) -> None:
        self.fastest: Estimate | None = None
        self.leanest: Estimate | None = None

    def offer(self, est: Estimate) -> None:
        if est.fits and (self.fastest is None or est.step_time_s < self.fastest.step_time_s):
            self.fastest = est
        if (self.leanest is None
                or est.memory_per_device_bytes < self.leanest.memory_per_device_bytes):
            self.leanest = est

    @property
    def best(self) -> Estimate | None:
        return self.fastest or self.leanest


def _knobs(ici: dict[str, int]) -> Iterator[tuple[bool, str]]:
    """(sequence_parallel, context_attention) pairs for a mesh."""
    sps = (True, False) if ici["tensor"] > 1 else (False,)
    kinds = ("ring", "allgather") if ici["context"] > 1 else ("allgather",)
    for sp in sps:
        for kind in kinds:
            yield sp, kind


OFFLOAD_MODES = ("never", "auto", "always")
"""When the search tries host offload (:mod:`jaxpar.planner.offload`): ``never``;
``auto``, only when no layout fits without it; ``always``, beside every other choice."""


@dataclasses.dataclass
class _Found:
    """What the passes of one search collect."""

    best: dict[tuple, Estimate] = dataclasses.field(default_factory=dict)
    overflow: list[Estimate] = dataclasses.field(default_factory=list)
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    baselines: dict[str, _Baseline] = dataclasses.field(
        default_factory=lambda: {"context": _Baseline(), "expert": _Baseline()})
    specs: dict[int, ModelSpec] = dataclasses.field(default_factory=dict)
    evaluated: int = 0
    keep: int = 2
    prune: bool = True
    skipped: int = 0
    priced: int = 0
    mesh_best: dict[tuple, float] = dataclasses.field(default_factory=dict)
    listed: dict[tuple, int] = dataclasses.field(default_factory=dict)  # mesh: its turn
    floors: dict[tuple, float] = dataclasses.field(default_factory=dict)  # mesh: its floor
    deferred: list[tuple[ModelSpec, Candidate, Candidate | None, bool]] = dataclasses.field(
        default_factory=list)
    lean_bytes: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"context": math.inf, "expert": math.inf})
    _kth: float = math.inf

    def axes_left_out(self, spec: ModelSpec, cand: Candidate) -> list[str]:
        """The baselines ``cand`` belongs to: ``context`` without a context axis,
        ``expert`` without an expert axis (a mixture of experts only)."""
        return [axis for axis, size in [("context", cand.context)]
                + ([("expert", cand.expert)] if spec.is_moe else []) if size == 1]

    def defer(self, spec: ModelSpec, cand: Candidate, twin: Candidate | None,
              total_bytes: float, overflow: bool) -> None:
        """A candidate that fits neither way, priced later only if the result needs it:
        when nothing fits (``overflow``: a first microbatch count without offload, among
        the leanest plans), or for a baseline none of whose plans fits."""
        self.deferred.append((spec, cand, twin, overflow))
        for axis in self.axes_left_out(spec, cand):
            self.lean_bytes[axis] = min(self.lean_bytes[axis], total_bytes)

    def admit(self, key: tuple, est: Estimate) -> None:
        """A fitting plan, the fastest of its knob set."""
        self.best[key] = est
        mesh = key[:2]
        if est.step_time_s < self.mesh_best.get(mesh, math.inf):
            self.mesh_best[mesh] = est.step_time_s
            times = sorted(self.mesh_best.values())
            self._kth = times[self.keep - 1] if len(times) >= self.keep else math.inf

    def bar(self, spec: ModelSpec, cand: Candidate) -> float:
        """The step time ``cand`` must beat to change the result: the ``keep``-th fastest
        mesh's (the search returns the fastest plan of each mesh), and for a plan without
        a context (or, of a mixture of experts, an expert) axis the fastest such plan
        (the baseline its winner is compared with); inf while too few plans fit."""
        if not self.prune:
            return math.inf
        bar = self._kth
        for axis in self.axes_left_out(spec, cand):
            fastest = self.baselines[axis].fastest
            bar = max(bar, fastest.step_time_s if fastest else math.inf)
        return bar * (1 + TIE_MARGIN)

    def price(self, spec: ModelSpec, machine: Machine, cand: Candidate,
              twin: Candidate | None, global_batch: int, seq: int,
              mems: list[tuple[dict[str, float], bool]] | None = None) -> Estimate:
        """The estimate of ``cand`` or of its twin with the vocabulary over fsdp too:
        the one that fits when only one does, else the faster (``mems``: their
        :func:`~jaxpar.planner.cost.device_memory`, when known)."""
        est = estimate(spec, machine, cand, global_batch, seq,
                       device_bytes=mems[0][0] if mems else None)
        self.priced += 1
        if twin is not None:
            other = estimate(spec, machine, twin, global_batch, seq,
                             device_bytes=mems[1][0] if mems else None)
            self.priced += 1
            if (other.fits, -other.step_time_s) > (est.fits, -est.step_time_s):
                est = other
        return est

    def settle(self, machine: Machine, global_batch: int, seq: int, *,
               overflow: bool) -> None:
        """Price the deferred candidates the result needs: with ``overflow``, when
        nothing fits, the first microbatch counts (the leanest plans come from them);
        and those of a baseline that has no fitting plan."""
        short = {axis for axis, b in self.baselines.items() if b.fastest is None}
        for spec, cand, twin, first in self.deferred:
            lacking = [a for a in self.axes_left_out(spec, cand) if a in short]
            wanted = overflow and first and not self.best
            if not (wanted or lacking):
                continue
            est = self.price(spec, machine, cand, twin, global_batch, seq)
            for axis in lacking:
                self.baselines[axis].offer(est)
            if wanted:
                self.overflow.append(est)
        self.deferred.clear()


def search(spec_for: Callable[[int], ModelSpec], machine: Machine, global_batch: int,
           seq: int, *, precision: str = "bfloat16", optimizer: str = "adamw",
           quantize: str = "none",
           top: int = 5, pipeline: bool = True, contexts: Sequence[int] | None = None,
           experts: Sequence[int] | None = None, offload: str = "never",
           prune: bool = True) -> SearchResult:
    """Rank candidates; ``spec_for(stages)`` gives the model in the layout for that many
    pipeline stages (the reference transformer stores stacked layers as (repeat, stage)).
    ``contexts`` and ``experts`` restrict the sizes of those mesh axes; ``offload`` (one
    of :data:`OFFLOAD_MODES`) says when host offload joins the choices: then every
    setting of :data:`jaxpar.planner.offload.STATES` is tried with the remat policies
    and :data:`jaxpar.planner.offload.REMATS`, in a second pass. Plans that offload
    carry ``notes["no_offload"]``: the fastest plan without offload, or when none fits
    the one needing the least memory. ``prune=False`` prices every candidate (the same
    plans, slower: see the module docstring)."""
    if offload not in OFFLOAD_MODES:
        raise JaxparError(f"offload {offload!r}: choose one of {', '.join(OFFLOAD_MODES)}")
    found = _Found(keep=max(top, 2), prune=prune)
    args = (spec_for, machine, global_batch, seq, found)
    kw = {"precision": precision, "optimizer": optimizer, "quantize": quantize,
          "pipeline": pipeline,
          "contexts": contexts, "experts": experts}
    _search_pass(*args, states=((0.0, False, False),), remats=REMATS, **kw)
    found.settle(machine, global_batch, seq, overflow=True)
    plain = _Baseline()
    for est in [*found.best.values(), *found.overflow]:
        plain.offer(est)
    overflow = list(found.overflow)
    if offload == "always" or (offload == "auto" and not found.best):
        _search_pass(*args, states=offload_lib.STATES, remats=REMATS + offload_lib.REMATS,
                     skip_plain=True, **kw)
        found.settle(machine, global_batch, seq, overflow=False)
    # The fastest knobs per mesh, so the ranking compares layouts, not near-twins; of
    # equally fast ones the first tried (lower ZeRO stage, lighter remat, sequence
    # parallelism before none: the same bytes as plain tensor parallelism, less memory).
    per_mesh: dict[tuple, Estimate] = {}
    for key, est in sorted(found.best.items(), key=lambda kv: found.listed[kv[0][:2]]):
        mesh_key = key[:2]
        if mesh_key not in per_mesh or est.step_time_s < per_mesh[mesh_key].step_time_s:
            per_mesh[mesh_key] = est
    ranked = _rank(list(per_mesh.values()))
    if not ranked:  # the leanest plans without offload (with it, host memory may not fit)
        ranked = sorted(overflow, key=lambda e: e.memory_per_device_bytes)
    result = SearchResult(ranked[:max(top, 2)], found.evaluated, found.rejected,
                          {k: b.best for k, b in found.baselines.items()}, found.skipped,
                          found.priced)
    for est in result.plans:
        est.notes.update({k: v for k, v in result.baselines.items() if v is not None})
        cand = est.candidate
        if cand.offloads and plain.best is not None:
            est.notes["no_offload"] = plain.best
        if cand.sequence_parallel and cand.sizes["tensor"] > 1:
            twin = dataclasses.replace(cand, sequence_parallel=False)
            est.notes["no_sp"] = estimate(found.specs[cand.sizes["stage"]], machine, twin,
                                          global_batch, seq)
    return result


def _search_pass(spec_for: Callable[[int], ModelSpec], machine: Machine, global_batch: int,
                 seq: int, found: _Found, *, states: Sequence[tuple[float, bool, bool]],
                 remats: Sequence[str], precision: str, optimizer: str, quantize: str,
                 pipeline: bool,
                 contexts: Sequence[int] | None, experts: Sequence[int] | None,
                 skip_plain: bool = False) -> None:
    """Evaluate every mesh and knob set with each offload setting of ``states``
    (``(offload_optimizer, host_update, offload_params)``) and each of ``remats``, into
    ``found``; ``skip_plain`` leaves out what a pass without offload has evaluated."""
    base = spec_for(1)
    listed = list(meshes(base, machine, stages=pipeline, seq=seq, global_batch=global_batch,
                         contexts=contexts, experts=experts))
    for i, (ici, dcn) in enumerate(listed):
        key = _mesh_key(ici, dcn)
        found.listed.setdefault(key, i)
        stages = ici["stage"] * dcn["stage"]
        if stages not in found.specs:
            found.specs[stages] = spec_for(stages)
        if found.prune and key not in found.floors:  # once a search: a second pass reuses it
            found.floors[key] = _mesh_floor(found.specs[stages], machine, global_batch, seq,
                                            ici, dcn, precision=precision, quantize=quantize,
                                            optimizer=optimizer)
    if found.prune:  # the promising meshes first: the bar drops early
        listed.sort(key=lambda m: found.floors[_mesh_key(*m)])
    for ici, dcn in listed:
        stages = ici["stage"] * dcn["stage"]
        spec = found.specs[stages]
        dp_max = _batch_ways(ici, dcn)
        if global_batch % dp_max:
            found.rejected["batch not divisible"] = (
                found.rejected.get("batch not divisible", 0) + 1)
            continue
        pipe_ms = [stages, 2 * stages, 4 * stages] if stages > 1 else [0]
        schedules = _schedules(spec.n_layers, stages)
        for zero in (0, 1, 2, 3):
            if dp_max == 1 and zero:
                continue
            for pm, (schedule, repeats) in itertools.product(pipe_ms, schedules):
                micro_cap = global_batch // dp_max // max(pm, 1)
                if micro_cap < 1:
                    continue
                for sp, kind in _knobs(ici):
                    for opt, host, params in states:
                        if params and stages > 1:
                            continue
                        fitted: dict[str, int] = {}  # remat policy: microbatches it fitted at
                        for remat in remats:
                            if skip_plain and not (opt or params) and remat in REMATS:
                                continue
                            cap = _undominated_cap(remat, fitted, micro_cap, machine)
                            if cap < 1:
                                continue
                            n, mb = _fewest_microbatches(
                                spec, machine, global_batch, seq, cap, found, ici=ici,
                                dcn=dcn, zero_stage=zero, remat=remat,
                                pipeline_microbatches=pm, pipeline_schedule=schedule,
                                pipeline_repeats=repeats, precision=precision,
                                quantize=quantize,
                                optimizer=optimizer, sequence_parallel=sp,
                                context_attention=kind, offload_optimizer=opt,
                                host_update=host, offload_params=params)
                            found.evaluated += n
                            if mb:
                                fitted[remat] = mb


def _mesh_key(ici: dict[str, int], dcn: dict[str, int]) -> tuple:
    """A mesh as a dictionary key (the first two entries of a knob set's key)."""
    return tuple(ici.items()), tuple(dcn.items())


def _batch_ways(ici: dict[str, int], dcn: dict[str, int]) -> int:
    """How many ways a mesh splits the global batch: data and fsdp, and the expert axis
    inside a slice."""
    return ici["data"] * dcn["data"] * ici["fsdp"] * dcn["fsdp"] * ici["expert"]


def _mesh_floor(spec: ModelSpec, machine: Machine, global_batch: int, seq: int,
                ici: dict[str, int], dcn: dict[str, int], **knobs: str) -> float:
    """The computation of a mesh's lightest setting (no remat, one microbatch): the
    order the search visits meshes in; inf where that setting cannot run."""
    stages = ici["stage"] * dcn["stage"]
    cand = Candidate.make(ici, dcn, rules="fsdp_tp", microbatches=1, remat="none",
                          pipeline_microbatches=stages if stages > 1 else 0, **knobs)
    if global_batch % _batch_ways(ici, dcn) or check_divisible(spec, cand, global_batch, seq):
        return math.inf
    return step_time_floor(spec, machine, cand, global_batch, seq)


def _schedules(n_layers: int, stages: int) -> list[tuple[str, int]]:
    """Pipeline schedules to try, as (kind, repeats): the circular one (smallest bubble,
    every microbatch's activations kept), 1F1B (about ``stages`` microbatches' inputs
    kept, one forward recomputed), and interleaved 1F1B with two chunks a stage when the
    layers split so."""
    if stages <= 1:
        return [("circular", 0)]
    out = [("circular", 0), ("1f1b", 1)]
    if n_layers % (2 * stages) == 0:
        out.append(("interleaved_1f1b", 2))
    return out


def _undominated_cap(remat: str, fitted: dict[str, int], micro_cap: int,
                     machine: Machine) -> int:
    """The most microbatches worth trying with ``remat``: a policy recomputing a subset of
    what it does that fitted at ``k`` microbatches is at least as fast at ``k`` or more
    (the same step plus less recomputation and fewer rerun collectives), so only fewer
    than ``k`` can win. Not on chips that price saved activations apart (``saved_bw``,
    XLA:CPU), where saving can cost more than recomputing. Run the policies that save
    to the host (:data:`jaxpar.planner.offload.REMATS`) last: they cap nothing."""
    if machine.chip.saved_bw:
        return micro_cap
    mine = set(recomputed_parts(remat))
    # Policies that save to the host pay for transfers: they dominate none.
    lighter = [k for r, k in fitted.items() if set(recomputed_parts(r)) <= mine
               and r not in offload_lib.REMATS]
    return min([micro_cap] + [k // 2 for k in lighter])


def _fewest_microbatches(spec: ModelSpec, machine: Machine, global_batch: int, seq: int,
                         micro_cap: int, found: _Found, *, ici: dict[str, int],
                         dcn: dict[str, int], **knobs) -> tuple[int, int]:
    """Evaluate one mesh and knob set at 1, 2, 4, ... microbatches until it fits;
    returns how many candidates were evaluated and the microbatches that fitted (0:
    none did)."""
    evaluated = 0
    mb = 1
    while mb <= micro_cap:
        cand = Candidate.make(ici, dcn, rules="fsdp_tp", microbatches=mb, **knobs)
        why = check_divisible(spec, cand, global_batch, seq)
        if why:
            key = why.split(" not ")[0] if " not " in why else why
            found.rejected[key] = found.rejected.get(key, 0) + 1
            break
        twin = (dataclasses.replace(cand, vocab_over_fsdp=True) if cand.sizes["fsdp"] > 1
                else None)
        evaluated += 1 + (twin is not None)
        # Memory first (a fraction of an estimate's cost). What fits neither way is priced
        # only if the result turns out to need it (see _Found.settle); past the first
        # microbatch count, only when it is the leanest yet of a baseline.
        mems = [device_memory(spec, machine, c, global_batch, seq)
                for c in (cand, twin) if c is not None]
        if not any(fits for _, fits in mems):
            lean = min(m["total_bytes"] for m, _ in mems)
            if mb == 1 or any(lean < found.lean_bytes[a]
                              for a in found.axes_left_out(spec, cand)):
                found.defer(spec, cand, twin, lean, overflow=mb == 1 and not cand.offloads)
            if all(_stops(m, machine.chip.hbm_bytes) for m, _ in mems):
                break
            mb *= 2
            continue
        # Bound: once the result has its plans, a candidate computing slower than every
        # plan it could displace cannot change it (it fits: the heavier policies capped).
        bar = found.bar(spec, cand)
        if bar < math.inf and all(
                step_time_floor(spec, machine, c, global_batch, seq) > bar
                for c in (cand, twin) if c is not None):
            found.skipped += 1 + (twin is not None)
            return evaluated, mb
        est = found.price(spec, machine, cand, twin, global_batch, seq, mems)
        for axis in found.axes_left_out(spec, cand):
            found.baselines[axis].offer(est)
        key = (*_mesh_key(ici, dcn), cand.zero_stage, cand.remat,
               cand.pipeline_microbatches, cand.pipeline_schedule, cand.pipeline_repeats,
               cand.sequence_parallel, cand.context_attention, cand.offload_optimizer,
               cand.host_update, cand.offload_params)
        found.admit(key, est)
        return evaluated, mb
    return evaluated, 0


def _stops(mem: dict[str, float], hbm_bytes: float) -> bool:
    """Whether more microbatches cannot help a candidate that needs ``mem`` and does not
    fit in ``hbm_bytes``: only activations shrink with microbatching, so stop when they
    are already small next to the state, or when the rest (state, gradients and their
    accumulation buffer, which only grow with microbatches) alone overflows."""
    shrinking = mem["activation_bytes"] + mem["working_bytes"]
    if shrinking < 0.05 * mem["total_bytes"]:
        return True
    return mem["total_bytes"] - shrinking >= hbm_bytes


def _rank(estimates: list[Estimate]) -> list[Estimate]:
    """By step time, in steps of 0.5% of the fastest plan's; plans in the same step are
    ordered by total communication (hidden or not: less traffic is the safer bet when the
    overlap estimate is off)."""
    if not estimates:
        return []
    unit = min(e.step_time_s for e in estimates) / 200 or 1e-12
    return sorted(estimates, key=lambda e: (round(e.step_time_s / unit),
                                            sum(e.comm_s.values())))
