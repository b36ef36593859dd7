"""Roofline time of a training step's computation, operation by operation.

Each operation one device runs is priced on its chip (:class:`~jaxpar.planner.catalog.Chip`):

* a matmul ``(m x k) @ (k x n)`` takes ``max(2 m' k' n' / (peak x matmul_efficiency),
  (m k + k n + m n) x bytes / (hbm_bw x memory_efficiency)) + op_overhead_s``, where
  ``k'`` and ``n'`` are ``k`` and ``n`` padded up to the chip's ``matmul_tile`` and ``m'``
  to 8 rows: a contraction or output narrower than the MXU/tensor-core tile wastes the
  rest of it, and a matmul too thin to reuse its operands (small per-device shapes under
  large tensor or expert splits, a batch of a few tokens) is bound by HBM instead. The
  backward pass of a matmul is two of the same size (``dX = dY W^T``, ``dW = X^T dY``).
  The peak is ``peak_flops`` for 16-bit compute and ``f32_flops`` for float32;
* attention by implementation: flash-style kernels (``splash``, ``cudnn``, ``chunked``,
  the context ring) run ``QK^T`` and ``PV`` per key block (2 matmuls forward, 5 backward,
  the scores recomputed), only the blocks a causal mask does not hide
  (:func:`~jaxpar.planner.cost.causal_fraction`), at :data:`FLASH_EFFICIENCY` of the
  matmul rate with ``head_dim`` padded to the tile; XLA's attention runs the full ``s x s``
  products (2 forward, 4 backward) and moves its f32 scores and probabilities through HBM
  (:data:`SCORE_PASSES` passes of ``heads x s x s`` elements);
* memory-bound work at ``hbm_bw x memory_efficiency``: per token and layer, the two norms
  with their residual adds (``8 d`` elements), RoPE on queries and keys (``2 (h_q + h_kv)
  head_dim``) and the gated activation (``3 f``), three times over for forward and
  backward; the loss's softmax over the (local) vocabulary (:data:`LOSS_PASSES` f32 passes);
  the embedding gather and the scatter of its gradient into the local table; the gradient
  accumulation buffer per microbatch; and the optimizer update over the local shard of
  the state (:func:`update_bytes`);
* what a remat policy recomputes is priced again as forward work (``full``: the whole
  layer; see :func:`recomputed_parts`), with the elementwise work around the rerun
  matmuls (the norm and RoPE of ``qkv``, the norm and activation of the MLP, the residual
  adds of ``wo`` and ``down``).

Everything is per device. :func:`compute_times` returns the forward and backward time of
one layer for one microbatch, the embedding, head and loss per microbatch, and the update
per step, which :func:`jaxpar.planner.cost.estimate` composes with the collectives.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from jaxpar.errors import JaxparError
from jaxpar.planner.candidate import OPTIMIZER_MOMENTS, Candidate, Local, dtype_bytes
from jaxpar.planner.catalog import Chip
from jaxpar.planner.model import ModelSpec
from jaxpar.sharding.remat import OFFLOAD, offloaded_names

FLASH_EFFICIENCY = 0.75
"""Flash-style attention kernels reach this fraction of a plain matmul's rate: each key
block's online-softmax rescaling runs on the vector units between the two matmuls
(FlashAttention-2/3 and splash sustain 50-75% of peak where large GEMMs reach 70-80%)."""

SCORE_PASSES = 6
"""HBM passes over the ``heads x s x s`` scores of XLA's (non-flash) attention, f32:
logits written and read by the softmax, probabilities written and read by ``PV`` forward;
backward reads them again and writes the score gradient."""

LOSS_PASSES = 4
"""f32 passes over the logits of the loss: log-sum-exp reads them, backward reads them
again and writes their gradient, which the head's backward matmuls read."""

