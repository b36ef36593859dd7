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

from jaxpar import lora as lora_lib
from jaxpar import pipeline as pipeline_lib
from jaxpar.config import Config, TrainConfig
from jaxpar.errors import JaxparError
from jaxpar.mesh import make_mesh
from jaxpar.models.transformer import Transformer
from jaxpar.partitioning import init_sharded, state_shardings
from jaxpar.plan import Plan, current_plan
from jaxpar.precision import DynamicLossScale, Policy
from jaxpar.zero import formula_bytes, per_device_bytes, zero_shardings

LossFn = Callable[[nnx.Module, jax.Array], jax.Array]


def lm_loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``model`` on ``tokens`` ``(batch, seq + 1)``."""
    plan = current_plan()
    out_dtype = plan.precision.output if plan is not None else jnp.float32
    logits = model(tokens[:, :-1]).astype(out_dtype)
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

    The plan's knobs shape the step: ``precision`` (with a half-precision compute dtype and
    f32 master weights, ``state["params"]`` is the compute-dtype working copy and
    ``state["master"]`` the f32 weights the optimizer updates; float16 adds dynamic loss
    scaling in ``state["loss_scale"]``), ``zero_stage`` (which state is split over the
    data-parallel axes), ``remat`` and ``microbatches`` (gradient accumulation).

    Args:
      model: the model; typically built with :func:`jaxpar.init_sharded`. Its weights are
        moved to the plan's shardings if they are not there already.
      optimizer: any optax ``GradientTransformation``.
      plan: mesh, rules and knobs.
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
        self.policy = plan.precision
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.loss_scale = DynamicLossScale() if self.policy.needs_loss_scaling else None
        self._graphdef, params, frozen = nnx.split(model, trainable, ...)
        dp_axes = plan.data_parallel_axes
        with plan.activate():
            base_sh = state_shardings(plan, params)
            zero_sh, self.zero_left_whole = zero_shardings(base_sh, params, plan.mesh, dp_axes)
            stage = plan.zero_stage
            param_sh = zero_sh if stage >= 3 else base_sh
            master_sh = zero_sh if stage >= 1 else base_sh
            self.grad_shardings = zero_sh if stage >= 2 else base_sh
            frozen_sh = state_shardings(plan, frozen)
            master = jax.device_put(self.policy.cast_to_params(params), master_sh)
            frozen = jax.device_put(frozen, frozen_sh)
            opt_sh = self._opt_shardings(master, master_sh)
            opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(master)
        self.state: dict[str, Any] = {"frozen": frozen, "opt_state": opt_state,
                                      "step": jax.device_put(jnp.zeros((), jnp.int32),
                                                             plan.replicated)}
        self.state_shardings: dict[str, Any] = {"frozen": frozen_sh, "opt_state": opt_sh,
                                                "step": plan.replicated}
        if self.policy.mixed:
            cast = jax.jit(self.policy.cast_to_compute, out_shardings=param_sh)
            self.state.update(params=cast(master), master=master)
            self.state_shardings.update(params=param_sh, master=master_sh)
        else:
            self.state["params"] = jax.device_put(master, param_sh)
            self.state_shardings["params"] = param_sh
        if self.loss_scale is not None:
            self.state["loss_scale"] = jax.device_put(self.loss_scale.init(), plan.replicated)
            self.state_shardings["loss_scale"] = plan.replicated
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
        self._grad_fn = jax.jit(
            lambda state, batch: self._gradients(state, batch)[1],
            in_shardings=(self.state_shardings, self._batch_sharding),
            out_shardings=self.grad_shardings,
        )

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Config) -> Trainer:
        """Mesh, plan, sharded model and optimizer from a loaded config, as the CLI builds them.

        With ``config.init_from``, the model's weights come from that run's newest
        checkpoint (see :func:`jaxpar.checkpoint.load_weights`); the optimizer starts fresh.
        """
        mesh = make_mesh(config.mesh.ici(), dcn=config.mesh.dcn())
        p = config.plan
        plan = Plan.from_preset(mesh, p.rules, precision=Policy.parse(p.precision),
                                zero_stage=p.zero_stage, remat=p.remat,
                                microbatches=p.microbatches)
        seed = config.train.seed
        stages = mesh.shape["stage"]
        schedule = (pipeline_lib.Schedule.for_model(config.model.n_layers, stages,
                                                    config.pipeline.microbatches,
                                                    config.pipeline.repeats)
                    if stages > 1 else None)
        model = init_sharded(
            lambda: Transformer(config.model, rngs=nnx.Rngs(seed), pipeline=schedule), plan)
        if config.init_from:  # weights of an earlier run, before LoRA wraps them
            from jaxpar.checkpoint import load_weights

            load_weights(model, config.init_from, stages=stages)
        with plan.activate():
            lora_lib.apply_config(model, config.lora, rngs=seed, plan=plan)
        trainable = lora_lib.select_trainable(model, config.train.trainable)
        trainer = cls(model, make_optimizer(config.train), plan, trainable=trainable)
        trainer.config = config
        trainer.schedule = schedule
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
        model = nnx.merge(self._graphdef, self.policy.cast_to_compute(params),
                          self.policy.narrow_to_compute(frozen))
        return self.loss_fn(model, batch).astype(jnp.float32)

    def _gradients(self, state: dict[str, Any], batch: jax.Array) -> tuple[jax.Array, Any]:
        """Mean loss and gradients over the plan's microbatches (scaled if loss scaling)."""
        scale = state["loss_scale"]["scale"] if self.loss_scale is not None else 1.0

        def loss_and_grads(tokens):
            scaled = lambda p: self._loss(p, state["frozen"], tokens) * scale
            loss, grads = jax.value_and_grad(scaled)(state["params"])
            return loss / scale, grads

        k = self.plan.microbatches
        if k == 1:
            loss, grads = loss_and_grads(batch)
        else:
            if batch.shape[0] % (k * self.plan.data_parallel_size):
                raise JaxparError(
                    f"global batch {batch.shape[0]} does not split into {k} microbatches "
                    f"over {self.plan.data_parallel_size} data-parallel devices"
                )
            micro = batch.reshape(k, batch.shape[0] // k, *batch.shape[1:])
            micro = jax.lax.with_sharding_constraint(
                micro, self.plan.sharding(self.plan.act_spec((None, "batch", "seq"))))
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state["params"])

            def accumulate(carry, tokens):
                loss, grads = loss_and_grads(tokens)
                total_loss, total = carry
                total = jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total, grads)
                return (total_loss + loss, total), None

            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros),
                                            micro)
            loss = loss / k
            grads = jax.tree.map(lambda g, p: (g / k).astype(p.dtype), grads, state["params"])
        grads = jax.lax.with_sharding_constraint(grads, self.grad_shardings)
        return loss, grads

    def _step_impl(self, state: dict[str, Any], batch: jax.Array):
        loss, grads = self._gradients(state, batch)
        master = state["master"] if self.policy.mixed else state["params"]
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
        metrics: dict[str, jax.Array] = {"loss": loss}
        if self.loss_scale is not None:
            grads = jax.tree.map(lambda g: g / state["loss_scale"]["scale"], grads)
            finite = self.loss_scale.all_finite(grads)
            metrics.update(loss_scale=state["loss_scale"]["scale"],
                           skipped=(~finite).astype(jnp.int32))
        metrics["grad_norm"] = optax.tree.norm(grads)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], master)
        new_master = optax.apply_updates(master, updates)
        new_state = dict(state, step=state["step"] + 1)
        if self.loss_scale is not None:
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            new_master = keep(new_master, master)
            opt_state = keep(opt_state, state["opt_state"])
            new_state["loss_scale"] = self.loss_scale.adjust(state["loss_scale"], finite)
        new_state["opt_state"] = opt_state
        if self.policy.mixed:
            new_state.update(master=new_master,
                             params=self.policy.cast_to_compute(new_master))
        else:
            new_state["params"] = new_master
        return new_state, metrics

    def _eval_impl(self, state: dict[str, Any], batch: jax.Array) -> jax.Array:
        return self._loss(state["params"], state["frozen"], batch)

    def gradients(self, batch: np.ndarray | jax.Array) -> Any:
        """The gradients one step would apply, laid out as the ZeRO stage stores them."""
        if not isinstance(batch, jax.Array):
            batch = self.global_batch(batch)
        with self.plan.activate():
            return self._grad_fn(self.state, batch)

    def memory_report(self, batch: np.ndarray | jax.Array) -> dict[str, Any]:
        """Per-device bytes of parameters, gradients and optimizer state (master weights
        included), measured from the sharded arrays, beside the ZeRO formula."""
        grads = self.gradients(batch)
        n_params = sum(x.size for x in jax.tree.leaves(self.state["params"]))
        opt_bytes = per_device_bytes(self.state["opt_state"]) + per_device_bytes(
            self.state.get("master", {}))
        mesh = self.plan.mesh
        model_parallel = mesh.size // self.plan.data_parallel_size
        return {
            "param_bytes": per_device_bytes(self.state["params"]),
            "grad_bytes": per_device_bytes(grads),
            "opt_bytes": opt_bytes,
            "formula_bytes": formula_bytes(self.plan.zero_stage, n_params,
                                           self.plan.data_parallel_size, model_parallel),
            "n_params": n_params,
            "left_whole": list(self.zero_left_whole),
        }

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
