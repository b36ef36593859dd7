"""Assembling a run from a config: mesh, plan, model, initial weights, LoRA, optimizer, loss.

This is the one place that turns a :class:`~jaxpar.config.schema.Config` into the objects the
lower layers take, so that the :class:`~jaxpar.Trainer` needs nothing but a model, an
optimizer and a plan. The model is jaxpar's built-in decoder, or the user's own through
``model.factory: package.module:function`` (and ``train.loss`` for its loss); either is
created straight into its shardings, after the plan's annotations and layouts.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxpar.adapters import lora as lora_lib
from jaxpar.checkpoint.checkpointer import load_weights
from jaxpar.config.schema import Config, hf_folder, with_hf_model
from jaxpar.config.validate import check_config, pipeline_for
from jaxpar.errors import JaxparError
from jaxpar.hf import load
from jaxpar.models.transformer import Transformer
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.parallel import staged as staged_lib
from jaxpar.sharding.mesh import make_mesh
from jaxpar.sharding.partitioning import abstract_sharded, init_sharded
from jaxpar.sharding.plan import AUTO_KNOBS, Plan, knobs
from jaxpar.sharding.rules import preset
from jaxpar.training.diloco import DiLoCo
from jaxpar.training.optimizer import make_optimizer
from jaxpar.training.trainer import LossFn, Trainer, lm_loss


def import_object(spec: str, what: str, *, callable_only: bool = True) -> Any:
    """``"package.module:name"`` (or ``package.module.name``) -> the object it names
    (which must be callable unless ``callable_only`` is False).

    Raises:
      JaxparError: naming ``what`` (the config key) when the module or name is missing.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise JaxparError(f"{what}={spec!r} must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise JaxparError(f"{what}={spec!r}: cannot import {module_name!r} ({err})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise JaxparError(f"{what}={spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if callable_only and not callable(obj):
        raise JaxparError(f"{what}={spec!r} is not callable")
    return obj


def build_mesh(config: Config, devices: Any = None) -> jax.sharding.Mesh:
    """The mesh of ``config.mesh`` over ``devices`` (default: all)."""
    m = config.mesh
    return make_mesh(m.ici(), dcn=m.dcn(), devices=devices, explicit=m.explicit)


def build_plan(config: Config, mesh: jax.sharding.Mesh) -> Plan:
    """The :class:`Plan` of ``config.plan`` on ``mesh``. An ``auto`` knob still unresolved
    (``jaxpar train`` resolves them first: :func:`jaxpar.planner.auto.resolve_auto`) takes
    the Plan's own default."""
    p = config.plan
    params, acts = preset(p.rules, strict=p.strict)
    values = {knob.name: getattr(p, knob.name) for knob in knobs()}
    values.update({k: getattr(Plan, k) for k in AUTO_KNOBS if values[k] == "auto"})
    return Plan(mesh=mesh, param_rules=params, act_rules=acts, **values)


def pipeline_schedule(config: Config, mesh: jax.sharding.Mesh) -> pipeline_lib.Schedule | None:
    """The pipeline schedule when the mesh has more than one stage, else None."""
    stages = mesh.shape["stage"]
    if stages <= 1:
        return None
    if config.model.factory:  # its schedule depends on its blocks: see stage_split
        return None
    return pipeline_for(config, stages)


def stage_split(config: Config) -> staged_lib.StageSplit:
    """``pipeline.split`` imported: a :class:`~jaxpar.parallel.staged.StageSplit`, or a
    function returning one."""
    split = import_object(config.pipeline.split, "pipeline.split", callable_only=False)
    if not isinstance(split, staged_lib.StageSplit) and callable(split):
        split = split()
    if not isinstance(split, staged_lib.StageSplit):
        raise JaxparError(f"pipeline.split={config.pipeline.split!r} is a "
                          f"{type(split).__name__}, not a jaxpar.StageSplit")
    return split


def model_factory(config: Config, schedule: pipeline_lib.Schedule | None = None,
                  stages: int = 1) -> Callable[[], nnx.Module]:
    """A function that builds the config's model: the user's ``model.factory`` (called with
    ``model.kwargs`` and, if it takes them, ``rngs``; with ``stages > 1`` divided into
    pipeline stages by ``pipeline.split``) or the built-in decoder."""
    seed = config.train.seed
    if not config.model.factory:
        cfg = config.model.transformer()
        return lambda: Transformer(cfg, rngs=nnx.Rngs(seed), pipeline=schedule)
    fn = import_object(config.model.factory, "model.factory")
    split = stage_split(config) if stages > 1 else None
    kwargs = dict(config.model.kwargs)
    try:
        takes_rngs = "rngs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_rngs = False

    def build() -> nnx.Module:
        extra = {"rngs": nnx.Rngs(seed)} if takes_rngs and "rngs" not in kwargs else {}
        try:
            model = fn(**kwargs, **extra)
        except TypeError as err:
            if "argument" not in str(err):
                raise
            raise JaxparError(f"model.factory={config.model.factory!r} rejected model.kwargs "
                              f"{sorted(kwargs)}: {err}") from None
        if not isinstance(model, nnx.Module):
            raise JaxparError(f"model.factory={config.model.factory!r} returned a "
                              f"{type(model).__name__}, not a Flax NNX module")
        if split is not None:
            pipe = config.pipeline
            model = staged_lib.stage_model(
                model, split, stages=stages, microbatches=pipe.microbatches,
                repeats=pipe.repeats, layers_per_stage=pipe.layers_per_stage,
                schedule=pipe.schedule)
        return model

    return build


def loss_function(config: Config) -> LossFn:
    """``train.loss`` imported, or the default next-token loss."""
    return import_object(config.train.loss, "train.loss") if config.train.loss else lm_loss


@dataclasses.dataclass
class Assembly:
    """Everything a config assembles to: the trainer and the pieces it was built from."""

    trainer: Trainer | DiLoCo
    plan: Plan
    schedule: pipeline_lib.Schedule | None
    config: Config
    auto: list[str] = dataclasses.field(default_factory=list)
    """What each ``auto`` plan knob became, one line each (see :mod:`jaxpar.planner.auto`;
    empty when nothing was resolved)."""


def assemble(config: Config, devices: Any = None, *, abstract: bool = False) -> Assembly:
    """Mesh, plan, sharded model (built-in or ``model.factory``), initial weights
    (``init_from``), LoRA, trainable filter, optimizer and loss from a config, after
    :func:`jaxpar.config.validate.check_config` has checked it for the devices given.

    With ``config.init_from``, the model's weights come from that run's newest checkpoint
    (see :func:`jaxpar.checkpoint.checkpointer.load_weights`), or with ``hf:PATH`` from a
    Hugging Face folder (see :func:`jaxpar.hf.load`); the optimizer starts fresh.

    With ``abstract``, the model (LoRA included) and the trainer's state are shapes with
    their shardings only (:func:`jaxpar.sharding.partitioning.abstract_sharded`): nothing
    is allocated or read, and ``devices`` may be devices this process cannot run on (a
    TPU topology's). The trainer's step can then be lowered and compiled, not run.
    """
    config = with_hf_model(config)
    n_devices = len(devices) if devices is not None else jax.device_count()
    check_config(config, devices=n_devices, processes=jax.process_count())
    mesh = build_mesh(config, devices)
    plan = build_plan(config, mesh)
    schedule, stages = pipeline_schedule(config, mesh), mesh.shape["stage"]
    loss_fn = loss_function(config)
    hf = hf_folder(config.init_from)
    if abstract:  # initial weights do not change the program: shapes come from the config
        def build() -> nnx.Module:
            model = model_factory(config, schedule, stages)()
            with plan.activate():
                return lora_lib.apply_config(model, config.lora, rngs=config.train.seed)

        model = abstract_sharded(build, plan)
    elif hf is not None:  # a Hugging Face model, read straight into the plan's shardings
        model = load(hf, plan=plan, pipeline=schedule, config=config.model.transformer())
    else:
        model = init_sharded(model_factory(config, schedule, stages), plan)
    if config.init_from and hf is None and not abstract:  # an earlier run's weights, then LoRA
        load_weights(model, config.init_from, stages=mesh.shape["stage"])
    if not abstract:
        with plan.activate():
            lora_lib.apply_config(model, config.lora, rngs=config.train.seed, plan=plan)
    trainable = lora_lib.select_trainable(model, config.train.trainable)
    trainer = Trainer(model, make_optimizer(config.train), plan, loss_fn=loss_fn,
                      trainable=trainable)
    dl = config.diloco
    if dl.sync_every:
        trainer = DiLoCo(trainer, sync_every=dl.sync_every, outer_lr=dl.outer_lr,
                         outer_momentum=dl.outer_momentum, nesterov=dl.nesterov,
                         fragments=dl.fragments, staleness=dl.staleness,
                         outer_bits=dl.outer_bits, overlap=dl.overlap)
    return Assembly(trainer, plan, schedule or getattr(model, "pipeline_schedule", None),
                    config)


def build_trainer(config: Config, devices: Any = None) -> Trainer | DiLoCo:
    """The :class:`Trainer` of :func:`assemble` (wrapped in :class:`DiLoCo` when
    ``diloco.sync_every`` is set). ``auto`` knobs take the Plan's defaults here:
    ``jaxpar.build_trainer`` (:func:`jaxpar.planner.auto.build_trainer`) resolves them."""
    return assemble(config, devices).trainer
