"""The cost model: per-device memory, FLOPs, collectives and step time of one candidate.

Pure Python arithmetic over the model's tensor shapes (see :mod:`jaxpar.planner.layout`);
no devices, no compilation. Everything is per device and per training step.

Memory follows the Trainer's state layout: working parameters (compute dtype under mixed
precision), f32 master weights (mixed precision only), optimizer moments, each sharded as
the ZeRO stage says; plus what the compiled step needs on top (XLA's "temp"): gradient
buffers, the activations saved for the backward pass (by remat policy), and the working
set of one layer's backward pass and of the loss.

Collectives are listed as XLA emits them for the reference transformer:

* gradient reduction over the data-parallel axes: an all-reduce, or a reduce-scatter onto
  the axes the stored gradient is split over (ZeRO 2-3, FSDP). XLA:CPU has no
  reduce-scatter; it all-reduces the full gradient and slices (``backend="cpu"``);
* all-gathers of weights stored split over data-parallel axes (FSDP, ZeRO-3) to their
  compute layout, in the forward and again in the backward pass;
* ZeRO 1-2: one all-gather of the updated parameters from the sharded master weights;
* Megatron tensor parallelism: all-reduces of the ``(tokens, d_model)`` activations: 2 per
  layer forward (attention and MLP outputs) and, in the backward pass, one per
  column-parallel projection (q, k, v, gate, up: 5), plus one for the vocab-parallel
  embedding and one for the head's input gradient; remat reruns the forward's 2;
* pipeline: one collective-permute of a microbatch's activations per iteration and
  direction.

Per-layer collectives sit inside the layer scan's loop body, so the optimized HLO text holds
them once; ``bytes_per_device`` reports them that way (what :func:`jaxpar.inspect.
parse_collectives` reads), and ``bytes_per_step`` multiplies by the executions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.mesh import MESH_AXES
from jaxpar.planner.catalog import Machine
from jaxpar.planner.layout import Layout, layout
from jaxpar.planner.model import ModelSpec
from jaxpar.remat import POLICIES

OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1, "adafactor": 0}
DTYPE_BYTES = {"float32": 4, "f32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "f16": 2}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the step: mesh (ICI and DCN parts per axis) and knobs.

    ``precision`` is the compute dtype (``float32``: no mixed precision; ``bfloat16``:
    f32 master weights, bf16 working copy and compute). ``pipeline_microbatches`` 0 means
    one per stage.
    """

    ici: tuple[tuple[str, int], ...]
    dcn: tuple[tuple[str, int], ...] = ()
    rules: str = "fsdp_tp"
    zero_stage: int = 0
    remat: str = "none"
    microbatches: int = 1
    pipeline_microbatches: int = 0
    precision: str = "bfloat16"
    optimizer: str = "adamw"

    @staticmethod
    def make(ici: dict[str, int], dcn: dict[str, int] | None = None, **knobs: Any) -> Candidate:
        """Build from dicts (axes left out have size 1)."""
        i = tuple((a, int(ici.get(a, 1))) for a in MESH_AXES)
        d = tuple((a, int((dcn or {}).get(a, 1))) for a in MESH_AXES)
        return Candidate(i, d, **knobs)

    @property
    def sizes(self) -> dict[str, int]:
        """Total size of each mesh axis (ICI x DCN)."""
        dcn = dict(self.dcn)
        return {a: s * dcn.get(a, 1) for a, s in self.ici}

    @property
    def n_devices(self) -> int:
        """Devices the mesh spans."""
        return math.prod(self.sizes.values())

    def mesh_dict(self) -> dict[str, dict[str, int]]:
        """``{axis: {"size", "ici", "dcn"}}`` for every axis."""
        dcn = dict(self.dcn)
        return {a: {"size": s * dcn.get(a, 1), "ici": s, "dcn": dcn.get(a, 1)}
                for a, s in self.ici}

    def describe(self) -> str:
        """E.g. ``fsdp=16 x tensor=4 (dcn data=2)``."""
        dcn = dict(self.dcn)
        parts = [f"{a}={s}" for a, s in self.ici if s > 1] or ["single"]
        slow = [f"{a}={s}" for a, s in dcn.items() if s > 1]
        return " x ".join(parts) + (f" (dcn {' x '.join(slow)})" if slow else "")


