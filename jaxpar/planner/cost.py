"""The cost model: per-device memory, FLOPs, collectives and step time of one candidate.

Pure Python arithmetic over the model's tensor shapes (see :mod:`jaxpar.planner.layout`);
no devices, no compilation. Everything is per device and per training step. Memory is in
:mod:`jaxpar.planner.memory`, collectives in :mod:`jaxpar.planner.comms`, the roofline
price of each operation in :mod:`jaxpar.planner.roofline`; this module counts FLOPs,
composes compute and collectives into a step time (:func:`estimate`, which gives the
formula), and says whether a candidate can run at all (:func:`check_divisible`).

FLOPs: model FLOPs follow the PaLM convention (``6 N`` per token plus full ``s x s``
attention) with ``N`` the matmul parameters a token actually uses, so a mixture of experts
counts only its ``experts_per_token`` routed experts and the shared ones. Executed FLOPs
add what the remat policy recomputes, the padding of expert capacity (``capacity factor``
slots per routed choice), the expert work each context shard repeats (the dispatch buffer
is not split over ``context``), less the key blocks a causal mask lets splash, cuDNN and
ring attention skip (flash-style recomputation inside a kernel is not counted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.planner import offload, roofline
from jaxpar.planner.activations import (
    FLASH_ATTENTION,
    attention_kind,
    host_activation_bytes,
    layer_working_bytes,
    loss_working_bytes,
    saved_activation_bytes,
    working_set_bytes,
)
from jaxpar.planner.candidate import (
    CONTEXT_ATTENTION,
    DTYPE_BYTES,
    OPTIMIZER_MOMENTS,
    Candidate,
    dtype_bytes,
    local_sizes,
    pipe_microbatches,
    pipe_repeats,
    scheduled_backward,
)
from jaxpar.planner.catalog import Chip, Machine
from jaxpar.planner.comms import collectives, gradient_runs, transfers
from jaxpar.planner.layout import Layout, layout
from jaxpar.planner.links import PHASES, Transfer, link_terms, mesh_links
from jaxpar.planner.lowering import RING, Lowering, lowering_for
from jaxpar.planner.memory import memory
from jaxpar.planner.model import IdentityMemo, ModelSpec
from jaxpar.planner.roofline import MOE_IMBALANCE, recomputed_parts
from jaxpar.sharding.remat import is_policy

__all__ = ["CAUSAL_SKIPPING", "CONTEXT_ATTENTION", "DTYPE_BYTES", "FLASH_ATTENTION",
           "MOE_IMBALANCE", "OPTIMIZER_MOMENTS", "Candidate", "Estimate", "attention_kind",
           "causal_fraction", "check_divisible", "collectives", "estimate", "hardware_flops",
           "layer_working_bytes", "loss_working_bytes", "memory", "model_flops",
           "saved_activation_bytes", "step_time_floor", "working_set_bytes"]

@dataclasses.dataclass
class Estimate:
    """What the cost model says about one candidate (all figures per device).

    ``hbm_bytes`` and ``host_capacity_bytes`` are the chip's device memory and the host
    memory the runtime will pin for it (0: not known); ``fits`` says the memory model's
    device bytes fit the first and its host bytes (offloaded state) the second, both with
    headroom."""

    candidate: Candidate
    memory: dict[str, float]
    collectives: list[dict[str, Any]]
    flops: float
    model_flops: float
    compute_s: float
    comm_s: dict[str, float]
    bubble: float
    step_time_s: float
    mfu: float
    fits: bool
    hbm_bytes: float
    reason: str = ""
    global_batch: int = 0
    seq: int = 0
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)
    breakdown: dict[str, float] = dataclasses.field(default_factory=dict)
    host_capacity_bytes: float = 0.0

    @property
    def offload_s(self) -> float:
        """Exposed seconds a step spends on host offload (its ``offload ...`` terms)."""
        return sum(t for k, t in self.breakdown.items() if k.startswith("offload"))

    @property
    def memory_per_device_bytes(self) -> float:
        """Peak bytes one device needs: state + batch + XLA's temporaries."""
        return self.memory["total_bytes"]


