"""Errors a model written for another setup raises while it is traced, turned into one line
saying what to change in jaxpar."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from jaxpar.errors import JaxparError
from jaxpar.sharding.mesh import canonical_axis
from jaxpar.sharding.plan import Plan


@contextlib.contextmanager
def explained_model_errors(plan: Plan) -> Iterator[None]:
    """Turn the errors a model written for another mesh raises while it is traced into
    one line saying what to change in jaxpar: a mesh-axis name of its own inside
    ``reshard``/``with_sharding_constraint`` (``'tp'``), explicit-sharding code on an
    ``Auto`` mesh, or weights kept in host memory used without being streamed in."""
    try:
        yield
    except ValueError as err:
        text = str(err)
        if "memory_space of all inputs" in text and plan.offload_params:
            raise JaxparError(
                "plan.offload_params keeps the stacked layers' weights in host memory, but "
                "the model computes with them without bringing them to the device: call "
                "jaxpar.parallel.offload.stream_layer on each layer's state inside its layer "
                "loop (jaxpar's Transformer does), or turn plan.offload_params off") from None
        manual = re.search(r"axis name: (\w+) of type: AxisType\.Manual", text)
        if "cannot contain axis names that are of type Auto" in text and manual:
            raise JaxparError(
                f"the model names mesh axis {manual.group(1)!r} in its own shardings, but "
                "jaxpar runs this step over that axis by hand (DiLoCo's replicas each hold "
                "their own slice of it): leave it out of the model's PartitionSpecs (the "
                "batch is split over it before the model runs)") from None
        if "cannot contain axis names that are of type Auto" in text:
            where = re.search(r"This error occurs at source:\s*(\S+)", text)
            raise JaxparError(
                "the model is written for explicit sharding (a PartitionSpec given as "
                f"out_sharding{' at ' + where.group(1) if where else ''}) but the mesh is "
                "Auto: build it with jaxpar.make_mesh(..., explicit=True), or set "
                "mesh.explicit: true in a run config") from None
        found = re.search(r"Resource axis: (\S+) of .* is not found in mesh", text, re.S)
        if not found:
            raise
        name = found.group(1)
        axes = ", ".join(plan.mesh.axis_names)
        alias = canonical_axis(name)
        fix = (f"write {alias!r} there (jaxpar accepts the alias {name!r} in annotations, "
               f"rules and make_mesh only, JAX does not know it)" if alias != name else
               "use these names in the model's own sharding calls, or give its weights "
               "logical names and let plan rules place them")
        raise JaxparError(f"the model shards over mesh axis {name!r} inside its own code "
                          f"(reshard, with_sharding_constraint or out_sharding), but jaxpar's "
                          f"mesh axes are {axes}: {fix}") from None