@dataclasses.dataclass
class Estimate:
    """What the cost model says about one candidate (all figures per device)."""

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

    @property
    def memory_per_device_bytes(self) -> float:
        """Peak bytes one device needs: state + batch + XLA's temporaries."""
        return self.memory["total_bytes"]


def _bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise JaxparError(f"unknown precision {dtype!r}; choose from {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# --- per-device token and head counts ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Local:
    seqs: float  # sequences per device per microbatch
    tokens: float  # seqs x seq
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int


def _local(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int
           ) -> _Local:
    tp = math.prod(lay.sizes[a] for a in lay.tp_axes)
    split = lambda n: n // tp if tp > 1 and n % tp == 0 else n
    stages = lay.sizes.get("stage", 1)
    micro = cand.microbatches * (_pipe_m(cand, stages) if stages > 1 else 1)
    seqs = global_batch / lay.dp / micro
    return _Local(seqs, seqs * seq, split(spec.n_heads), split(spec.n_kv_heads),
                  split(spec.d_ff), split(spec.vocab_size))


def _pipe_m(cand: Candidate, stages: int) -> int:
    return cand.pipeline_microbatches or stages


# --- memory -------------------------------------------------------------------------------
FLASH_ATTENTION = ("chunked", "cudnn", "splash")
"""Attention implementations that never hold a ``seq x seq`` score matrix: their backward
pass recomputes scores from the saved output and log-sum-exp (see :mod:`jaxpar.attention`)."""


def attention_kind(spec: ModelSpec, cand: Candidate, backend: str) -> str:
    """The implementation ``spec.attention`` runs as (see :func:`jaxpar.attention.resolve`):
    ``auto`` is splash on a TPU, cuDNN's fused kernel on a GPU in half precision, XLA's
    (scores materialised) otherwise."""
    if spec.attention != "auto":
        return spec.attention
    if backend == "tpu":
        return "splash"
    return "cudnn" if backend == "gpu" and _bytes(cand.precision) == 2 else "xla"


def saved_activation_bytes(spec: ModelSpec, loc: _Local, seq: int, remat: str, act: int,
                           attention: str = "xla") -> float:
    """Bytes per layer kept from the forward pass for the backward pass.

    Without remat, the tensors the backward of a Llama block reads (XLA keeps them, per
    token): the attention logits (f32) and probabilities (``heads x seq`` each), q and the
    attention output (``heads x head_dim`` each), k and v, and six ``d_model``- and six
    ``d_ff``-sized tensors (norm inputs and outputs, residual branches; gate, up, their
    activations and product). ``full`` keeps only the block input; the other policies
    keep the matmul outputs they name. Flash-style ``attention`` (:data:`FLASH_ATTENTION`)
    keeps no score-sized tensor, only an f32 log-sum-exp per head.
    """
    d, h = spec.d_model, spec.head_dim
    n, k, f = loc.heads, loc.kv_heads, loc.d_ff
    # Per token: what attention keeps beyond q, k, v and its output (f32 scores, and
    # probabilities in the compute dtype; flash-style: one f32 log-sum-exp per head).
    flash = attention in FLASH_ATTENTION
    scores, probs = (n * 4, 0) if flash else (n * seq * 4, n * seq * act)
    if remat == "none":
        per_token = scores + probs + act * (6 * f + 6 * d + 2 * n * h + 2 * k * h)
    elif remat == "full":
        per_token = act * d
    elif remat in ("dots_saveable", "offload_dots"):
        per_token = scores + act * (2 * n * h + 2 * k * h + 2 * d + 3 * f)
    elif remat == "dots_with_no_batch_dims_saveable":
        per_token = act * (2 * n * h + 2 * k * h + 2 * d + 3 * f)
    else:  # save_attention_and_mlp_outputs
        per_token = act * 3 * d
    if remat == "offload_dots":
        per_token = act * d
    return per_token * loc.tokens


def layer_working_bytes(spec: ModelSpec, loc: _Local, seq: int, act: int,
                        attention: str = "xla") -> float:
    """Transient bytes while one layer runs its backward pass.

    Attention's backward holds score-sized (``heads x seq`` per token) f32 buffers: the
    recomputed softmax, its gradient and the logits' gradient, plus two more d_ff-sized
    and several d_model-sized gradients. Flash-style ``attention`` holds those for one key
    block at a time (``heads x attention_block`` per token), plus f32 copies of q, the
    output's gradient and the q, k, v gradients it accumulates.
    """
    d, h = spec.d_model, spec.head_dim
    n, k = loc.heads, loc.kv_heads
    if attention in FLASH_ATTENTION:
        block = min(spec.attention_block, seq) if spec.attention_block > 0 else seq
        score = 3 * n * block * 4 + 4 * (4 * n * h + 2 * k * h)
    else:
        score = 3 * n * seq * 4
    return loc.tokens * (score + act * (4 * loc.d_ff + 8 * d))


def loss_working_bytes(spec: ModelSpec, loc: _Local, seq: int) -> float:
    """Transient bytes of the loss and its gradient: f32 logits and their gradient
    (``vocab`` per token each) for every token; with ``loss_chunk``, for ``loss_chunk``
    positions of each sequence at a time, plus the chunk's softmax (the gradient of a
    recomputed chunk does not reuse its logits' buffer; measured on XLA:CPU)."""
    if spec.loss_chunk:
        return loc.seqs * min(spec.loss_chunk, seq) * 3 * loc.vocab * 4
    return loc.tokens * 2 * loc.vocab * 4


def working_set_bytes(spec: ModelSpec, loc: _Local, seq: int, act: int,
                      attention: str = "xla") -> float:
    """Transient bytes while one layer runs its backward pass, or while the loss runs
    (the larger: they never coexist); see :func:`layer_working_bytes` and
    :func:`loss_working_bytes`."""
    return max(layer_working_bytes(spec, loc, seq, act, attention),
               loss_working_bytes(spec, loc, seq))


def memory(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int,
           backend: str = "tpu") -> dict[str, float]:
    """Per-device bytes: state (``argument``), XLA temporaries (``temp``) and their sum."""
    c = _bytes(cand.precision)
    mixed = c != 4
    stage = cand.zero_stage
    base, zero = lay.total("base"), lay.total("zero")
    store = zero if stage >= 3 else base
    opt_elems = zero if stage >= 1 else base
    moments = OPTIMIZER_MOMENTS.get(cand.optimizer, 2)
    params = store * (c if mixed else 4)
    master = opt_elems * 4 if mixed else 0
    opt = moments * opt_elems * 4
    batch = global_batch * (seq + 1) * 4 / lay.dp
    act = c
    loc = _local(spec, lay, cand, global_batch, seq)
    stages = lay.sizes.get("stage", 1)
    if spec.is_transformer:
        layers = spec.n_layers / stages
        attention = attention_kind(spec, cand, backend)
        saved = layers * saved_activation_bytes(spec, loc, seq, cand.remat, act, attention)
        if stages > 1:  # the pipeline keeps every in-flight microbatch's activations
            saved *= min(_pipe_m(cand, stages), stages)
        # XLA:CPU runs bf16 matmuls in f32, so its transients are f32 whatever the policy.
        layer_work = layer_working_bytes(spec, loc, seq, 4 if backend == "cpu" else c,
                                         attention)
        loss_work = loss_working_bytes(spec, loc, seq)
    else:
        saved = layer_work = loss_work = 0.0
    # Gradients: the backward pass accumulates them in the compute layout (f32 on CPU,
    # compute dtype elsewhere); with gradient accumulation an f32 running sum as well.
    grads = lay.total("compute") * (4 if backend == "cpu" else c)
    if cand.microbatches > 1:
        grads += base * 4
    # The update: clipped gradients and Adam's new moments in the optimizer's layout.
    update = opt_elems * 4
    # The loss runs first in the backward pass and the update after it, so the update's
    # buffers never meet the loss's working set (counting them with a layer's is the
    # calibrated approximation).
    work = max(layer_work, loss_work)
    temp = grads + saved + max(layer_work + update, loss_work)
    argument = params + master + opt + batch
    return {"param_bytes": params, "master_bytes": master, "opt_bytes": opt,
            "batch_bytes": batch, "grad_bytes": grads, "activation_bytes": saved,
            "working_bytes": work, "update_bytes": update, "argument_bytes": argument,
            "output_bytes": argument - batch, "temp_bytes": temp,
            "total_bytes": argument + temp}


# --- collectives --------------------------------------------------------------------------
def collectives(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int,
                backend: str = "tpu") -> list[dict[str, Any]]:
    """The collectives of one step, grouped by (kind, axes).

    Each row: ``kind``, ``axes``, ``count`` (instructions in the HLO text),
    ``bytes_per_device`` (their result bytes, loop bodies once, as the HLO text reads) and
    ``bytes_per_step`` / ``executions`` (what actually runs, every layer and microbatch).
    """
    c = _bytes(cand.precision)
    wire = 4 if backend == "cpu" else c  # XLA:CPU upcasts bf16 before communicating
    stages = lay.sizes.get("stage", 1)
    layers = spec.n_layers // stages if spec.n_layers else 1
    micro = cand.microbatches
    remat = cand.remat != "none"
    rows: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}

    def add(kind: str, axes: tuple[str, ...], nbytes: float, static: int, runs: int) -> None:
        axes = tuple(a for a in MESH_AXES if a in axes and lay.sizes[a] > 1)
        if not axes or nbytes <= 0:
            return
        row = rows.setdefault((kind, axes), {"kind": kind, "axes": list(axes), "count": 0,
                                             "bytes_per_device": 0.0, "bytes_per_step": 0.0,
                                             "executions": 0})
        row["count"] += static
        row["bytes_per_device"] += nbytes * static
        row["bytes_per_step"] += nbytes * runs
        row["executions"] += runs

    for p in lay.placed:
        # A stacked layer weight: the loop body moves one layer's slice, ``per`` times.
        per = layers if p.tensor.per_layer else 1
        p = dataclasses.replace(p, compute=p.compute / per, base=p.base / per)
        # Weights stored split over data-parallel axes: gathered for forward and backward
        # (per microbatch); the embedding and head once when not inside the layer loop.
        if p.store_dp_axes:
            static = 2 if p.tensor.per_layer else 1
            add("all-gather", p.store_dp_axes, p.compute * wire, static, 2 * per * micro)
        # ZeRO 1-2: the updated master shards are gathered into the working parameters.
        if cand.zero_stage in (1, 2) and p.zero_axes:
            add("all-gather", p.zero_axes, p.base * per * wire, 1, 1)
        # Gradient reduction over every data-parallel axis.
        reduce_axes = tuple(a for a in lay.dp_axes if lay.sizes[a] > 1)
        if not reduce_axes:
            continue
        grad_split = p.store_dp_axes if cand.zero_stage < 2 else (p.base_dp_axes + p.zero_axes)
        grad_split = tuple(a for a in grad_split if a in reduce_axes)
        rest = tuple(a for a in reduce_axes if a not in grad_split)
        full = p.compute * wire
        if grad_split:
            n = math.prod(lay.sizes[a] for a in grad_split)
            if backend == "cpu":
                add("all-reduce", grad_split, full, 1, per)
            else:
                add("reduce-scatter", grad_split, full / n, 1, per)
            add("all-reduce", rest, full / n, 1, per)
        else:
            add("all-reduce", rest, full, 1, per)

    if lay.tp_axes and spec.is_transformer:
        loc = _local(spec, lay, cand, global_batch, seq)
        act_bytes = loc.tokens * spec.d_model * wire
        fwd, bwd = 2, 5 + (2 if remat else 0)
        n_pipe = _pipe_m(cand, stages) if stages > 1 else 1
        runs_layer = layers * micro * n_pipe
        add("all-reduce", lay.tp_axes, act_bytes, fwd + bwd, (fwd + bwd) * runs_layer)
        add("all-reduce", lay.tp_axes, act_bytes, 2, 2 * micro * n_pipe)
    if stages > 1 and spec.is_transformer:
        loc = _local(spec, lay, cand, global_batch, seq)
        m = _pipe_m(cand, stages)
        repeats = max(spec.n_layers // stages, 1)
        iters = repeats * m + stages - 1
        send = loc.tokens * spec.d_model * c
        add("collective-permute", ("stage",), send, 2, 2 * iters * micro)
    return sorted(rows.values(), key=lambda r: (r["kind"], r["axes"]))


# --- FLOPs and time -----------------------------------------------------------------------
def model_flops(spec: ModelSpec, global_batch: int, seq: int) -> float:
    """Training FLOPs of one step without recomputation: ``6 N`` per token for the matmul
    parameters plus ``12 L h_q s`` per token for attention scores and values (the
    PaLM/Megatron convention, full s x s attention)."""
    tokens = global_batch * seq
    attn = 12 * spec.n_layers * spec.n_heads * spec.head_dim * seq if spec.is_transformer else 0
    return tokens * (6 * spec.n_dense + attn)


def _layer_forward_flops(spec: ModelSpec, seq: int) -> dict[str, float]:
    """Forward FLOPs per token of one decoder layer, by part."""
    d, h, n, k, f = spec.d_model, spec.head_dim, spec.n_heads, spec.n_kv_heads, spec.d_ff
    return {"qkv": 2 * d * h * (n + 2 * k), "wo": 2 * n * h * d, "gate_up": 4 * d * f,
            "down": 2 * f * d, "attention": 4 * n * h * seq}


_RECOMPUTED = {"none": (), "dots_saveable": (), "offload_dots": (),
               "dots_with_no_batch_dims_saveable": ("attention",),
               "save_attention_and_mlp_outputs": ("qkv", "gate_up", "attention"),
               "full": ("qkv", "wo", "gate_up", "down", "attention")}


def hardware_flops(spec: ModelSpec, global_batch: int, seq: int, remat: str) -> float:
    """FLOPs actually executed: the model FLOPs plus the forward matmuls the remat policy
    recomputes (``full``: the whole layer; ``save_attention_and_mlp_outputs``: all but the
    attention-output and MLP-down projections; ``dots_with_no_batch_dims_saveable``: the
    attention score and value products)."""
    base = model_flops(spec, global_batch, seq)
    if not spec.is_transformer:
        return base * (4 / 3 if remat == "full" else 1)
    parts = _layer_forward_flops(spec, seq)
    extra = sum(parts[p] for p in _RECOMPUTED.get(remat, ()))
    return base + global_batch * seq * spec.n_layers * extra


def _collective_time(row: dict[str, Any], cand: Candidate, machine: Machine) -> float:
    """Ring-algorithm time of one row's executed bytes, hierarchical over ICI then DCN."""
    dcn = dict(cand.dcn)
    ici = dict(cand.ici)
    n_ici = math.prod(ici[a] for a in row["axes"])
    n_dcn = math.prod(dcn.get(a, 1) for a in row["axes"])
    nbytes = row["bytes_per_step"]
    kind = row["kind"]
    chip = machine.chip
    if kind == "collective-permute":
        bw = chip.dcn_bw if n_dcn > 1 else chip.ici_bw
        return nbytes / bw
    # Bytes each device sends, as a multiple of the payload (result bytes for all-gather,
    # input for reduce-scatter, the buffer for all-reduce).
    if kind == "all-reduce":
        payload = nbytes
        factor = lambda n: 2 * (n - 1) / n
    elif kind == "all-gather":
        payload = nbytes
        factor = lambda n: (n - 1) / n
    elif kind == "reduce-scatter":
        payload = nbytes * n_ici * n_dcn
        factor = lambda n: (n - 1) / n
    else:  # all-to-all
        payload = nbytes
        factor = lambda n: (n - 1) / n
    t = factor(n_ici) * payload / chip.ici_bw if n_ici > 1 else 0.0
    if n_dcn > 1:
        t += factor(n_dcn) * (payload / n_ici) / chip.dcn_bw
    return t


def estimate(spec: ModelSpec, machine: Machine, cand: Candidate, global_batch: int, seq: int,
             *, backend: str | None = None, hbm_headroom: float = 0.9) -> Estimate:
    """Memory, collectives and step time of ``cand`` on ``machine``.

    Step time = (compute + tensor-parallel all-reduces, which sit on the critical path) /
    (1 - pipeline bubble) + the part of the remaining communication (gradient reductions,
    weight gathers) that the compute cannot hide. MFU = model FLOPs / (step time x peak x
    chips).

    Raises:
      JaxparError: when a dimension does not divide over its mesh axes.
    """
    backend = backend or ("cpu" if machine.chip.name == "cpu" else "tpu")
    lay = layout(spec, cand.sizes, cand.rules, cand.zero_stage)
    mem = memory(spec, lay, cand, global_batch, seq, backend)
    rows = collectives(spec, lay, cand, global_batch, seq, backend)
    n = cand.n_devices
    mflops = model_flops(spec, global_batch, seq)
    hflops = hardware_flops(spec, global_batch, seq, cand.remat) / n
    chip = machine.chip
    compute = hflops / (chip.peak_flops * chip.efficiency)
    comm: dict[str, float] = {}
    for row in rows:
        t = _collective_time(row, cand, machine)
        row["time_s"] = t
        key = f"{row['kind']} {'x'.join(row['axes'])}"
        comm[key] = comm.get(key, 0.0) + t
    stages = cand.sizes.get("stage", 1)
    bubble = 0.0
    if stages > 1:
        repeats = max(spec.n_layers // stages, 1)
        m = _pipe_m(cand, stages)
        bubble = (stages - 1) / (repeats * m + stages - 1)
    critical = sum(t for k, t in comm.items() if k.startswith("all-reduce tensor")
                   or k.startswith("collective-permute"))
    hidden = sum(comm.values()) - critical
    step = (compute + critical) / (1 - bubble) + max(0.0, hidden - 0.8 * compute)
    mfu = mflops / (step * chip.peak_flops * n) if step > 0 else 0.0
    fits = mem["total_bytes"] <= hbm_headroom * chip.hbm_bytes
    return Estimate(cand, mem, rows, hflops, mflops / n, compute, comm, bubble, step, mfu,
                    fits, chip.hbm_bytes)


def check_divisible(spec: ModelSpec, cand: Candidate, global_batch: int) -> str | None:
    """Why ``cand`` cannot run ``spec`` (a short reason), or None when it can."""
    sizes = cand.sizes
    tp = sizes["tensor"]
    if tp > 1 and cand.rules in ("tp", "fsdp_tp") and spec.is_transformer:
        for name, value in (("n_heads", spec.n_heads), ("n_kv_heads", spec.n_kv_heads),
                            ("d_ff", spec.d_ff), ("vocab_size", spec.vocab_size)):
            if value % tp:
                return f"model.{name}={value} not divisible by tensor={tp}"
    stages = sizes["stage"]
    if stages > 1 and spec.n_layers % stages:
        return f"model.n_layers={spec.n_layers} not divisible by stage={stages}"
    try:
        lay = layout(spec, sizes, cand.rules, cand.zero_stage)
    except JaxparError as err:
        return str(err)
    micro = cand.microbatches * (_pipe_m(cand, stages) if stages > 1 else 1)
    if global_batch % (lay.dp * micro):
        return (f"global batch {global_batch} not divisible by data-parallel {lay.dp} x "
                f"microbatches {micro}")
    if cand.remat not in POLICIES:
        return f"unknown remat {cand.remat!r}"
    return None