# --- FLOPs --------------------------------------------------------------------------------
def model_flops(spec: ModelSpec, global_batch: int, seq: int) -> float:
    """Training FLOPs of one step without recomputation: ``6 N`` per token for the matmul
    parameters a token uses (:attr:`ModelSpec.n_active_dense`: all of a dense model's,
    only the routed and shared experts it goes to in a mixture of experts) plus
    ``12 L h_q s`` per token for attention scores and values (the PaLM/Megatron
    convention, full s x s attention). A model with a :attr:`ModelSpec.tracer` (a
    ``model.factory`` model) has its matmul FLOPs counted in its traced step instead
    (:meth:`jaxpar.planner.traced.StepTracer.model_flops`: the same convention)."""
    if spec.tracer is not None:
        return spec.tracer.model_flops(global_batch, seq)
    return _memo(_model_flops, spec, global_batch, seq)


def _model_flops(spec: ModelSpec, global_batch: int, seq: int) -> float:
    tokens = global_batch * seq
    attn = 12 * spec.n_layers * spec.n_heads * spec.head_dim * seq if spec.is_transformer else 0
    return tokens * (6 * spec.n_active_dense + attn)


def _layer_forward_flops(spec: ModelSpec, seq: int) -> dict[str, float]:
    """Forward FLOPs per token of one decoder layer, by part (the dense MLP's, or the
    shared experts' and the router's; the routed experts are in :func:`_expert_forward`)."""
    d, h, n, k, f = spec.d_model, spec.head_dim, spec.n_heads, spec.n_kv_heads, spec.d_ff
    router = 0.0
    if spec.is_moe:
        f = spec.n_shared_experts * spec.expert_d_ff
        router = 2 * d * spec.n_experts
    return {"qkv": 2 * d * h * (n + 2 * k) + router, "wo": 2 * n * h * d,
            "gate_up": 4 * d * f, "down": 2 * f * d, "attention": 4 * n * h * seq}


def _expert_forward(spec: ModelSpec) -> dict[str, float]:
    """Forward FLOPs per token of one layer's routed experts, capacity slots included."""
    if not spec.is_moe:
        return {"gate_up": 0.0, "down": 0.0}
    slots = spec.experts_per_token * (spec.capacity_factor or 1.0)
    return {"gate_up": 4 * spec.d_model * spec.expert_d_ff * slots,
            "down": 2 * spec.expert_d_ff * spec.d_model * slots}


CAUSAL_SKIPPING = ("splash", "cudnn", "ring")
"""Attention kernels that skip the key blocks a causal mask hides entirely (splash's block
mask, cuDNN's flash kernel, the ring's ``lax.cond`` over half-block pairs); XLA's,
``chunked`` and the context all-gather compute every score."""


