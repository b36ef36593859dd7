"""The planner's Python API: :func:`plan` and :func:`estimate`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxpar.config.assembly import model_factory
from jaxpar.config.schema import Config, apply_overrides, from_dict, load_config
from jaxpar.errors import JaxparError
from jaxpar.models.config import TransformerConfig
from jaxpar.planner import offload as offload_lib
from jaxpar.planner.catalog import Chip, Machine, parse_chips
from jaxpar.planner.cost import Candidate, Estimate
from jaxpar.planner.cost import estimate as _estimate
from jaxpar.planner.explain import reason
from jaxpar.planner.model import ModelSpec, from_nnx, from_transformer
from jaxpar.planner.search import search
from jaxpar.planner.traced import StepTracer
from jaxpar.sharding.annotations import annotate
from jaxpar.sharding.mesh import MESH_AXES

ModelLike = TransformerConfig | Config | str | Path | Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A model argument made concrete: the spec per pipeline stage count, and the run
    config it came from (for ``--write``), if any."""

    spec_for: Callable[[int], ModelSpec]
    config: Config | None
    name: str
    pipeline: bool = True


def resolve_model(model: ModelLike, overrides: Iterable[str] = ()) -> Resolved:
    """Accept a TransformerConfig, a run Config, a YAML path, or an NNX model factory.

    ``overrides`` (``model.<field>=value``) apply to YAML paths and Configs.
    """
    overrides = list(overrides)
    if isinstance(model, (str, Path)):
        model = load_config(model, overrides)
        overrides = []
    if isinstance(model, Config):
        if overrides:
            model = from_dict(Config, apply_overrides(model.to_dict(), overrides))
        if model.model.factory:
            return _resolve_factory(model)
        cfg = model.model
        return Resolved(lambda s: from_transformer(cfg, stages=s), model,
                        f"d{cfg.d_model} L{cfg.n_layers}")
    if overrides:
        raise JaxparError("model overrides need a YAML path or a jaxpar.Config model")
    if isinstance(model, TransformerConfig):
        cfg = model
        return Resolved(lambda s: from_transformer(cfg, stages=s), None,
                        f"d{cfg.d_model} L{cfg.n_layers}")
    if callable(model):
        spec = from_nnx(model)
        return Resolved(_no_stages(spec), None, spec.name, pipeline=False)
    raise JaxparError(f"cannot plan for a {type(model).__name__}; pass a TransformerConfig, "
                      "a jaxpar.Config, a YAML path or an NNX model factory")


def _no_stages(spec: ModelSpec) -> Callable[[int], ModelSpec]:
    def spec_for(stages: int) -> ModelSpec:
        if stages > 1:
            raise JaxparError("pipeline stages need the reference transformer")
        return spec

    return spec_for


def _resolve_factory(config: Config) -> Resolved:
    """A run config whose ``model.factory`` names a user's model: read its parameter shapes
    abstractly, with the config's ``plan.annotations`` applied, and its activation memory
    and FLOPs from its traced step (:class:`jaxpar.planner.traced.StepTracer`)."""
    build = model_factory(config)
    spec = from_nnx(lambda: annotate(build(), config.plan.annotations, warn=False),
                    name=config.model.factory)
    if not spec.is_transformer:  # its activations and FLOPs come from its traced step
        spec = dataclasses.replace(spec, tracer=StepTracer(config))
    return Resolved(_no_stages(spec), config, spec.name, pipeline=False)


def _machine(chips: str | Machine, slices: int,
             catalog: str | Path | Mapping[str, Chip] | None) -> Machine:
    return chips if isinstance(chips, Machine) else parse_chips(chips, slices=slices,
                                                                 catalog=catalog)


