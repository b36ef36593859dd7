"""One candidate way to run a training step, and the per-device sizes it implies.

:class:`Candidate` is a mesh (ICI and DCN part of every axis) plus the knobs the planner
chooses; :func:`local_sizes` turns it into what one device computes on: sequences and
tokens per microbatch, attention heads, MLP widths and vocabulary after tensor
parallelism, the sequence after context parallelism, the expert slots of a
mixture-of-experts layer. The memory, communication and time models all start from these.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.planner.layout import Layout
from jaxpar.planner.model import ModelSpec
from jaxpar.sharding.mesh import MESH_AXES
from jaxpar.sharding.plan import stores_weight_copy

OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1, "adafactor": 0}
DTYPE_BYTES = {"float32": 4, "f32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "f16": 2}
CONTEXT_ATTENTION = ("allgather", "ring")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the step: mesh (ICI and DCN parts per axis) and knobs.

    ``precision`` is the compute dtype (``float32``: no mixed precision; ``bfloat16``:
    f32 master weights, bf16 working copy and compute). ``pipeline_microbatches`` 0 means
    one per stage. ``sequence_parallel`` splits the residual stream's sequence over the
    tensor axis (Megatron sequence parallelism); ``context_attention`` is how attention
    spans a sequence split over the ``context`` axis (``allgather`` or ``ring``, see
    :mod:`jaxpar.parallel.context`; it matters only when that axis is larger than 1).
    ``pipeline_repeats`` is how many model chunks each stage holds in its schedule: 0
    (jaxpar's circular schedule) means one per layer of the stage; 1 is a plain GPipe or
    1F1B schedule; ``v`` Megatron's interleaved one with ``v`` virtual stages.
    ``pipeline_schedule`` is the kind (``circular``, ``gpipe``, ``1f1b``,
    ``interleaved_1f1b``, see :class:`jaxpar.parallel.pipeline.Schedule`): the first two
    keep every microbatch's activations, the 1F1B ones about ``stages`` microbatches'
    stage inputs and recompute each chunk's forward pass in its backward.

    ``quantize`` (``none``, ``int8``, ``fp8``): the decoder layers' projections run on
    8-bit operands (:mod:`jaxpar.sharding.quantization`), at the chip's 8-bit matmul rate
    plus the quantization passes; ``quantize_gather`` ``int8``: FSDP/ZeRO-3 weights are
    gathered in int8 once a step and held dequantized (ZeRO++ qwZ); ``quantize_reduce``
    ``int8``: their gradients reduced by int8 all-to-alls once a step (ZeRO++ qgZ);
    ``hpz``: weights stored split over ``data`` are gathered over it once a step into an
    in-slice copy (held for the step) and the layers gather that copy over the other
    axes (ZeRO++ hpZ). ``vocab_over_fsdp``: the embedding table, output head and logits
    split their vocabulary over ``fsdp`` too (:func:`jaxpar.sharding.rules.
    split_vocab_over_fsdp`): those weights stay where they lie, activations move.

    Host offload (the Plan knobs of the same names, see :mod:`jaxpar.parallel.offload`
    and :mod:`jaxpar.planner.offload`): ``offload_optimizer`` is the fraction (0 to 1)
    of the optimizer state's bytes (f32 master weights under mixed precision and the
    moments), largest tensors first, kept in host memory and streamed through the
    device for the update, or, with ``host_update`` (only at fraction 1), updated on the
    host (``update_chunk``: the layers a streamed update brings down at a time);
    ``offload_params`` keeps the decoder layers' weights in host memory and streams
    each layer's shard in as the layer runs. ``remat`` may be ``offload:<names>``: those
    activations are saved to host memory, the rest recomputed. ``weight_copy``:
    ``plan.weight_copy``.
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
    sequence_parallel: bool = False
    context_attention: str = "allgather"
    pipeline_repeats: int = 0
    pipeline_schedule: str = "circular"
    quantize: str = "none"
    quantize_gather: str = "none"
    quantize_reduce: str = "none"
    hpz: bool = False
    vocab_over_fsdp: bool = False
    offload_optimizer: float = 0.0
    host_update: bool = False
    update_chunk: int = 1
    offload_params: bool = False
    weight_copy: str = "auto"

    @property
    def stores_weight_copy(self) -> bool:
        """Whether a bf16 (compute-dtype) copy of the weights is kept between steps beside
        the f32 master weights (``plan.weight_copy``; see
        :func:`jaxpar.sharding.plan.stores_weight_copy`)."""
        return dtype_bytes(self.precision) != 4 and stores_weight_copy(
            self.weight_copy, self.zero_stage,
            offloaded=self.offloads_state or self.host_update)

    @staticmethod
    def make(ici: dict[str, int], dcn: dict[str, int] | None = None, **knobs: Any) -> Candidate:
        """Build from dicts (axes left out have size 1)."""
        i = tuple((a, int(ici.get(a, 1))) for a in MESH_AXES)
        d = tuple((a, int((dcn or {}).get(a, 1))) for a in MESH_AXES)
        return Candidate(i, d, **knobs)

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        """Total size of each mesh axis (ICI x DCN); computed once (do not modify it)."""
        dcn = dict(self.dcn)
        return {a: s * dcn.get(a, 1) for a, s in self.ici}

    @property
    def n_devices(self) -> int:
        """Devices the mesh spans."""
        return math.prod(self.sizes.values())

    @property
    def context(self) -> int:
        """Ways the sequence is split (the ``context`` axis)."""
        return self.sizes.get("context", 1)

    @property
    def expert(self) -> int:
        """Ways the experts are split (the ``expert`` axis)."""
        return self.sizes.get("expert", 1)

    def mesh_dict(self) -> dict[str, dict[str, int]]:
        """``{axis: {"size", "ici", "dcn"}}`` for every axis."""
        dcn = dict(self.dcn)
        return {a: {"size": s * dcn.get(a, 1), "ici": s, "dcn": dcn.get(a, 1)}
                for a, s in self.ici}

    @property
    def offloads_state(self) -> bool:
        """Whether optimizer state or weights live in host memory."""
        return bool(self.offload_optimizer) or self.offload_params

    @property
    def offloads(self) -> bool:
        """Whether anything lives in host memory: state, or activations the remat
        policy saves there (``offload_dots``, ``offload:<names>``)."""
        return self.offloads_state or self.remat == "offload_dots" or self.remat.startswith(
            "offload:")

    def offload_text(self) -> str:
        """What the candidate keeps in host memory, tersely: ``opt1@host+params``
        (all optimizer state, updated on the host, and streamed weights), ``opt0.5``,
        ``acts`` (activations saved to the host); ``-`` for nothing."""
        acts = ["acts"] if self.remat == "offload_dots" or self.remat.startswith(
            "offload:") else []
        return "+".join([*self._state_parts(), *acts]) or "-"

    def _state_parts(self) -> list[str]:
        parts = []
        if self.offload_optimizer:
            parts.append(f"opt{self.offload_optimizer:g}" + ("@host" if self.host_update else ""))
        if self.offload_params:
            parts.append("params")
        return parts

    def describe(self) -> str:
        """E.g. ``fsdp=16 x tensor=4 (dcn data=2)``, with ``+sp`` under sequence
        parallelism, the context attention kind when the sequence is split, and the state
        kept in host memory (``+offload opt1@host+params``)."""
        dcn = dict(self.dcn)
        parts = [f"{a}={s}" for a, s in self.ici if s > 1] or ["single"]
        slow = [f"{a}={s}" for a, s in dcn.items() if s > 1]
        extra = (" +sp" if self.sequence_parallel and self.sizes["tensor"] > 1 else "") + (
            " +vocab/fsdp" if self.vocab_over_fsdp and self.sizes["fsdp"] > 1 else "") + (
            f" ({self.context_attention})" if self.context > 1 else "")
        if self.offloads_state:
            extra += f" +offload {'+'.join(self._state_parts())}"
        return " x ".join(parts) + (f" (dcn {' x '.join(slow)})" if slow else "") + extra


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (a name in :data:`DTYPE_BYTES`)."""
    if dtype not in DTYPE_BYTES:
        raise JaxparError(f"unknown precision {dtype!r}; choose from {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def pipe_microbatches(cand: Candidate, stages: int) -> int:
    """Pipeline microbatches per step (``0`` in the candidate means one per stage)."""
    return cand.pipeline_microbatches or stages


def pipe_repeats(cand: Candidate, spec_layers: int, stages: int) -> int:
    """Chunks per stage of the candidate's schedule (``0`` means one per layer)."""
    if cand.pipeline_schedule in ("gpipe", "1f1b"):
        return 1
    return cand.pipeline_repeats or max(spec_layers // stages, 1)


def scheduled_backward(cand: Candidate) -> bool:
    """Whether the candidate's pipeline schedule runs the backward pass itself (1F1B)."""
    return cand.pipeline_schedule in ("1f1b", "interleaved_1f1b")


@dataclasses.dataclass(frozen=True)
class Local:
    """What one device works on per microbatch (see :func:`local_sizes`).

    ``tokens`` are the positions a device holds (``seqs x seq / context``); ``seq`` is
    the whole sequence (attention's key length), ``seq_local`` its share. For a mixture
    of experts, ``slots`` is expert slots per routed token (``experts_per_token x
    capacity factor``), ``expert_ff`` and ``shared_ff`` the per-device widths of one
    routed expert and of the shared experts' MLP, and ``dispatched`` the token slots one
    device's experts process (the dispatch buffer is not split over ``context``, so it
    counts the whole sequence: each context shard computes the same expert slots).
    ``context_attention``: the candidate's (how keys travel under context parallelism).
    """

    seqs: float  # sequences per device per microbatch
    tokens: float  # seqs x seq / context
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    seq: int = 0
    context: int = 1
    tp: int = 1
    seq_parallel: bool = False
    slots: float = 0.0
    expert_ff: int = 0
    shared_ff: int = 0
    dispatched: float = 0.0
    context_attention: str = "allgather"

    @property
    def seq_local(self) -> int:
        """Positions of one sequence a device holds."""
        return self.seq // self.context

    @property
    def residual_split(self) -> int:
        """Ways sequence parallelism splits the residual stream beyond ``tokens``."""
        return self.tp if self.seq_parallel else 1

    @property
    def ff_per_token(self) -> float:
        """MLP hidden elements per local token: ``d_ff`` for a dense MLP; for experts the
        routed slots (duplicated across context shards) plus the shared experts."""
        if not self.slots:
            return self.d_ff
        return self.dispatched / self.tokens * self.expert_ff + self.shared_ff


def local_sizes(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int
                ) -> Local:
    """Per-device sizes of one microbatch of ``cand`` (see :class:`Local`)."""
    # Asked for several times per candidate: remembered by the model's and layout's
    # identity and the candidate's fields it reads.
    key = (id(spec), id(lay), cand.microbatches, cand.pipeline_microbatches,
           cand.sequence_parallel, cand.context_attention, global_batch, seq)
    hit = _LOCAL.get(key)
    if hit is not None and hit[0] is spec and hit[1] is lay:
        return hit[2]
    loc = _local_sizes(spec, lay, cand, global_batch, seq)
    if len(_LOCAL) >= _LOCAL_MAX:
        _LOCAL.clear()
    _LOCAL[key] = (spec, lay, loc)  # holding both keeps their ids from being reused
    return loc


_LOCAL_MAX = 8192
_LOCAL: dict[tuple, tuple[ModelSpec, Layout, Local]] = {}


def _local_sizes(spec: ModelSpec, lay: Layout, cand: Candidate, global_batch: int, seq: int
                 ) -> Local:
    tp = math.prod(lay.sizes[a] for a in lay.tp_axes)
    split = lambda n: n // tp if tp > 1 and n % tp == 0 else n
    stages = lay.sizes.get("stage", 1)
    micro = cand.microbatches * (pipe_microbatches(cand, stages) if stages > 1 else 1)
    seqs = global_batch / lay.dp / micro
    context = math.prod(lay.sizes[a] for a in lay.cp_axes)
    sp = cand.sequence_parallel and tp > 1
    moe: dict[str, Any] = {}
    if spec.is_moe:
        cf = spec.capacity_factor or 1.0  # dropless: every routed choice, no padding
        slots = spec.experts_per_token * cf
        moe = {"slots": slots, "expert_ff": split(spec.expert_d_ff),
               "shared_ff": split(spec.n_shared_experts * spec.expert_d_ff),
               "dispatched": seqs * seq * slots}
    return Local(seqs, seqs * seq / context, split(spec.n_heads), split(spec.n_kv_heads),
                 split(spec.d_ff), split(spec.vocab_size), seq, context, tp, sp, **moe,
                 context_attention=cand.context_attention)