def causal_fraction(spec: ModelSpec, seq: int, attention: str, context: int = 1) -> float:
    """Share of the full ``s x s`` attention work ``attention`` executes, averaged over the
    layers: with ``n`` blocks a side, a causal layer computes the ``n (n + 1) / 2`` blocks
    on or below the diagonal, ``(1 + 1/n) / 2``; a layer with a sliding window of ``w``
    keys (``spec.sliding_window``) the blocks its band touches, about ``(w + block) / s``.
    Blocks: splash's (``attention_block`` rounded up to 128), cuDNN's (128; under context
    parallelism the chunk pairs it is called on), the ring's half shards (``2 x context``
    of them). 1 for kernels that skip nothing."""
    if attention not in CAUSAL_SKIPPING or seq < 1:
        return 1.0
    if attention == "ring" or (attention == "cudnn" and context > 1):
        n = 2 * context
    else:
        block = 128 if attention == "cudnn" else -(-max(spec.attention_block, 1) // 128) * 128
        n = max(-(-seq // block), 1)
    causal = (1 + 1 / n) / 2
    local = spec.windowed_layers / spec.n_layers if spec.n_layers else 0.0
    if not local or spec.sliding_window >= seq:
        return causal
    band = min(causal, (spec.sliding_window + seq / n) / seq)
    return (1 - local) * causal + local * band


def flops_parts(spec: ModelSpec, global_batch: int, seq: int, remat: str, *,
                attention: str = "xla", context: int = 1) -> tuple[float, float]:
    """Executed FLOPs of one step, globally: (everything but the routed experts, the
    routed experts). See :func:`hardware_flops`."""
    if spec.tracer is not None:
        return _flops_parts(spec, global_batch, seq, remat, attention, context)
    return _memo(_flops_parts, spec, global_batch, seq, remat, attention, context)


def _flops_parts(spec: ModelSpec, global_batch: int, seq: int, remat: str, attention: str,
                 context: int) -> tuple[float, float]:
    tokens = global_batch * seq
    if not spec.is_transformer:
        return model_flops(spec, global_batch, seq) * (4 / 3 if remat == "full" else 1), 0.0
    parts = _layer_forward_flops(spec, seq)
    redo = recomputed_parts(remat)
    dense = sum(v for p, v in parts.items() if p != "attention")  # forward, per layer
    dense_extra = sum(parts[p] for p in redo if p != "attention")
    # Attention: forward 1, backward 2 (x 4 n h s); a remat policy that reruns attention
    # adds one forward. What flash-style kernels and the ring recompute inside their own
    # backward pass is not counted; the causal blocks they skip are (causal_fraction).
    attn = (parts["attention"] * (3 + ("attention" in redo))
            * causal_fraction(spec, seq, attention, context))
    embed_head = 6 * (spec.n_active_dense - spec.n_layers * _active_layer_params(spec))
    dense_hw = tokens * (spec.n_layers * (3 * dense + dense_extra + attn) + embed_head)
    ex = _expert_forward(spec)
    expert_hw = tokens * spec.n_layers * (3 * sum(ex.values()) + sum(
        ex[p] for p in redo if p in ex))
    return dense_hw, expert_hw


def _memo(fn: Callable[..., Any], spec: ModelSpec, *args: Any) -> Any:
    """``fn(spec, *args)``, remembered by the model's identity and the other (hashable)
    arguments; for pure functions of them."""
    return _MEMO.get((spec,), (fn, *args), lambda: fn(spec, *args))


_MEMO = IdentityMemo()


def _active_layer_params(spec: ModelSpec) -> float:
    """Matmul parameters of one decoder layer that a token uses (its routed experts, not
    their capacity padding, included)."""
    p = _layer_forward_flops(spec, 0)
    routed = 3 * spec.d_model * spec.expert_d_ff * spec.experts_per_token if spec.is_moe else 0
    return (p["qkv"] + p["wo"] + p["gate_up"] + p["down"]) / 2 + routed


def hardware_flops(spec: ModelSpec, global_batch: int, seq: int, remat: str, *,
                   attention: str = "xla", context: int = 1) -> float:
    """FLOPs actually executed: the model FLOPs plus the forward matmuls the remat policy
    recomputes (``full``: the whole layer; ``save_attention_and_mlp_outputs``: all but the
    attention-output and MLP-down projections; ``dots_with_no_batch_dims_saveable``: the
    attention score and value products) and the capacity padding of routed experts, less
    the causal blocks an ``attention`` kernel in :data:`CAUSAL_SKIPPING` skips (the ring
    over ``context`` shards)."""
    dense, expert = flops_parts(spec, global_batch, seq, remat, attention=attention,
                                context=context)
    return dense + expert


def chip_backend(chip: Chip) -> str:
    """``cpu``, ``tpu`` (a torus) or ``gpu`` (a switched fabric): which XLA backend the
    chip runs, which sets attention's default kernel and the collectives' forms."""
    if chip.name.startswith("cpu"):
        return "cpu"
    return "tpu" if chip.torus_dims else "gpu"


def _hidden(comm: float, compute: float, overlap: float) -> float:
    """What of ``comm`` seconds stays exposed beside ``compute`` seconds it can run under
    (``overlap``: 1 when collectives run asynchronously, 0 when they block)."""
    return comm - overlap * min(comm, compute)


DATA_PARALLEL = frozenset({"data", "fsdp"})
"""Axes whose collectives in a layer pass are weight gathers and gradient reductions."""


def _contended(tr: Transfer, phase: str, chip: Chip) -> float:
    """The share of ``tr``'s time that stays on the step beside the compute it could
    hide under: the chip's ``contention`` for an FSDP / data-parallel weight gather or
    gradient reduction run inside the layer passes (see
    :data:`jaxpar.planner.catalog.CONTENTION`), 0 for other transfers (exposed whole
    already, or a TPU's collective matmul and the context ring, which hide whole)."""
    if phase not in ("forward", "backward", "gradient") or not chip.overlap:
        return 0.0
    return chip.contention if DATA_PARALLEL.issuperset(tr.axes) else 0.0


def device_memory(spec: ModelSpec, machine: Machine, cand: Candidate, global_batch: int,
                  seq: int, *, backend: str | None = None, hbm_headroom: float = 0.9
                  ) -> tuple[dict[str, float], bool]:
    """The memory part of :func:`estimate` alone, cheaper: ``(memory, fits)``, the same
    figures and verdict :attr:`Estimate.memory` and :attr:`Estimate.fits` hold."""
    backend = backend or chip_backend(machine.chip)
    lay = layout(spec, cand.sizes, cand.rules, cand.zero_stage, cand.vocab_over_fsdp)
    mem = memory(spec, lay, cand, global_batch, seq, backend)
    return mem, _fits(mem, machine.chip, hbm_headroom)


def _fits(mem: dict[str, float], chip: Chip, hbm_headroom: float) -> bool:
    return (mem["total_bytes"] <= hbm_headroom * chip.hbm_bytes
            and offload.host_fits(mem, chip, hbm_headroom))


def estimate(spec: ModelSpec, machine: Machine, cand: Candidate, global_batch: int, seq: int,
             *, backend: str | None = None, hbm_headroom: float = 0.9,
             device_bytes: dict[str, float] | None = None) -> Estimate:
    """Memory, collectives and step time of ``cand`` on ``machine``.

    The computation is priced operation by operation on the chip's roofline
    (:func:`jaxpar.planner.roofline.compute_times`): ``C_f`` and ``C_b``, the layers'
    forward and backward (with remat's recomputation) over every microbatch, ``C_h`` the
    embedding, head and loss, ``U`` the optimizer update. Each collective is priced as
    latency plus bytes over the bandwidth its axes get
    (:func:`jaxpar.planner.links.transfer_time`) and hides where it runs
    (:data:`jaxpar.planner.links.PHASES`): weight gathers of the forward pass ``O_f``
    under ``C_f + C_h``; backward gathers ``O_b`` and gradient reductions ``O_g`` under
    ``C_b``, a reduction run once a step only under the last microbatch's
    ``C_b / microbatches`` (``O_g1``: those, and one microbatch's share of the reductions
    gradient accumulation runs at every microbatch);
    what the compute waits for (``E``: tensor, sequence and expert parallelism, the
    context all-gather, pipeline sends) never hides, and neither does the last gradient
    reduction of a step whose axes cross the data-centre network (slices, or nodes of
    GPUs; those gradient accumulation runs at earlier microbatches hide as ``O_b``): the
    published multislice runs lose throughput per chip as slices are added (MaxText 16B
    on v5e: 1153 tokens/s a chip on one slice, 1038 on 32), which a reduction hidden
    under the backward pass cannot produce; with this rule the efficiencies fitted on
    one half of ``benchmarks/published.py``'s runs predict the other half 80% within
    +-15% (71% without). Of FSDP and data-parallel collectives (weight gathers, gradient
    reductions) the chip's ``contention`` share of their time (0 built in:
    :data:`jaxpar.planner.catalog.CONTENTION`) joins ``E``, only the rest counts in
    ``O_f``, ``O_b`` and ``O_g``. ZeRO 1-2's parameter gather ``O_u`` follows the update.
    With ``x(O, C) = O - overlap x min(O, C)``::

        core = C_f + C_b + C_h + E + x(O_f, C_f + C_h)
               + max(x(O_b + O_g, C_b), x(O_g1, C_b / microbatches)) + H_l
        step = core / (1 - bubble) + U + O_u + H_s
               (+ saved activation bytes / saved_bw where the chip prices them apart)

    with the pipeline bubble ``(p - 1) / (r m + p - 1)`` (``p`` stages, ``r`` repeats,
    ``m`` microbatches), and host offload's exposed transfers inside the layer loop
    (``H_l``: streamed weights, offloaded activations) and after it (``H_s``: optimizer
    state in and out, or the update on the host, which then replaces ``U``; see
    :mod:`jaxpar.planner.offload`). MFU = model FLOPs / (step x peak x chips) is a result, never an
    input. Since model FLOPs count full ``s x s`` attention and causal-skipping kernels
    execute about half of it, MFU can exceed the hardware utilisation at long sequences.
    ``breakdown`` says where the step goes (compute by operation, exposed collectives by
    kind and axes, bubble, update).

    ``device_bytes``: :func:`device_memory`'s figures for ``cand``, when already known.

    Raises:
      JaxparError: when a dimension does not divide over its mesh axes.
    """
    backend = backend or chip_backend(machine.chip)
    lay = layout(spec, cand.sizes, cand.rules, cand.zero_stage, cand.vocab_over_fsdp)
    mem = device_bytes or memory(spec, lay, cand, global_batch, seq, backend)
    rows, moves = _transfers(spec, lay, cand, global_batch, seq, backend,
                             lowering_for(machine.chip.name) if backend == "tpu" else RING)
    n = cand.n_devices
    chip = machine.chip
    mflops = model_flops(spec, global_batch, seq)
    work = _compute(spec, lay, cand, chip, global_batch, seq, backend)
    c_f, c_b, c_h, update = work.c_f, work.c_b, work.c_h, work.update
    loc, attention, micro, stages = work.loc, work.attention, work.micro, work.stages
    breakdown = work.breakdown
    off = _offload_times(spec, lay, cand, chip, loc if spec.is_transformer else None,
                         c_f=c_f, c_b=c_b, update=update, opt_elems=work.opt_elems, seq=seq,
                         attention=attention, microbatches=micro)
    comm: dict[str, float] = {}
    by_phase = dict.fromkeys(PHASES, 0.0)
    timed = []
    links = mesh_links(cand, machine)
    last_gradient = 0.0
    for tr in moves:
        link = links.get((tr.kind, tr.axes)) or link_terms(tr.kind, tr.axes, cand, machine)
        t = link.time(tr)  # transfer_time(tr, cand, machine)
        key = link.name
        comm[key] = comm.get(key, 0.0) + t
        dcn = link.n_dcn > 1
        parts = [(tr.phase, t)]
        runs = gradient_runs(cand, lay, tr.axes) if tr.phase == "gradient" else 1
        if tr.phase == "gradient" and dcn:  # the docstring: the step waits for the last
            parts = [("exposed", t / runs), ("backward", t - t / runs)]
        for phase, part in parts:
            held = part * _contended(tr, phase, chip)
            by_phase["exposed"] += held
            by_phase[phase] += part - held
            if phase == "gradient":  # the share the last microbatch's backward must hide
                last_gradient += (part - held) / runs
            if part > 0:
                timed.append((phase, dcn, key, part - held, held))
    for row in rows:
        key = f"{row['kind']} {'x'.join(row['axes'])}"
        row["time_s"] = comm.get(key, 0.0)
    ov = chip.overlap
    o_f, o_b, o_g = by_phase["forward"], by_phase["backward"], by_phase["gradient"]
    x_f = _hidden(o_f, c_f + c_h, ov)
    x_b = max(_hidden(o_b + o_g, c_b, ov), _hidden(last_gradient, c_b / cand.microbatches, ov),
              0.0)
    exposed_frac = {"forward": x_f / o_f if o_f else 0.0,
                    "backward": x_b / (o_b + o_g) if o_b + o_g else 0.0,
                    "exposed": 1.0, "update": 1.0}
    exposed_frac["gradient"] = exposed_frac["backward"]
    for phase, dcn, key, t, held in timed:
        share = t * exposed_frac[phase] + held
        if share > 0:
            name = f"exposed {key} ({'DCN' if dcn else 'ICI'})"
            breakdown[name] = breakdown.get(name, 0.0) + share
    compute = c_f + c_b + c_h
    core = compute + by_phase["exposed"] + x_f + x_b + off.layers
    if off.device_update is not None:  # the update runs on the host
        update = off.device_update
    bubble = _bubble(spec, cand)
    if stages > 1:
        breakdown["pipeline bubble"] = core * bubble / (1 - bubble)
    breakdown["optimizer update"] = update
    breakdown.update(off.breakdown)
    step = core / (1 - bubble) + update + by_phase["update"] + off.step
    if chip.saved_bw:  # XLA:CPU: storing and reloading the scan's saved activations
        inflight = work.pipe_m if stages > 1 and not scheduled_backward(cand) else 1
        saved = mem["activation_bytes"] / inflight * micro / chip.saved_bw
        breakdown["saved activations"] = saved
        step += saved
    mfu = mflops / (step * chip.peak_flops * n) if step > 0 else 0.0
    fits = _fits(mem, chip, hbm_headroom)
    return Estimate(cand, mem, rows, work.hflops, mflops / n, compute + update, comm, bubble, step,
                    mfu, fits, chip.hbm_bytes, global_batch=global_batch, seq=seq,
                    breakdown=breakdown, host_capacity_bytes=chip.host_pool_bytes)


def step_time_floor(spec: ModelSpec, machine: Machine, cand: Candidate, global_batch: int,
                    seq: int, *, backend: str | None = None) -> float:
    """A lower bound of :func:`estimate`'s ``step_time_s`` for ``cand``, at a fraction of
    its cost: the computation alone, stretched by the pipeline bubble. Everything else
    the step formula adds (exposed collectives and host transfers, the update, saved
    activations' traffic) is zero or more, so no estimate of ``cand`` is faster; the
    search skips pricing a candidate whose floor is slower than every plan it could
    displace."""
    backend = backend or chip_backend(machine.chip)
    lay = layout(spec, cand.sizes, cand.rules, cand.zero_stage, cand.vocab_over_fsdp)
    work = _compute(spec, lay, cand, machine.chip, global_batch, seq, backend)
    return (work.c_f + work.c_b + work.c_h) / (1 - _bubble(spec, cand))


@dataclasses.dataclass
class _Work:
    """The computation of one step on one device (see :func:`estimate`): the seconds of
    the layers' forward and backward passes, of the embedding, head and loss, and of the
    optimizer update; executed FLOPs; and what the rest of the estimate reads."""

    c_f: float
    c_b: float
    c_h: float
    update: float
    hflops: float
    breakdown: dict[str, float]
    stages: int
    pipe_m: int
    micro: int
    opt_elems: float
    attention: str
    loc: Any


def _compute(spec: ModelSpec, lay: Layout, cand: Candidate, chip: Chip, global_batch: int,
             seq: int, backend: str) -> _Work:
    """The roofline seconds of ``cand``'s computation (the ``C`` terms of
    :func:`estimate`), with the FLOPs and the breakdown's compute rows."""
    n = cand.n_devices
    attention = attention_kind(spec, cand, backend, seq)
    dense, expert = flops_parts(spec, global_batch, seq, cand.remat, context=cand.context,
                                attention=attention)
    # Expert work is split over every axis but context, whose shards repeat it.
    hflops = dense / n + expert * cand.context / n
    stages = cand.sizes.get("stage", 1)
    pipe_m = pipe_microbatches(cand, stages) if stages > 1 else 1
    micro = cand.microbatches * pipe_m
    opt_elems = lay.total("zero") if cand.zero_stage >= 1 else lay.total("base")
    breakdown: dict[str, float] = {}
    loc = None
    if spec.is_transformer:
        loc = local_sizes(spec, lay, cand, global_batch, seq)
        times = roofline.compute_times(
            spec, loc, cand, chip, attention=attention,
            causal=causal_fraction(spec, seq, attention, cand.context),
            recomputed=recomputed_parts(cand.remat), local_state=opt_elems,
            local_grads=lay.total("compute"))
        runs = micro * spec.n_layers / stages
        c_f, c_b, c_h = runs * times.layer_fwd, runs * times.layer_bwd, micro * times.head
        if stages > 1 and scheduled_backward(cand):
            # A 1F1B backward reruns its chunk's forward pass from the stored input.
            c_b += c_f
            breakdown["compute 1F1B forward recomputation"] = c_f
            hflops += (flops_parts(spec, global_batch, seq, "full", context=cand.context,
                                   attention=attention)[0] - dense) / n
        for part, t in times.parts.items():
            if t:
                breakdown[f"compute {part}"] = runs * t
        breakdown["compute embedding, head and loss"] = c_h
        update = times.update
    else:  # a generic model: FLOPs at the matmul rate, a third forward
        rate = (chip.matmul_flops_f32 if dtype_bytes(cand.precision) >= 4 else chip.peak_flops)
        total = hflops / (rate * chip.matmul_efficiency)
        c_f, c_b, c_h = total / 3, 2 * total / 3, 0.0
        breakdown["compute matmuls"] = total
        update = roofline.update_time(chip, cand, opt_elems, lay.total("compute"))
    return _Work(c_f, c_b, c_h, update, hflops, breakdown, stages, pipe_m, micro, opt_elems,
                 attention, loc)


def _bubble(spec: ModelSpec, cand: Candidate) -> float:
    """The pipeline bubble's share of the step, ``(p - 1) / (r m + p - 1)`` (0 without
    stages)."""
    stages = cand.sizes.get("stage", 1)
    if stages <= 1:
        return 0.0
    repeats = pipe_repeats(cand, spec.n_layers, stages)
    return (stages - 1) / (repeats * pipe_microbatches(cand, stages) + stages - 1)


def _transfers(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int,
               backend: str, lowering: Lowering = RING
               ) -> tuple[list[dict[str, Any]], list[Transfer]]:
    """:func:`jaxpar.planner.comms.transfers`, remembered by what it reads: the search
    asks again for candidates that differ only in what the collectives do not see (the
    remat policy, beyond whether it reruns the forward pass's collectives)."""
    remat = cand.remat
    if remat != "none" and not remat.startswith("recompute="):
        remat = "*"  # any policy but none reruns them alike (see comms._tensor)
    rows, moves = _COLLECTED.get(
        (spec, lay), (global_batch, seq, backend, remat, lowering,
                      *[getattr(cand, name) for name in _FIELDS]),
        lambda: transfers(spec, lay, cand, global_batch, seq, backend, lowering))
    return [{**row, "axes": list(row["axes"])} for row in rows], list(moves)


_COLLECTED = IdentityMemo()
_FIELDS = tuple(f.name for f in dataclasses.fields(Candidate) if f.name != "remat")


def _offload_times(spec: ModelSpec, lay: Any, cand: Candidate, chip: Chip, loc: Any, *,
                   c_f: float, c_b: float, update: float, opt_elems: float, seq: int,
                   attention: str, microbatches: int) -> offload.OffloadTimes:
    """The exposed seconds of ``cand``'s host offload (:func:`jaxpar.planner.offload.
    offload_times`), from what it moves and the layers' compute times (``loc``: the
    per-device sizes of a transformer, None for another model)."""
    if not cand.offloads:
        return offload.OffloadTimes()
    acts = 0.0
    if loc is not None:  # one microbatch's offloaded activations, all layers of the stage
        act = dtype_bytes(cand.precision)
        acts = (spec.n_layers / lay.sizes.get("stage", 1)
                * host_activation_bytes(spec, loc, seq, cand.remat, act, attention))
    state = offload.state_offload(spec, lay, cand)
    store = lay.total("zero") if cand.zero_stage >= 3 else lay.total("base")
    return offload.offload_times(chip, cand, state, activations=acts, c_f=c_f, c_b=c_b,
                                 update=update, opt_elems=opt_elems, store_elems=store,
                                 local_grads=lay.total("compute"), microbatches=microbatches)


def check_divisible(spec: ModelSpec, cand: Candidate, global_batch: int, seq: int = 0
                    ) -> str | None:
    """Why ``cand`` cannot run ``spec`` (a short reason), or None when it can.

    ``seq`` (when given) is checked against context parallelism's balanced layout, which
    cuts each sequence into ``2 x context`` equal chunks.
    """
    sizes = cand.sizes
    tp = sizes["tensor"]
    if tp > 1 and cand.rules in ("tp", "fsdp_tp") and spec.is_transformer:
        mlp = (("expert_d_ff", spec.expert_d_ff),) if spec.is_moe else (("d_ff", spec.d_ff),)
        for name, value in (("n_heads", spec.n_heads), ("n_kv_heads", spec.n_kv_heads),
                            *mlp, ("vocab_size", spec.vocab_size)):
            if value % tp:
                return f"model.{name}={value} not divisible by tensor={tp}"
    stages = sizes["stage"]
    if stages > 1 and spec.n_layers % stages:
        return f"model.n_layers={spec.n_layers} not divisible by stage={stages}"
    if stages > 1 and (spec.is_moe or cand.context > 1):
        return "pipeline stages with experts or context parallelism are not supported"
    if cand.context_attention not in CONTEXT_ATTENTION:
        return f"unknown context attention {cand.context_attention!r}"
    if cand.context > 1 and seq and seq % (2 * cand.context):
        return f"seq={seq} not divisible by 2 x context={cand.context}"
    if cand.expert > 1 and spec.is_moe:
        if spec.n_experts % cand.expert:
            return f"model.n_experts={spec.n_experts} not divisible by expert={cand.expert}"
        if not spec.capacity_factor:
            return "dropless experts (expert_capacity=0) run without an expert axis"
    try:
        lay = layout(spec, sizes, cand.rules, cand.zero_stage, cand.vocab_over_fsdp)
    except JaxparError as err:
        return str(err)
    micro = cand.microbatches * (pipe_microbatches(cand, stages) if stages > 1 else 1)
    if global_batch % (lay.dp * micro):
        return (f"global batch {global_batch} not divisible by data-parallel {lay.dp} x "
                f"microbatches {micro}")
    if not is_policy(cand.remat):
        return f"unknown remat {cand.remat!r}"
    return offload.check(spec, cand)