def plan(model: ModelLike, *, chips: str | Machine, global_batch: int, seq: int,
         slices: int = 1, catalog: str | Path | Mapping[str, Chip] | None = None,
         top: int = 5, precision: str = "bfloat16", overrides: Iterable[str] = (),
         context: int | Sequence[int] | None = None, expert: int | Sequence[int] | None = None,
         offload: str = "never", quantize: str = "none") -> list[Estimate]:
    """The best plans for training ``model`` on ``chips``, fastest first.

    Args:
      model: TransformerConfig, run Config, YAML path or NNX model factory.
      chips: ``"kind:count"`` (e.g. ``"tpu-v5p:256"``, ``"h100:64"``, ``"cpu:8"``).
      global_batch: sequences per optimizer step.
      seq: sequence length.
      slices: ICI domains joined by DCN (GPU nodes are inferred from the chip's domain).
      catalog: YAML file (or mapping) with extra chip kinds.
      top: how many plans to return (one more is computed: each reason compares a plan
        with the next).
      precision: compute dtype; ``bfloat16`` means f32 master weights, bf16 compute.
      overrides: ``model.<field>=value`` for a YAML path or Config.
      context: the ``context`` axis sizes allowed (one or several; default: 1, and for
        sequences of 16384 or more, powers of two down to 1024 positions per device).
      expert: the ``expert`` axis sizes allowed (default: the divisors of a mixture of
        experts' ``n_experts`` that divide a slice; 1 for a dense model).
      offload: when to try host offload (optimizer state, streamed layer weights,
        activations saved to the host): ``never`` (the default), ``auto`` (only when
        nothing fits without it; what ``jaxpar plan`` does) or ``always``. A plan that
        offloads says in its ``reason`` what moved and what it costs.
      quantize: ``none``, ``int8`` or ``fp8`` matmuls in the decoder layers
        (``plan.quantize``), priced at the chip's 8-bit rate.

    Returns:
      :class:`Estimate` s, best first. Each has ``candidate`` (mesh and knobs),
      ``memory``, ``step_time_s``, ``mfu``, ``fits`` and ``reason`` (why it beats the
      next one; for the winner, why it beats the runner-up). When nothing fits, the plans
      needing the least memory, with ``fits=False``.

    Raises:
      JaxparError: for an unknown chip kind, a malformed ``chips``, or a bad model.
    """
    if global_batch < 1 or seq < 1:
        raise JaxparError(f"global batch and seq must be positive, got {global_batch}, {seq}")
    resolved = resolve_model(model, overrides)
    experts = _sizes(expert, "expert")
    base = resolved.spec_for(1)
    if experts and max(experts) > 1 and not base.is_moe:
        raise JaxparError(f"expert axis {'/'.join(map(str, experts))}: the model is dense "
                          "(model.n_experts=0), it has no experts to spread; leave out "
                          "--expert")
    machine = _machine(chips, slices, catalog)
    optimizer = resolved.config.train.optimizer if resolved.config else "adamw"
    # One plan more than shown: the last one shown is compared with the next.
    result = search(resolved.spec_for, machine, global_batch, seq, precision=precision,
                    optimizer=optimizer, top=top + 1, pipeline=resolved.pipeline,
                    contexts=_sizes(context, "context"), experts=experts,
                    offload=offload, quantize=quantize)
    plans = result.plans[:top]
    for i, est in enumerate(plans):
        runner = result.plans[i + 1] if i + 1 < len(result.plans) else None
        est.reason = reason(est, runner, fitting=len(result.plans))
    return plans