MOE_IMBALANCE = 0.10
"""Extra time on the routed experts' matmuls under expert parallelism. With capacity
dispatch every expert computes a fixed number of slots (the capacity factor already pays
for uneven routing, in padding), but the step now meets at four all-to-alls per layer, so
any device that runs late (a fuller all-to-all, a slower chip, host jitter) holds all of
its expert group up. 10% is the low end of the 10-20% straggler margin commonly allowed
for expert-parallel steps; it is an assumption, not a measurement."""

_RECOMPUTED = {"none": (), "dots_saveable": (), "offload_dots": (),
               "dots_with_no_batch_dims_saveable": ("attention",),
               "save_attention_and_mlp_outputs": ("qkv", "gate_up", "attention"),
               "full": ("qkv", "wo", "gate_up", "down", "attention")}
"""The layer parts each remat policy of :mod:`jaxpar.sharding.remat` reruns in the backward pass."""

_SPARED_BY = {"attention_out": "wo", "mlp_out": "down"}
"""The layer part whose rerun an activation saved by name (``offload:<names>``) spares:
the attention and MLP outputs are those projections' results. The other names spare no
matmul: the backward pass of attention and of the gated activation still needs the
queries, keys, values and the gate and up projections, which no name keeps."""


def recomputed_parts(remat: str) -> tuple[str, ...]:
    """The layer parts (``qkv``, ``wo``, ``gate_up``, ``down``, ``attention``) a remat
    policy reruns in the backward pass: a policy of :mod:`jaxpar.sharding.remat`, or
    ``recompute=part+part`` for another framework's selective policy (the published
    runs' ``save_qkv_proj``, MaxText's per-tensor lists, Megatron's selective
    recomputation of the attention core). ``offload:<names>`` recomputes everything but
    what its saved names spare (:data:`_SPARED_BY`)."""
    if remat.startswith("recompute="):
        parts = tuple(p for p in remat.split("=", 1)[1].split("+") if p)
        unknown = set(parts) - set(_RECOMPUTED["full"])
        if unknown:
            raise JaxparError(f"remat {remat!r}: unknown part {sorted(unknown)[0]!r}; parts "
                              f"are {', '.join(_RECOMPUTED['full'])}")
        return parts
    if remat.startswith(OFFLOAD):
        spared = {_SPARED_BY.get(n) for n in offloaded_names(remat)}
        return tuple(p for p in _RECOMPUTED["full"] if p not in spared)
    return _RECOMPUTED.get(remat, ())


ELEMENTWISE_PASSES = 3
"""Forward and backward HBM traffic of a layer's norms, RoPE and activation relative to
the forward alone (the backward reads inputs and output gradients, writes input
gradients)."""


def _pad(x: float, tile: int) -> float:
    return math.ceil(x / tile) * tile if x > 0 else 0.0


def matmul_time(chip: Chip, m: float, k: float, n: float, *, batch: float = 1.0,
                act_bytes: int = 2, efficiency: float = 1.0, quantize: str = "none") -> float:
    """Seconds for ``batch`` matmuls ``(m x k) @ (k x n)`` on ``chip`` (see the module
    docstring); ``efficiency`` scales the chip's matmul rate (flash kernels). With
    ``quantize`` (``int8``, ``fp8``) the product runs on 8-bit operands at the chip's
    8-bit rate (the quantization passes are :func:`_train`'s)."""
    if min(m, k, n, batch) <= 0:
        return 0.0
    if quantize != "none":
        return matmul_time(chip, m, k, n, batch=batch, act_bytes=1,
                           efficiency=efficiency * chip.quantized_flops(quantize)
                           / chip.peak_flops)
    tile = max(chip.matmul_tile, 1)
    peak = chip.matmul_flops_f32 if act_bytes >= 4 else chip.peak_flops
    padded = 2 * _pad(m, 8) * _pad(k, tile) * _pad(n, tile) * batch
    t_compute = padded / (peak * chip.matmul_efficiency * efficiency)
    t_memory = batch * (m * k + k * n + m * n) * act_bytes / (chip.hbm_bw
                                                               * chip.memory_efficiency)
    return max(t_compute, t_memory) + chip.op_overhead_s


