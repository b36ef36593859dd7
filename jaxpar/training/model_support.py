"""What a plan asks of a model, checked before anything is built: a plan knob the model
cannot honour is refused in one line saying what to do, never run as a silent no-op."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.sharding.mesh import is_explicit
from jaxpar.sharding.plan import Plan


def check_model_support(model: nnx.Module, plan: Plan, pipeline_schedule: Any) -> None:
    """Refuse the plan knobs ``model`` cannot take: ZeRO++'s quantized collectives on an
    explicit-sharding mesh, and pipeline stages on a model without a pipeline layout
    (``pipeline_schedule`` None), whose stages would repeat each other's work."""
    if is_explicit(plan.mesh):
        knobs = [k for k in ("quantize_gather", "quantize_reduce")
                 if getattr(plan, k) != "none"]
        if knobs:
            raise JaxparError(
                f"plan.{knobs[0]}={getattr(plan, knobs[0])!r} does not run on an "
                "explicit-sharding mesh yet (ZeRO++'s collectives cannot carry the "
                "shardings the model's types give): set it to none, or train the model "
                "on an Auto mesh")
    if plan.mesh.shape.get("stage", 1) > 1 and pipeline_schedule is None:
        raise JaxparError(
            f"the mesh has stage={plan.mesh.shape['stage']} but {type(model).__name__} has "
            "no pipeline layout, so the stages would repeat each other's work: divide it "
            "with jaxpar.stage_model(model, jaxpar.StageSplit(embed=..., blocks=..., "
            "head=...), stages=...), or set the stage axis to 1")
    if pipeline_schedule is not None and is_explicit(plan.mesh):
        raise JaxparError(
            "pipeline stages on an explicit-sharding mesh are not supported: the stage "
            "executors place activations by logical names; build the mesh with "
            "jaxpar.make_mesh(..., explicit=False)")
