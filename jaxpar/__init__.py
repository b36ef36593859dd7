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

from jaxpar import models, planner
from jaxpar.adapters import lora
from jaxpar.config.assembly import assemble, build_trainer
from jaxpar.config.schema import Config, load_config
from jaxpar.errors import JaxparError
from jaxpar.models.linen import from_linen
from jaxpar.parallel import pipeline
from jaxpar.parallel.staged import StagedModel, StageSplit, stage_model
from jaxpar.runs.host_memory import size_host_pool
from jaxpar.sharding.annotations import annotate, logical_names
from jaxpar.sharding.layouts import constrain_outputs
from jaxpar.sharding.mesh import MESH_AXES, make_mesh
from jaxpar.sharding.partitioning import init_sharded, replication_report, state_shardings
from jaxpar.sharding.plan import Plan, constrain, current_plan
from jaxpar.sharding.rules import Rules
from jaxpar.training.trainer import Trainer

# ``jaxpar.plan(...)`` is the planner's search; the Plan type lives in jaxpar.sharding.plan,
# so no module of this package is hidden behind the name.
plan = planner.plan

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
