"""What a plan asks of a model, checked before anything is built: a plan knob the model
cannot honour is refused in one line saying what to do, never run as a silent no-op."""

from __future__ import annotations

import warnings
from typing import Any

from flax import nnx

from jaxpar.errors import JaxparError, JaxparWarning
from jaxpar.sharding import quantization
from jaxpar.sharding.mesh import is_explicit
from jaxpar.sharding.plan import Plan


def check_model_support(model: nnx.Module, plan: Plan, pipeline_schedule: Any) -> None:
    """Refuse the plan knobs ``model`` cannot take: ZeRO++'s quantized collectives on an
    explicit-sharding mesh, and pipeline stages on a model without a pipeline layout
    (``pipeline_schedule`` None), whose stages would repeat each other's work."""
    if is_explicit(plan.mesh) and hasattr(model, "linen_modules"):
        raise JaxparError(
            "a linen model (jaxpar.from_linen) does not run on an explicit-sharding mesh: "
            "its arrays carry no sharding types for the mesh to follow; build the mesh "
            "with jaxpar.make_mesh(..., explicit=False)")
    if is_explicit(plan.mesh):
        knobs = [k for k in ("quantize_gather", "quantize_reduce")
                 if getattr(plan, k) != "none"]
        if knobs:
            raise JaxparError(
                f"plan.{knobs[0]}={getattr(plan, knobs[0])!r} does not run on an "
                "explicit-sharding mesh yet (ZeRO++'s collectives cannot carry the "
                "shardings the model's types give): set it to none, or train the model "
                "on an Auto mesh")
    if plan.quantize != "none" and not quantization.quantized_paths(
            model, plan.quantize_target, plan.quantize_exclude):
        warnings.warn(f"plan.quantize={plan.quantize!r}: plan.quantize_target="
                      f"{plan.quantize_target!r} and plan.quantize_exclude match no weight "
                      f"matmul of {type(model).__name__}, so nothing is quantized",
                      JaxparWarning, stacklevel=3)
    if plan.mesh.shape.get("stage", 1) > 1 and pipeline_schedule is None:
        raise JaxparError(
            f"the mesh has stage={plan.mesh.shape['stage']} but {type(model).__name__} has "
            "no pipeline layout, so the stages would repeat each other's work: divide it "
            "with jaxpar.stage_model(model, jaxpar.StageSplit(embed=..., blocks=..., "
            "head=...), stages=...), or set the stage axis to 1")
    if (pipeline_schedule is not None and pipeline_schedule.backward_in_schedule
            and plan.compress_gradients != "none"):
        raise JaxparError(
            f"pipeline.schedule={pipeline_schedule.kind} runs the backward pass inside its "
            f"own shard_map, which plan.compress_gradients={plan.compress_gradients!r} "
            "cannot enter: use pipeline.schedule=circular or gpipe, or plan."
            "compress_gradients: none")
    if pipeline_schedule is not None and is_explicit(plan.mesh):
        raise JaxparError(
            "pipeline stages on an explicit-sharding mesh are not supported: the stage "
            "executors place activations by logical names; build the mesh with "
            "jaxpar.make_mesh(..., explicit=False)")