def _train(chip: Chip, m: float, k: float, n: float, act: int, batch: float = 1.0,
           quantize: str = "none") -> tuple[float, float]:
    """(forward, backward) seconds of one matmul and its two gradient matmuls; quantized,
    each operand (input, weight, incoming gradient) is quantized once (read in ``act``
    bytes, an 8-bit copy written; the gradient products reuse the forward's copies)."""
    fwd = matmul_time(chip, m, k, n, batch=batch, act_bytes=act, quantize=quantize)
    if quantize != "none":
        fwd += memory_time(chip, batch * (m * k + k * n) * (act + 1))
        fwd_q = memory_time(chip, batch * m * n * (act + 1))
    else:
        fwd_q = 0.0
    bwd = (fwd_q + matmul_time(chip, m, n, k, batch=batch, act_bytes=act, quantize=quantize)
           + matmul_time(chip, k, m, n, batch=batch, act_bytes=act, quantize=quantize))
    return fwd, bwd


def memory_time(chip: Chip, nbytes: float) -> float:
    """Seconds to stream ``nbytes`` through HBM."""
    return nbytes / (chip.hbm_bw * chip.memory_efficiency) if nbytes > 0 else 0.0


@dataclasses.dataclass
class ComputeTimes:
    """Per-device compute seconds (see :func:`compute_times`).

    ``layer_fwd``/``layer_bwd``: one decoder layer, one microbatch (``layer_bwd``
    includes what remat recomputes); ``head``: embedding, output head and loss, forward
    and backward, one microbatch; ``update``: the optimizer step and the gradient
    accumulation buffer, once per step. ``parts`` splits one layer and microbatch by
    operation (forward + backward seconds); ``experts``: the routed experts' share of
    ``layer_fwd + layer_bwd``.
    """

    layer_fwd: float
    layer_bwd: float
    head: float
    update: float
    parts: dict[str, float]
    experts: float = 0.0


def _attention(chip: Chip, spec: ModelSpec, loc: Local, kind: str, act: int,
               causal: float) -> tuple[float, float, float]:
    """(forward, backward, recompute-forward) seconds of attention for one layer and
    microbatch. Queries are the device's local positions; keys the whole sequence, or
    under context parallelism the gathered (``allgather``) or circulated (``ring``)
    blocks."""
    h, heads = spec.head_dim, loc.heads
    q = loc.seq_local or loc.seq
    kv = loc.seq
    seqs = loc.seqs
    if kind in ("splash", "cudnn", "chunked", "ring"):
        # QK^T (q x h x kv) and PV (q x kv x h) per head and sequence, causal blocks only.
        one = matmul_time(chip, q, h, kv * causal, batch=seqs * heads, act_bytes=act,
                          efficiency=FLASH_EFFICIENCY)
        two = matmul_time(chip, q, kv * causal, h, batch=seqs * heads, act_bytes=act,
                          efficiency=FLASH_EFFICIENCY)
        fwd = one + two
        bwd = 2.5 * fwd  # recomputed scores, dP = dO V^T, dV, dQ, dK
        return fwd, bwd, fwd
    one = matmul_time(chip, q, h, kv, batch=seqs * heads, act_bytes=act)
    two = matmul_time(chip, q, kv, h, batch=seqs * heads, act_bytes=act)
    scores = memory_time(chip, SCORE_PASSES * seqs * heads * q * kv * 4)
    fwd = one + two + scores / 3
    bwd = 2 * (one + two) + 2 * scores / 3
    return fwd, bwd, fwd


