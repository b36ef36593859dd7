"""Assembling a run from a config: mesh, plan, model, initial weights, LoRA, optimizer, loss.

This is the one place that turns a :class:`~jaxpar.config.Config` into the objects the
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
import optax
from flax import nnx

from jaxpar import lora as lora_lib
from jaxpar import pipeline as pipeline_lib
from jaxpar.config import OPTIMIZERS, Config, TrainConfig, hf_folder, with_hf_model
from jaxpar.errors import JaxparError
from jaxpar.mesh import make_mesh
from jaxpar.models.transformer import Transformer
from jaxpar.partitioning import init_sharded
from jaxpar.plan import Plan
from jaxpar.precision import Policy
from jaxpar.rules import preset
from jaxpar.train import LossFn, Trainer, lm_loss
from jaxpar.validate import check_config


def import_object(spec: str, what: str) -> Any:
    """``"package.module:name"`` (or ``package.module.name``) -> the object it names.

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
    if not callable(obj):
        raise JaxparError(f"{what}={spec!r} is not callable")
    return obj


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    """The learning-rate schedule: linear warmup to ``train.lr``, cosine decay to a tenth."""
    warmup = max(cfg.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr * 0.1,
    )


def _decays(path: tuple, param: Any) -> bool:
    """Weight decay applies to matrices, not to norm scales or biases, which stay vectors
    per layer even when the layers are stacked into one array (so ``ndim`` cannot tell)."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    while names and names[-1] == "value":  # an nnx.Variable's own leaf
        names.pop()
    return (param.ndim >= 2 and bool(names) and names[-1] not in ("scale", "bias")
            and not any("norm" in n for n in names))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Optimizer from the config: warmup + cosine schedule, global-norm clipping."""
    schedule = learning_rate(cfg)
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(_decays, params)
    makers: dict[str, Callable[[], optax.GradientTransformation]] = {
        "adamw": lambda: optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask),
        "adam": lambda: optax.adam(schedule),
        "sgd": lambda: optax.sgd(schedule, momentum=0.9),
        "lion": lambda: optax.lion(schedule, weight_decay=cfg.weight_decay, mask=decay_mask),
        "adafactor": lambda: optax.adafactor(schedule),
    }
    assert set(makers) == set(OPTIMIZERS)
    if cfg.optimizer not in makers:
        raise JaxparError(
            f"unknown train.optimizer {cfg.optimizer!r}; choose from {list(OPTIMIZERS)}"
        )
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*parts, makers[cfg.optimizer]())


def build_mesh(config: Config, devices: Any = None) -> jax.sharding.Mesh:
    """The mesh of ``config.mesh`` over ``devices`` (default: all)."""
    m = config.mesh
    return make_mesh(m.ici(), dcn=m.dcn(), devices=devices, explicit=m.explicit)


def build_plan(config: Config, mesh: jax.sharding.Mesh) -> Plan:
    """The :class:`Plan` of ``config.plan`` on ``mesh``."""
    p = config.plan
    params, acts = preset(p.rules, strict=p.strict)
    return Plan(mesh=mesh, param_rules=params, act_rules=acts,
                precision=Policy.parse(p.precision), zero_stage=p.zero_stage, remat=p.remat,
                microbatches=p.microbatches, annotations=p.annotations, layouts=p.layouts,
                sequence_parallel=p.sequence_parallel, context_attention=p.context_attention,
                context_balance=p.context_balance)


def pipeline_schedule(config: Config, mesh: jax.sharding.Mesh) -> pipeline_lib.Schedule | None:
    """The pipeline schedule when the mesh has more than one stage, else None."""
    stages = mesh.shape["stage"]
    if stages <= 1:
        return None
    if config.model.factory:
        raise JaxparError("mesh.stage > 1 needs the built-in model: a model.factory model "
                          "has no pipeline layout (set mesh.stage=1)")
    return pipeline_lib.Schedule.for_model(config.model.n_layers, stages,
                                           config.pipeline.microbatches,
                                           config.pipeline.repeats)


def model_factory(config: Config, schedule: pipeline_lib.Schedule | None = None
                  ) -> Callable[[], nnx.Module]:
    """A function that builds the config's model: the user's ``model.factory`` (called with
    ``model.kwargs`` and, if it takes them, ``rngs``) or the built-in decoder."""
    seed = config.train.seed
    if not config.model.factory:
        cfg = config.model.transformer()
        return lambda: Transformer(cfg, rngs=nnx.Rngs(seed), pipeline=schedule)
    fn = import_object(config.model.factory, "model.factory")
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
        return model

    return build


def loss_function(config: Config) -> LossFn:
    """``train.loss`` imported, or the default next-token loss."""
    return import_object(config.train.loss, "train.loss") if config.train.loss else lm_loss


@dataclasses.dataclass
class Assembly:
    """Everything a config assembles to: the trainer and the pieces it was built from."""

    trainer: Trainer
    plan: Plan
    schedule: pipeline_lib.Schedule | None
    config: Config


def assemble(config: Config, devices: Any = None) -> Assembly:
    """Mesh, plan, sharded model (built-in or ``model.factory``), initial weights
    (``init_from``), LoRA, trainable filter, optimizer and loss from a config, after
    :func:`jaxpar.validate.check_config` has checked it for the devices given.

    With ``config.init_from``, the model's weights come from that run's newest checkpoint
    (see :func:`jaxpar.checkpoint.load_weights`), or with ``hf:PATH`` from a Hugging Face
    folder (see :func:`jaxpar.hf.load`); the optimizer starts fresh.
    """
    config = with_hf_model(config)
    n_devices = len(devices) if devices is not None else jax.device_count()
    check_config(config, devices=n_devices, processes=jax.process_count())
    mesh = build_mesh(config, devices)
    plan = build_plan(config, mesh)
    schedule = pipeline_schedule(config, mesh)
    loss_fn = loss_function(config)
    hf = hf_folder(config.init_from)
    if hf is not None:  # a Hugging Face model, read straight into the plan's shardings
        from jaxpar.hf import load

        model = load(hf, plan=plan, pipeline=schedule, config=config.model.transformer())
    else:
        model = init_sharded(model_factory(config, schedule), plan)
    if config.init_from and hf is None:  # weights of an earlier run, before LoRA wraps them
        from jaxpar.checkpoint import load_weights

        load_weights(model, config.init_from, stages=mesh.shape["stage"])
    with plan.activate():
        lora_lib.apply_config(model, config.lora, rngs=config.train.seed, plan=plan)
    trainable = lora_lib.select_trainable(model, config.train.trainable)
    trainer = Trainer(model, make_optimizer(config.train), plan, loss_fn=loss_fn,
                      trainable=trainable)
    return Assembly(trainer, plan, schedule, config)


def build_trainer(config: Config, devices: Any = None) -> Trainer:
    """The :class:`Trainer` of :func:`assemble`."""
    return assemble(config, devices).trainer
