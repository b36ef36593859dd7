"""The search: enumerate meshes and knobs, drop what does not fit, rank by step time.

Mesh shapes: every split of one slice's chips over ``data x stage x fsdp x tensor`` (tensor
parallelism stays inside an ICI domain, at most 16 ways, and must divide heads, KV heads,
d_ff and vocab; stages must divide the layers) times every split of the slices over
``data x stage x fsdp`` (DCN). For each mesh: ZeRO stages 0-3, the remat policies, and the
fewest gradient-accumulation microbatches that fit in HBM (more only cost time). Pruning
keeps this to a few thousand cost-model evaluations, well under a second per thousand
chips.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

from jaxpar.planner.catalog import Machine
from jaxpar.planner.cost import Candidate, Estimate, check_divisible, estimate
from jaxpar.planner.model import ModelSpec

REMATS = ("none", "save_attention_and_mlp_outputs", "dots_with_no_batch_dims_saveable", "full")
MAX_TENSOR = 16
MAX_STAGES = 16


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


def meshes(spec: ModelSpec, machine: Machine, *, stages: bool = True
           ) -> Iterator[tuple[dict[str, int], dict[str, int]]]:
    """(ICI sizes, DCN sizes) pairs worth evaluating for ``spec`` on ``machine``
    (``stages=False``: no pipeline axis)."""
    per_slice = machine.per_slice
    layers = spec.n_layers or 1
    for data, stage, fsdp, tensor in _splits(per_slice, 4):
        if tensor > min(MAX_TENSOR, machine.chip.domain) or stage > MAX_STAGES:
            continue
        if stage > 1 and (not stages or not spec.is_transformer or layers % stage):
            continue
        for d_data, d_stage, d_fsdp in _splits(machine.slices, 3):
            total_stage = stage * d_stage
            if total_stage > 1 and (not stages or not spec.is_transformer or layers % total_stage
                                    or total_stage > MAX_STAGES):
                continue
            yield ({"data": data, "stage": stage, "fsdp": fsdp, "tensor": tensor},
                   {"data": d_data, "stage": d_stage, "fsdp": d_fsdp, "tensor": 1})


@dataclasses.dataclass
class SearchResult:
    """Ranked plans (fitting ones first, by step time) and how many were looked at."""

    plans: list[Estimate]
    evaluated: int
    rejected: dict[str, int]


def search(spec_for: Callable[[int], ModelSpec], machine: Machine, global_batch: int,
           seq: int, *, precision: str = "bfloat16", optimizer: str = "adamw",
           top: int = 5, pipeline: bool = True) -> SearchResult:
    """Rank candidates; ``spec_for(stages)`` gives the model in the layout for that many
    pipeline stages (the reference transformer stores stacked layers as (repeat, stage))."""
    base = spec_for(1)
    best: dict[tuple, Estimate] = {}
    overflow: list[Estimate] = []
    rejected: dict[str, int] = {}
    evaluated = 0
    specs: dict[int, ModelSpec] = {}
    for ici, dcn in meshes(base, machine, stages=pipeline):
        stages = ici["stage"] * dcn["stage"]
        if stages not in specs:
            specs[stages] = spec_for(stages)
        spec = specs[stages]
        dp_max = ici["data"] * dcn["data"] * ici["fsdp"] * dcn["fsdp"]
        if global_batch % dp_max:
            rejected["batch not divisible"] = rejected.get("batch not divisible", 0) + 1
            continue
        pipe_ms = [stages, 2 * stages, 4 * stages] if stages > 1 else [0]
        for zero in (0, 1, 2, 3):
            if dp_max == 1 and zero:
                continue
            for remat in REMATS:
                for pm in pipe_ms:
                    micro_cap = global_batch // dp_max // max(pm, 1)
                    if micro_cap < 1:
                        continue
                    mb = 1
                    while mb <= micro_cap:
                        cand = Candidate.make(ici, dcn, rules="fsdp_tp", zero_stage=zero,
                                              remat=remat, microbatches=mb,
                                              pipeline_microbatches=pm, precision=precision,
                                              optimizer=optimizer)
                        why = check_divisible(spec, cand, global_batch)
                        if why:
                            key = why.split(" not ")[0] if " not " in why else why
                            rejected[key] = rejected.get(key, 0) + 1
                            break
                        est = estimate(spec, machine, cand, global_batch, seq)
                        evaluated += 1
                        if est.fits:
                            key = (tuple(ici.items()), tuple(dcn.items()), zero, remat, pm)
                            best[key] = est
                            break
                        if mb == 1:
                            overflow.append(est)
                        # Only activations shrink with microbatching; stop when they
                        # are already small next to the state.
                        mem = est.memory
                        if mem["activation_bytes"] + mem["working_bytes"] < 0.05 * mem[
                                "total_bytes"]:
                            break
                        mb *= 2
    # The fastest knobs per mesh, so the ranking compares layouts, not near-twins.
    per_mesh: dict[tuple, Estimate] = {}
    for key, est in best.items():
        mesh_key = key[:2]
        if mesh_key not in per_mesh or est.step_time_s < per_mesh[mesh_key].step_time_s:
            per_mesh[mesh_key] = est
    ranked = _rank(list(per_mesh.values()))
    if not ranked:
        ranked = sorted(overflow, key=lambda e: e.memory_per_device_bytes)
    return SearchResult(ranked[:max(top, 2)], evaluated, rejected)


def _rank(estimates: list[Estimate]) -> list[Estimate]:
    """By step time, in steps of 0.5% of the fastest plan's; plans in the same step are
    ordered by total communication (hidden or not: less traffic is the safer bet when the
    overlap estimate is off)."""
    if not estimates:
        return []
    unit = min(e.step_time_s for e in estimates) / 200 or 1e-12
    return sorted(estimates, key=lambda e: (round(e.step_time_s / unit),
                                            sum(e.comm_s.values())))


# --- explanation --------------------------------------------------------------------------
def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def _where(key: str, cand: Candidate) -> str:
    axes = key.split(" ", 1)[1].split("x") if " " in key else []
    dcn = dict(cand.dcn)
    return "DCN" if any(dcn.get(a, 1) > 1 for a in axes) else "ICI"


def reason(winner: Estimate, runner: Estimate | None) -> str:
    """One line on why ``winner`` beats ``runner``: step time, memory class, and the time
    component that differs most (compute, bubble, or a named collective over ICI/DCN)."""
    if runner is None:
        return "the only plan that fits"
    if not winner.fits:
        return "nothing fits; this plan needs the least memory"
    gain = 1 - winner.step_time_s / runner.step_time_s if runner.step_time_s else 0.0
    if abs(gain) < 0.005:
        cw, cr = sum(winner.comm_s.values()), sum(runner.comm_s.values())
        tie = (f"ties with {runner.candidate.describe()} on step time (communication "
               f"hidden under compute)")
        mems = (f"{_gib(winner.memory_per_device_bytes)} vs "
                f"{_gib(runner.memory_per_device_bytes)} per device")
        if cr > cw * 1.005:
            return (f"{tie} and spends {(1 - cw / cr) * 100:.1f}% less time in collectives "
                    f"({cw:.3f} s vs {cr:.3f} s), {mems}")
        return (f"{tie} and in collectives ({cw:.3f} s each): a coin toss between the two "
                f"by this model; {mems}")
    mw, mr = winner.memory_per_device_bytes, runner.memory_per_device_bytes
    ratio = mw / mr if mr else 1.0
    mem = ("same memory class" if 0.8 <= ratio <= 1.25 else
           f"{_gib(mw)} vs {_gib(mr)} per device")
    parts: dict[str, tuple[float, float, str]] = {
        "compute": (winner.compute_s, runner.compute_s, "compute (remat or FLOPs)"),
        "bubble": (winner.bubble * winner.step_time_s, runner.bubble * runner.step_time_s,
                   "pipeline bubble"),
    }
    for key in set(winner.comm_s) | set(runner.comm_s):
        w, r = winner.comm_s.get(key, 0.0), runner.comm_s.get(key, 0.0)
        owner = winner.candidate if w >= r else runner.candidate
        parts[key] = (w, r, f"{key} time over {_where(key, owner)}")
    name, (w, r, label) = max(parts.items(), key=lambda kv: abs(kv[1][1] - kv[1][0]))
    if r > w:
        detail = f"{(1 - w / r) * 100:.0f}% less {label}" if r else label
    else:
        detail = f"{label} {(w / r - 1) * 100 if r else 100:.0f}% higher but outweighed"
    return (f"{gain * 100:.1f}% faster than {runner.candidate.describe()} "
            f"(zero {runner.candidate.zero_stage}, remat {runner.candidate.remat}): "
            f"{mem}, {detail}")


def tokens_per_s(est: Estimate, global_batch: int, seq: int) -> float:
    """Training throughput of a plan."""
    return global_batch * seq / est.step_time_s if est.step_time_s else math.inf
