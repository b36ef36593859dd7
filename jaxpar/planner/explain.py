"""Why a plan wins: the one-line reason the planner gives for each plan (against the next
one, and for the winner against the best plan without its context or expert axis), and
the notes on what each parallelism buys."""

from __future__ import annotations

import math

from jaxpar.planner import offload as offload_lib
from jaxpar.planner.cost import Candidate, Estimate
from jaxpar.sharding.mesh import MESH_AXES


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def _where(key: str, cand: Candidate) -> str:
    # The key joins axis names with "x" ("fsdpxtensor"), which "expert" and "context"
    # also contain: match the names instead of splitting.
    joined = key.split(" ", 1)[1] if " " in key else ""
    axes = [a for a in MESH_AXES if a in joined]
    dcn = dict(cand.dcn)
    return "DCN" if any(dcn.get(a, 1) > 1 for a in axes) else "ICI"


def _activations(est: Estimate) -> float:
    return est.memory["activation_bytes"] + est.memory["working_bytes"]


def _context_note(est: Estimate) -> str:
    cand, base = est.candidate, est.notes.get("context")
    c, kind = cand.context, cand.context_attention
    how = ("key/value blocks passed round a ring, overlapped with attention"
           if kind == "ring" else "keys and values all-gathered in every layer")
    split = (f"{c}-way context parallelism ({how}) splits the activations to "
             f"{_gib(_activations(est))} per device")
    if base is None:
        return (f"{split}; no layout without it was possible (every device would need a "
                f"whole sequence of the {est.global_batch} in the batch)")
    if not base.fits:
        return (f"activations at seq {est.seq} do not fit without context parallelism (the "
                f"leanest context=1 plan, {base.candidate.describe()}, needs "
                f"{_gib(base.memory_per_device_bytes)} of {_gib(0.9 * base.hbm_bytes)} usable"
                f"); {split}, {_gib(est.memory_per_device_bytes)} in all")
    gain = 1 - est.step_time_s / base.step_time_s if base.step_time_s else 0.0
    why = ""
    if base.candidate.remat != cand.remat:
        why = (f": shorter sequence shards let it run remat {cand.remat} where that plan "
               f"needs remat {base.candidate.remat} to fit")
    return (f"{split}; {gain * 100:.0f}% faster than the best context=1 plan "
            f"({base.candidate.describe()}, {base.step_time_s:.3f} s){why}")


def _expert_note(est: Estimate) -> str:
    cand, base = est.candidate, est.notes.get("expert")
    e = cand.expert
    a2a = sum(t for k, t in est.comm_s.items() if k.startswith("all-to-all"))
    text = (f"{e}-way expert parallelism keeps 1/{e} of the experts on each device "
            f"({_gib(est.memory['expert_state_bytes'])} of expert weights and optimizer "
            f"state) and moves tokens to them by all-to-all ({a2a:.3f} s a step)")
    if base is None:
        return text
    if not base.fits:
        return (f"{text}; without it the leanest plan ({base.candidate.describe()}) needs "
                f"{_gib(base.memory_per_device_bytes)} per device")
    gain = 1 - est.step_time_s / base.step_time_s if base.step_time_s else 0.0
    return (f"{text}; {gain * 100:.0f}% faster than the best expert=1 plan "
            f"({base.candidate.describe()}, {base.step_time_s:.3f} s, "
            f"{_gib(base.memory['expert_state_bytes'])} of expert state)")


def _sp_note(est: Estimate) -> str:
    twin = est.notes.get("no_sp")
    tp = est.candidate.sizes["tensor"]
    text = (f"sequence parallelism splits the residual stream over tensor={tp} "
            f"(reduce-scatter + all-gather: the all-reduce's bytes)")
    if twin is None:
        return text
    return (f"{text}: activations {_gib(_activations(est))} instead of "
            f"{_gib(_activations(twin))} per device")


def parallelism_notes(est: Estimate) -> list[str]:
    """Why ``est`` uses context, expert or sequence parallelism, one clause each (empty
    when it uses none of them)."""
    cand = est.candidate
    notes = []
    if cand.context > 1:
        notes.append(_context_note(est))
    if cand.expert > 1:
        notes.append(_expert_note(est))
    if cand.sequence_parallel and cand.sizes["tensor"] > 1:
        notes.append(_sp_note(est))
    return notes


def reason(winner: Estimate, runner: Estimate | None, fitting: int = 1) -> str:
    """One line on why ``winner`` beats ``runner``: step time, memory class, and the time
    component that differs most (compute, bubble, or a named collective over ICI/DCN);
    then, when the winner uses them, why context, expert or sequence parallelism
    (:func:`parallelism_notes`), and what host offload moves and costs
    (:func:`jaxpar.planner.offload.offload_note`). Without a ``runner``, ``winner`` is
    the last of the ``fitting`` plans that fit."""
    notes = parallelism_notes(winner) if winner.fits else []
    if winner.fits and winner.candidate.offloads:
        notes.append(offload_lib.offload_note(winner))
    return "; ".join([_versus(winner, runner, fitting), *notes])


def _versus(winner: Estimate, runner: Estimate | None, fitting: int) -> str:
    if not winner.fits:
        return "nothing fits; this plan needs the least memory"
    if runner is None:
        return ("the only plan that fits" if fitting <= 1
                else f"the slowest of the {fitting} plans that fit")
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
    if winner.candidate.offloads or runner.candidate.offloads:
        parts["offload"] = (winner.offload_s, runner.offload_s, "exposed host offload time")
    for key in sorted(set(winner.comm_s) | set(runner.comm_s)):  # ties: a fixed order
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