def _elementwise_bytes(spec: ModelSpec, loc: Local, act: int,
                      parts: tuple[str, ...] = ("qkv", "wo", "gate_up", "down")) -> float:
    """HBM bytes of one layer's forward norms, residual adds, RoPE and gated activation,
    per microbatch (the residual stream split over ``tensor`` under sequence
    parallelism), or of those that rerun with the matmuls ``parts`` (a remat policy's
    :func:`recomputed_parts`): the norm before ``qkv`` and the RoPE on its output rerun
    with ``qkv``, the norm before ``gate_up`` with ``gate_up``, each residual add with
    the projection it adds (``wo``, ``down``), the gated activation between ``gate_up``
    and ``down`` with either."""
    d = spec.d_model / loc.residual_split
    per_token = (2 * d * (("qkv" in parts) + ("wo" in parts) + ("gate_up" in parts)
                          + ("down" in parts))
                 + 2 * (loc.heads + loc.kv_heads) * spec.head_dim * ("qkv" in parts)
                 + 3 * loc.ff_per_token * ("gate_up" in parts or "down" in parts))
    return per_token * loc.tokens * act


def compute_times(spec: ModelSpec, loc: Local, cand: Candidate, chip: Chip, *,
                  attention: str, causal: float, recomputed: tuple[str, ...],
                  local_state: float, local_grads: float) -> ComputeTimes:
    """Roofline seconds of the step's computation on one device.

    Args:
      spec: the model; ``loc``: what one device holds per microbatch.
      cand: the candidate (precision, optimizer, microbatches, expert split).
      chip: the device's figures.
      attention: the implementation (:func:`~jaxpar.planner.activations.attention_kind`).
      causal: the share of ``s x s`` attention the kernel executes.
      recomputed: the parts a remat policy reruns (``qkv``, ``wo``, ``gate_up``,
        ``down``, ``attention``).
      local_state: parameter elements whose optimizer state this device updates.
      local_grads: gradient elements this device holds in the compute layout.
    """
    act = dtype_bytes(cand.precision)
    layer = _layer_times(spec, loc, chip, act, cand.quantize, cand.expert, attention, causal)
    parts, experts, elem = layer.parts, layer.experts, layer.elem
    redo = sum(parts[p][0] for p in recomputed if p in parts and p != "attention")
    if "attention" in recomputed:
        redo += layer.attention_redo
    # The elementwise work feeding and following the rerun matmuls reruns with them.
    redo += memory_time(chip, _elementwise_bytes(spec, loc, act, recomputed))
    if "down" in recomputed:  # the MLP reruns: the routed experts too
        redo += experts[0]
    summary = {name: f + b for name, (f, b) in parts.items()}
    summary["experts"] = experts[0] + experts[1]
    summary["elementwise"] = ELEMENTWISE_PASSES * elem
    summary["recompute"] = redo
    return ComputeTimes(layer.fwd, layer.bwd + redo, layer.head,
                        update_time(chip, cand, local_state, local_grads), summary,
                        experts[0] + experts[1])


class _LayerTimes(NamedTuple):
    """What :func:`compute_times` prices before the remat policy and the update: each
    part's (forward, backward) seconds of one layer and microbatch, the routed experts',
    attention's recomputed forward, the elementwise forward, the layer's forward and
    backward (without recomputation), and the embedding, head and loss."""

    parts: dict[str, tuple[float, float]]
    experts: tuple[float, float]
    attention_redo: float
    elem: float
    fwd: float
    bwd: float
    head: float