def _sizes(value: int | Sequence[int] | None, axis: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    sizes = (value,) if isinstance(value, int) else tuple(value)
    if not sizes or any(not isinstance(v, int) or v < 1 for v in sizes):
        raise JaxparError(f"{axis} sizes must be positive integers, got {value!r}")
    return sizes


def estimate(model: ModelLike, candidate: Candidate, *, chips: str | Machine,
             global_batch: int, seq: int, slices: int = 1,
             catalog: str | Path | Mapping[str, Chip] | None = None,
             backend: str | None = None) -> Estimate:
    """The cost model's figures for one candidate (see :class:`Candidate`)."""
    resolved = resolve_model(model)
    machine = _machine(chips, slices, catalog)
    if candidate.n_devices != machine.count:
        raise JaxparError(f"candidate mesh spans {candidate.n_devices} devices, machine has "
                          f"{machine.count}")
    spec = resolved.spec_for(candidate.sizes["stage"])
    return _estimate(spec, machine, candidate, global_batch, seq, backend=backend)


def to_dict(est: Estimate, global_batch: int, seq: int) -> dict[str, Any]:
    """JSON-ready summary of a plan (what ``jaxpar plan --json`` prints); a plan that
    offloads adds its offload knobs, ``offload`` (:meth:`Candidate.offload_text`),
    ``host_bytes`` (per device), ``host_capacity_bytes`` and ``offload_s`` (exposed
    seconds a step)."""
    c = est.candidate
    return {
        "mesh": c.mesh_dict(),
        "rules": c.rules,
        "zero_stage": c.zero_stage,
        "remat": c.remat,
        "microbatches": c.microbatches,
        "pipeline_microbatches": c.pipeline_microbatches,
        "pipeline_schedule": c.pipeline_schedule if c.sizes["stage"] > 1 else None,
        "pipeline_repeats": c.pipeline_repeats,
        "precision": c.precision,
        "quantize": c.quantize,
        "quantize_gather": c.quantize_gather,
        "quantize_reduce": c.quantize_reduce,
        "hpz": c.hpz,
        "sequence_parallel": c.sequence_parallel and c.sizes["tensor"] > 1,
        "vocab_over_fsdp": c.vocab_over_fsdp and c.sizes["fsdp"] > 1,
        "context_attention": c.context_attention if c.context > 1 else None,
        "memory_per_device_bytes": int(est.memory_per_device_bytes),
        "memory": {k: int(v) for k, v in est.memory.items()},
        "hbm_bytes": int(est.hbm_bytes),
        "fits": est.fits,
        "step_time_s": est.step_time_s,
        "compute_s": est.compute_s,
        "comm_s": est.comm_s,
        "breakdown": est.breakdown,
        "bubble": est.bubble,
        "tokens_per_s": global_batch * seq / est.step_time_s,
        "tflops_per_device": est.model_flops / est.step_time_s / 1e12,
        "mfu": est.mfu,
        "reason": est.reason,
        **(offload_lib.summary(est) if c.offloads else {}),
    }


def run_config(est: Estimate, base: Config | None, model_cfg: TransformerConfig | None,
               global_batch: int, seq: int) -> Config:
    """The run config that trains with this plan (``jaxpar train --config`` accepts it):
    every mesh axis (``expert`` and ``context`` included), and the plan's ZeRO stage,
    remat, microbatches, sequence parallelism, vocabulary split and context attention
    kind, and its host
    offload knobs when it offloads."""
    c = est.candidate
    ici, dcn = dict(c.ici), dict(c.dcn)
    data: dict[str, Any] = base.to_dict() if base is not None else Config().to_dict()
    if model_cfg is not None:
        data["model"] = dataclasses.asdict(model_cfg)
    data["model"]["max_seq_len"] = max(int(data["model"]["max_seq_len"]), seq)
    data["mesh"] = {"explicit": bool(data["mesh"].get("explicit", False)),
                    **{a: ici[a] for a in MESH_AXES},
                    **{f"dcn_{a}": dcn[a] for a in MESH_AXES}}
    compute = "bfloat16" if c.precision in ("bfloat16", "bf16") else c.precision
    data["plan"] = {**data["plan"], "rules": c.rules, "zero_stage": c.zero_stage,
                    "precision": f"params=float32,compute={compute},output=float32",
                    "remat": c.remat, "microbatches": c.microbatches,
                    "sequence_parallel": c.sequence_parallel and ici["tensor"] > 1,
                    "context_attention": c.context_attention, "quantize": c.quantize,
                    "quantize_gather": c.quantize_gather,
                    "quantize_reduce": c.quantize_reduce, "hpz": c.hpz,
                    "vocab_over_fsdp": c.vocab_over_fsdp and c.sizes["fsdp"] > 1}
    if c.offloads_state:
        data["plan"].update(offload_optimizer=c.offload_optimizer, host_update=c.host_update,
                            offload_params=c.offload_params)
    data["pipeline"] = {**data.get("pipeline", {}), "microbatches": c.pipeline_microbatches,
                        "schedule": c.pipeline_schedule, "repeats": c.pipeline_repeats,
                        "layers_per_stage": 0}
    data["train"] = {**data["train"], "global_batch": global_batch, "seq_len": seq}
    return from_dict(Config, data)
