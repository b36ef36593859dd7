"""The Trainer: a functional, jitted, sharded training step over any Flax NNX model.

State is a plain pytree of ``jax.Array``s (trainable parameters, the rest of the model's
state, optimizer state, step counter). The step takes state and batch in and returns the
new state, with the old state's buffers donated; nothing is updated in place, so nothing is
lost under ``jax.jit``. Optimizer state is sharded like the parameters it belongs to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar.config import Config, TrainConfig
from jaxpar.errors import JaxparError
from jaxpar.mesh import make_mesh
from jaxpar.models.transformer import Transformer
from jaxpar.partitioning import init_sharded, state_shardings
from jaxpar.plan import Plan

LossFn = Callable[[nnx.Module, jax.Array], jax.Array]


def lm_loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``model`` on ``tokens`` ``(batch, seq + 1)``."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Optimizer from the config: warmup + cosine schedule, global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=max(cfg.warmup_steps, 1),
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * 0.1,
    )
    # Weight decay on matrices only, not on norm scales.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    makers: dict[str, Callable[[], optax.GradientTransformation]] = {
        "adamw": lambda: optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask),
        "adam": lambda: optax.adam(schedule),
        "sgd": lambda: optax.sgd(schedule, momentum=0.9),
        "lion": lambda: optax.lion(schedule, weight_decay=cfg.weight_decay, mask=decay_mask),
        "adafactor": lambda: optax.adafactor(schedule),
    }
    if cfg.optimizer not in makers:
        raise JaxparError(
            f"unknown train.optimizer {cfg.optimizer!r}; choose from {sorted(makers)}"
        )
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*parts, makers[cfg.optimizer]())


class Trainer:
    """Trains a sharded Flax NNX model with an optax optimizer under a :class:`Plan`.

    Args:
      model: the model; typically built with :func:`jaxpar.init_sharded`. Its weights are
        moved to the plan's shardings if they are not there already.
      optimizer: any optax ``GradientTransformation``.
      plan: mesh and rules.
      loss_fn: ``loss_fn(model, batch) -> scalar``; defaults to next-token cross-entropy.
      trainable: an ``nnx`` filter selecting the variables to train (default ``nnx.Param``);
        everything else is carried along unchanged and receives no gradient.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        plan: Plan,
        *,
        loss_fn: LossFn = lm_loss,
        trainable: Any = nnx.Param,
    ):
        self.plan = plan
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self._graphdef, params, frozen = nnx.split(model, trainable, ...)
        with plan.activate():
            param_sh = state_shardings(plan, params)
            frozen_sh = state_shardings(plan, frozen)
            params = jax.device_put(params, param_sh)
            frozen = jax.device_put(frozen, frozen_sh)
            opt_sh = self._opt_shardings(params, param_sh)
            opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
        self.state: dict[str, Any] = {
            "params": params,
            "frozen": frozen,
            "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), plan.replicated),
        }
        self.state_shardings = {"params": param_sh, "frozen": frozen_sh,
                                "opt_state": opt_sh, "step": plan.replicated}
        self._batch_sharding = plan.batch_sharding()
        self._train_step = jax.jit(
            self._step_impl,
            in_shardings=(self.state_shardings, self._batch_sharding),
            out_shardings=(self.state_shardings, plan.replicated),
            donate_argnums=0,
        )
        self._eval_step = jax.jit(
            self._eval_impl, in_shardings=(self.state_shardings, self._batch_sharding),
            out_shardings=plan.replicated,
        )

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Config) -> Trainer:
        """Mesh, plan, sharded model and optimizer from a loaded config, as the CLI builds them."""
        mesh = make_mesh(config.mesh.ici(), dcn=config.mesh.dcn())
        plan = Plan.from_preset(mesh, config.plan.rules)
        seed = config.train.seed
        model = init_sharded(lambda: Transformer(config.model, rngs=nnx.Rngs(seed)), plan)
        trainer = cls(model, make_optimizer(config.train), plan)
        trainer.config = config
        return trainer

    def _opt_shardings(self, params: nnx.State, param_sh: nnx.State) -> Any:
        shapes = jax.eval_shape(self.optimizer.init, params)
        return optax.tree_map_params(
            self.optimizer, lambda _, sharding: sharding, shapes, param_sh,
            transform_non_params=lambda _: self.plan.replicated,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )

    # --- the step -------------------------------------------------------------------------
    def _loss(self, params: nnx.State, frozen: nnx.State, batch: jax.Array) -> jax.Array:
        model = nnx.merge(self._graphdef, params, frozen)
        return self.loss_fn(model, batch)

    def _step_impl(self, state: dict[str, Any], batch: jax.Array):
        loss, grads = jax.value_and_grad(self._loss)(state["params"], state["frozen"], batch)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = {"params": params, "frozen": state["frozen"], "opt_state": opt_state,
                     "step": state["step"] + 1}
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    def _eval_impl(self, state: dict[str, Any], batch: jax.Array) -> jax.Array:
        return self._loss(state["params"], state["frozen"], batch)

    def global_batch(self, local_rows: np.ndarray) -> jax.Array:
        """Assemble the global batch from this process's rows (multi-host ready)."""
        rows = np.asarray(local_rows)
        global_shape = (rows.shape[0] * jax.process_count(),) + rows.shape[1:]
        return jax.make_array_from_process_local_data(self._batch_sharding, rows, global_shape)

    def lower(self, batch: np.ndarray):
        """``jax.stages.Lowered`` of one train step on a batch like ``batch`` (for inspection)."""
        with self.plan.activate():
            return self._train_step.lower(self.state, self.global_batch(batch))

    def step(self, batch: np.ndarray | jax.Array) -> dict[str, float]:
        """One optimisation step on this process's rows of the batch; returns its metrics."""
        if not isinstance(batch, jax.Array):
            batch = self.global_batch(batch)
        with self.plan.activate():
            self.state, metrics = self._train_step(self.state, batch)
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out["step"] = int(self.state["step"])
        return out

    def eval_loss(self, batch: np.ndarray | jax.Array) -> float:
        """Loss on a batch without updating anything."""
        if not isinstance(batch, jax.Array):
            batch = self.global_batch(batch)
        with self.plan.activate():
            return float(self._eval_step(self.state, batch))

    @property
    def model(self) -> nnx.Module:
        """The model with the current weights."""
        return nnx.merge(self._graphdef, self.state["params"], self.state["frozen"])

    @property
    def step_count(self) -> int:
        """Optimisation steps taken so far."""
        return int(self.state["step"])
