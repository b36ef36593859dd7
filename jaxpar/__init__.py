"""jaxpar: SPMD sharding for JAX and Flax.

Annotate a model with logical axis names, pick a mesh, and train it sharded::

    import jaxpar
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2})
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    model = jaxpar.init_sharded(lambda: jaxpar.models.Transformer(cfg, rngs=nnx.Rngs(0)), plan)
    trainer = jaxpar.Trainer(model, optax.adamw(3e-3), plan)
    metrics = trainer.step(batch)

A model jaxpar did not write gets logical names by path, and its block outputs pinned::

    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", annotations=[(r"kernel$", ("embed", "mlp"))],
                                   layouts=[(MyDecoderLayer, ("batch", "seq", "embed"))])
    model = jaxpar.init_sharded(lambda: MyModel(rngs=nnx.Rngs(0)), plan)

Or let the planner choose the mesh for a machine you do not have::

    best = jaxpar.plan(cfg, chips="tpu-v5p:256", global_batch=512, seq=4096)[0]
"""

import importlib
from typing import Any

from jaxpar.sharding.backends import quiet_absent_gpu as _quiet_absent_gpu
from jaxpar.sharding.backends import skip_absent_tpu as _skip_absent_tpu

# Before JAX starts a backend: on a host without a TPU, JAX is kept from starting libtpu
# (installed for `jaxpar compile --target tpu-...`), whose failed start prints errors; on
# one without a GPU, jax's CUDA plugin (for `--target h100:8`) loads without its lines.
_skip_absent_tpu()
_quiet_absent_gpu()

_EXPORTS: dict[str, str] = {
    "models": "jaxpar.models", "planner": "jaxpar.planner",
    "lora": "jaxpar.adapters.lora", "pipeline": "jaxpar.parallel.pipeline",
    "assemble": "jaxpar.planner.auto", "build_trainer": "jaxpar.planner.auto",
    "Config": "jaxpar.config.schema", "load_config": "jaxpar.config.schema",
    "JaxparError": "jaxpar.errors", "from_linen": "jaxpar.models.linen",
    "StagedModel": "jaxpar.parallel.staged", "StageSplit": "jaxpar.parallel.staged",
    "stage_model": "jaxpar.parallel.staged", "size_host_pool": "jaxpar.runs.host_memory",
    "scanned_paths": "jaxpar.sharding.scanned", "unscan_blocks": "jaxpar.sharding.scanned",
    "annotate": "jaxpar.sharding.annotations", "logical_names": "jaxpar.sharding.annotations",
    "constrain_outputs": "jaxpar.sharding.layouts", "MESH_AXES": "jaxpar.sharding.mesh",
    "make_mesh": "jaxpar.sharding.mesh", "init_sharded": "jaxpar.sharding.partitioning",
    "replication_report": "jaxpar.sharding.partitioning",
    "state_shardings": "jaxpar.sharding.partitioning", "Plan": "jaxpar.sharding.plan",
    "constrain": "jaxpar.sharding.plan", "current_plan": "jaxpar.sharding.plan",
    "Rules": "jaxpar.sharding.rules", "Trainer": "jaxpar.training.trainer",
}
"""Where each public name lives. They are imported on first use, so ``import jaxpar``
(and the ``jaxpar`` command's ``--help`` and argument errors) do not start JAX."""


def __getattr__(name: str) -> Any:
    if name == "plan":  # the planner's search; the Plan type lives in jaxpar.sharding.plan
        value = importlib.import_module("jaxpar.planner").plan
    elif name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if module.__name__.endswith(f".{name}") and name in (
            "models", "planner", "lora", "pipeline") else getattr(module, name)
    else:
        raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, "plan"])


__all__ = [
    "MESH_AXES",
    "annotate",
    "assemble",
    "build_trainer",
    "constrain_outputs",
    "from_linen",
    "logical_names",
    "replication_report",
    "Config",
    "JaxparError",
    "Plan",
    "Rules",
    "Trainer",
    "constrain",
    "current_plan",
    "init_sharded",
    "load_config",
    "make_mesh",
    "lora",
    "models",
    "pipeline",
    "plan",
    "planner",
    "size_host_pool",
    "stage_model",
    "StagedModel",
    "StageSplit",
    "state_shardings",
]
__version__ = "0.1.0"