def _layer_times(spec: ModelSpec, loc: Local, chip: Chip, act: int, q: str, expert: int,
                 attention: str, causal: float) -> _LayerTimes:
    """:class:`_LayerTimes`, once per model, chip and per-device shapes (the search
    prices each under every ZeRO stage and remat policy; the result must not be
    modified)."""
    key = (id(spec), id(chip), loc, act, q, expert, attention, causal)
    hit = _LAYER_TIMES.get(key)
    if hit is not None and hit[0] is spec and hit[1] is chip:
        return hit[2]
    t, d, h = loc.tokens, spec.d_model, spec.head_dim
    parts: dict[str, tuple[float, float]] = {
        "qkv": _train(chip, t, d, (loc.heads + 2 * loc.kv_heads) * h, act, quantize=q),
        "wo": _train(chip, t, loc.heads * h, d, act, quantize=q),
    }
    experts = (0.0, 0.0)
    if spec.is_moe:
        e_local = max(spec.n_experts // expert, 1)
        per_expert = loc.dispatched / e_local  # token slots each local expert computes
        router = _train(chip, t, d, spec.n_experts, act)
        gate_up = _train(chip, per_expert, d, 2 * loc.expert_ff, act, batch=e_local,
                         quantize=q)
        down = _train(chip, per_expert, loc.expert_ff, d, act, batch=e_local, quantize=q)
        # GShard's one-hot dispatch and combine einsums: (tokens x slots) x (tokens x d)
        # per sequence, forward and backward.
        cap = loc.dispatched / max(loc.seqs, 1e-9)
        dispatch = _train(chip, cap, loc.seq, d, act, batch=loc.seqs)
        experts = tuple(2 * dispatch[i] + gate_up[i] + down[i] for i in (0, 1))
        if expert > 1:
            experts = tuple(x * (1 + MOE_IMBALANCE) for x in experts)
        parts["router"] = router
        if loc.shared_ff:
            parts["gate_up"] = _train(chip, t, d, 2 * loc.shared_ff, act, quantize=q)
            parts["down"] = _train(chip, t, loc.shared_ff, d, act, quantize=q)
    else:
        parts["gate_up"] = _train(chip, t, d, 2 * loc.d_ff, act, quantize=q)
        parts["down"] = _train(chip, t, loc.d_ff, d, act, quantize=q)
    a_fwd, a_bwd, a_redo = _attention(chip, spec, loc, attention, act, causal)
    parts["attention"] = (a_fwd, a_bwd)
    elem = memory_time(chip, _elementwise_bytes(spec, loc, act))
    fwd = sum(f for f, _ in parts.values()) + experts[0] + elem
    bwd = sum(b for _, b in parts.values()) + experts[1] + (ELEMENTWISE_PASSES - 1) * elem
    # Embedding gather and gradient scatter, output head, loss softmax.
    v = loc.vocab
    head_f, head_b = _train(chip, t, d, v, act)
    loss = memory_time(chip, LOSS_PASSES * t * v * 4)
    embed = memory_time(chip, 3 * t * d * act + v * d / max(loc.tp, 1) * 4)
    head = head_f + head_b + loss + embed
    out = _LayerTimes(parts, experts, a_redo, elem, fwd, bwd, head)
    if len(_LAYER_TIMES) >= _LAYER_TIMES_MAX:
        _LAYER_TIMES.clear()
    _LAYER_TIMES[key] = (spec, chip, out)  # holding both keeps their ids from reuse
    return out


_LAYER_TIMES_MAX = 8192
_LAYER_TIMES: dict[tuple, tuple[ModelSpec, Chip, _LayerTimes]] = {}


def update_bytes(cand: Candidate, local_state: float, local_grads: float) -> float:
    """HBM bytes of the optimizer step over one device's share of the state: read the
    gradient (and once more for the global norm), the f32 master weights and the moments,
    write master and moments back and, under mixed precision, the working copy; plus,
    with gradient accumulation, reading and writing the f32 running sum every
    microbatch."""
    moments = OPTIMIZER_MOMENTS.get(cand.optimizer, 2)
    mixed = dtype_bytes(cand.precision) != 4
    per = 4 + 4 + 4 * 2 + 4 * 2 * moments + (dtype_bytes(cand.precision) if mixed else 0)
    accumulate = 8 * local_grads * cand.microbatches if cand.microbatches > 1 else 0.0
    return local_state * per + accumulate


def update_time(chip: Chip, cand: Candidate, local_state: float, local_grads: float) -> float:
    """Seconds of :func:`update_bytes` at the chip's memory rate."""
    return memory_time(chip, update_bytes(cand, local_state, local_grads))
