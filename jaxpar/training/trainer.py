"""The Trainer: a functional, jitted, sharded training step over any Flax NNX model.

State is a plain pytree of ``jax.Array``s (trainable parameters, the rest of the model's
state, optimizer state, step counter). The step takes state and batch in and returns the
new state, with the old state's buffers donated; nothing is updated in place, so nothing is
lost under ``jax.jit``. Those buffers are the Trainer's own: it copies the model it is
given and hands out copies (:attr:`Trainer.model`), so no array a caller holds is ever
donated. Optimizer state is sharded like the parameters it belongs to.

Variables that are not parameters (RNG stream counters that dropout advances, batch
statistics, adapter dropout counters) may change inside ``loss_fn``: the step returns their
new values, so the next step sees them (a new dropout mask each step). A batch is any
pytree of arrays, split over the data-parallel axes on its leading dimension.

The Trainer knows nothing of configs, checkpoints or the built-in model: assembling a run
from a config is :mod:`jaxpar.config.assembly`'s job.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar.errors import JaxparError, JaxparWarning
from jaxpar.parallel import accumulation, compression, offload, zeropp
from jaxpar.parallel.zero import formula_bytes, per_device_bytes
from jaxpar.sharding import precision as precision_lib
from jaxpar.sharding import quantization
from jaxpar.sharding import remat as remat_lib
from jaxpar.sharding.partitioning import (
    is_abstract,
    prepare_model,
    warn_if_heads_split,
    warn_if_replicated,
)
from jaxpar.sharding.plan import Plan, batch_names
from jaxpar.sharding.precision import DynamicLossScale
from jaxpar.training import offloaded_update
from jaxpar.training.model_errors import explained_model_errors
from jaxpar.training.model_support import check_model_support
from jaxpar.training.objective import (
    check_causal,
    check_tokens,
    first_id_outside,
    id_outside_error,
    lm_loss,
    next_token_logits,
    takes_rngs,
    token_ids,
)
from jaxpar.training.state_layout import state_layout

Batch = Any
"""A pytree of arrays whose leaves share a leading batch dimension."""

LossFn = Callable[[nnx.Module, Batch], jax.Array]

def _split_loss(out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A loss function's result as ``(loss, extra metrics)``: it may return the scalar loss
    or ``(loss, {name: scalar})``, whose entries join the step's metrics."""
    loss, extra = out if isinstance(out, tuple) else (out, {})
    return (jnp.asarray(loss).astype(jnp.float32),
            {name: jnp.asarray(v).astype(jnp.float32) for name, v in dict(extra).items()})


class CompiledSteps(NamedTuple):
    """The Trainer's jitted functions for one batch structure (state and batch in)."""

    train: Callable
    """One optimisation step: ``(state, batch) -> (new state, metrics)``, state donated."""
    evaluate: Callable
    """The loss in eval mode: ``(state, batch) -> scalar``."""
    gradients: Callable
    """The gradients a step would apply, laid out as the ZeRO stage stores them."""


_MUTABLE = nnx.Not(nnx.Param)
"""Variables a forward pass may change (RNG counters, batch statistics): all but Params."""


class Trainer:
    """Trains a sharded Flax NNX model with an optax optimizer under a :class:`Plan`.

    The plan's knobs shape the step: ``precision`` (with a half-precision compute dtype and
    f32 master weights, ``state["params"]`` is the compute-dtype working copy and
    ``state["master"]`` the f32 weights the optimizer updates; float16 adds dynamic loss
    scaling in ``state["loss_scale"]``), ``zero_stage`` (which state is split over the
    data-parallel axes), ``remat`` and ``microbatches`` (gradient accumulation), and
    ``offload_optimizer``, ``host_update`` and ``offload_params`` (state kept in host
    memory, see :mod:`jaxpar.parallel.offload`).

    Args:
      model: the model; typically built with :func:`jaxpar.init_sharded`. The Trainer
        trains a copy of its weights, placed as the plan says: ``model`` itself stays
        valid and unchanged (drop it to free its memory); :attr:`model` gives the trained
        weights.
      optimizer: any optax ``GradientTransformation``.
      plan: mesh, rules and knobs.
      loss_fn: ``loss_fn(model, batch) -> scalar`` (or ``(scalar, {name: scalar})``, whose
        entries join the step's metrics); defaults to next-token cross-entropy
        (:func:`lm_loss`). It may advance RNG streams and change other non-parameter
        state; the step keeps those changes.
      trainable: an ``nnx`` filter selecting the variables to train (default ``nnx.Param``);
        everything else receives no gradient.
      seed: seeds the call-time RNGs: a ``loss_fn`` with an ``rngs`` parameter gets
        ``rngs=nnx.Rngs(...)`` drawn from ``seed``, the step and the microbatch (the default
        loss passes them on to a model whose ``__call__`` takes ``rngs``). Models that keep
        ``nnx.Rngs`` as attributes need none of this: their streams advance step by step.

      check_ids: with the default loss, check every batch's token ids against the
        model's vocabulary (``model.config.vocab_size``, else its logits' last dimension)
        before the step or evaluation runs: one reduction on the devices, compiled once
        per batch shape. An id out of range (which would otherwise corrupt the weights
        for good, or be silently wrapped) raises :class:`JaxparError` naming its row,
        position and value. ``jaxpar train`` checks its corpus once and turns this off.

    Modes: each step runs the model in train mode (``model.train()``: dropout on, batch
    statistics updated) and :meth:`eval_loss` in eval mode, whatever mode the model was
    given in.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        plan: Plan,
        *,
        loss_fn: LossFn = lm_loss,
        trainable: Any = nnx.Param,
        seed: int = 0,
        check_ids: bool = True,
    ):
        self.plan = plan
        self.policy = plan.precision
        self.stores_copy = self.policy.mixed and plan.stores_weight_copy
        """Whether the state holds a compute-dtype copy of the weights (``params``) beside
        the master weights (``master``); without one, ``params`` are the master weights
        and the step casts them as it uses them (see ``Plan.weight_copy``)."""
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.seed = seed
        self.check_ids = check_ids and loss_fn is lm_loss
        self.loss_scale = DynamicLossScale() if self.policy.needs_loss_scaling else None
        self._vocab: int | None = None
        self._id_checks: dict[Any, Callable] = {}
        self._loss_rngs = takes_rngs(loss_fn)
        # Whether the loss draws random numbers: the default loss passes its keys on only
        # to a model whose __call__ takes them.
        self._draws_keys = self._loss_rngs and (loss_fn is not lm_loss
                                                or takes_rngs(type(model).__call__))
        self._loss_checked = loss_fn is not lm_loss
        self._names_checked = False  # offload:<names> policies: names the model marks
        self._model_name = type(model).__name__
        self._compiled: dict[Any, CompiledSteps] = {}
        prepare_model(model, plan)
        self.pipeline_schedule = getattr(model, "pipeline_schedule", None)
        """The model's pipeline schedule, if it has one: how its layers are stacked."""
        self._graphdef, params, frozen = nnx.split(model, trainable, ...)
        self._widened = (precision_lib.widened_kernel_paths(model)
                         if plan.grad_dtype == "float32" and self.policy.mixed else set())
        """The state paths of the kernels whose gradients are summed in float32."""
        self.abstract = is_abstract((params, frozen))
        """Whether the model holds shapes only (:func:`jaxpar.sharding.partitioning.
        abstract_sharded`): the state is then ``jax.ShapeDtypeStruct``s with their
        shardings, and the step can be lowered and compiled (:meth:`lower`) for devices
        that are not attached, but not run."""
        self.replication = warn_if_replicated(plan, nnx.state(model))
        warn_if_heads_split(plan, model)
        with plan.activate():
            layout = state_layout(plan, params, frozen, self.optimizer, self.policy,
                                  stores_copy=self.stores_copy,
                                  loss_scaled=self.loss_scale is not None)
            self.state_shardings, self.grad_shardings = layout.state, layout.grads
            self.update_shardings, self.zero_left_whole = layout.update, layout.left_whole
            # (after the layout, whose refusals name the knob more precisely)
            check_model_support(model, plan, self.pipeline_schedule)
            state = self._initial_state(params, frozen)
        self._state, self._host_step = state, 0
        self.streams_update = offloaded_update.streams(self.optimizer, plan, params)
        """Whether the optimizer update of offloaded state runs slab by slab (see
        :mod:`jaxpar.parallel.streamed_update`): about two slabs of state on the device at
        once instead of all of it."""

    def _initial_state(self, params: nnx.State, frozen: nnx.State) -> dict[str, Any]:
        """The state placed by :attr:`state_shardings`: copies, never the caller's buffers
        (the step donates its state, and the model the caller holds, or another Trainer
        built from it, must stay valid). For an abstract model, the same state's shapes,
        each with its sharding."""
        sh = self.state_shardings
        if self.abstract:
            return self._abstract_state(params, frozen)
        master = jax.device_put(self.policy.cast_to_params(params),
                                sh.get("master", sh["params"]), may_alias=False)
        state = {"frozen": jax.device_put(frozen, sh["frozen"], may_alias=False),
                 "opt_state": jax.jit(self.optimizer.init, out_shardings=sh["opt_state"])(
                     master),
                 "step": jax.device_put(jnp.zeros((), jnp.int32), sh["step"])}
        if self.stores_copy:
            cast = jax.jit(lambda m: self.policy.cast_to_compute(offload.to_device(m)),
                           out_shardings=sh["params"])
            state.update(params=cast(master), master=master)
        else:
            state["params"] = jax.device_put(master, sh["params"])
        if self.loss_scale is not None:
            state["loss_scale"] = jax.device_put(self.loss_scale.init(), sh["loss_scale"])
        if "grad_error" in sh:
            state["grad_error"] = jax.jit(lambda p: compression.zero_errors(p, self.plan),
                                          out_shardings=sh["grad_error"])(params)
        return state

    def _abstract_state(self, params: nnx.State, frozen: nnx.State) -> dict[str, Any]:
        """The shapes and dtypes :meth:`_initial_state` would give, with their shardings."""
        def values(params, frozen):
            master = self.policy.cast_to_params(params)
            state = {"frozen": frozen, "opt_state": self.optimizer.init(master),
                     "step": jnp.zeros((), jnp.int32), "params": master}
            if self.stores_copy:
                state.update(params=self.policy.cast_to_compute(master), master=master)
            if self.loss_scale is not None:
                state["loss_scale"] = self.loss_scale.init()
            if "grad_error" in self.state_shardings:
                state["grad_error"] = compression.zero_errors(params, self.plan)
            return state

        shapes = jax.eval_shape(values, params, frozen)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    def _concrete(self, what: str) -> None:
        if self.abstract:
            raise JaxparError(f"this Trainer holds shapes only (an abstract model): it can "
                              f"lower and compile its step, not {what}")

    def batch_shardings(self, batch: Batch) -> Any:
        """The sharding of each leaf of a (global) batch like ``batch``."""
        return jax.tree.map(lambda x: self.plan.batch_sharding(np.ndim(x)), batch)

    @staticmethod
    def _batch_key(batch: Batch) -> Any:
        return jax.tree.structure(batch), tuple(len(np.shape(x)) if not hasattr(x, "ndim")
                                                else x.ndim for x in jax.tree.leaves(batch))

    def use_compiled(self, batch: Batch, executable: Callable) -> None:
        """Run ``executable``, this trainer's step compiled ahead of time (``jaxpar compile
        --save``, :mod:`jaxpar.analysis.executables`), for batches shaped like ``batch``
        instead of compiling the step."""
        self._concrete("run a compiled step")
        self._compiled[self._batch_key(batch)] = self._steps(batch)._replace(train=executable)

    def _steps(self, batch: Batch) -> CompiledSteps:
        """The jitted train, eval and gradient functions for batches shaped like ``batch``."""
        key = self._batch_key(batch)
        if key not in self._compiled:
            batch_sh = self.batch_shardings(batch)
            state_sh, rep = self.state_shardings, self.plan.replicated
            self._compiled[key] = CompiledSteps(
                jax.jit(self._step_impl, in_shardings=(state_sh, batch_sh),
                        out_shardings=(state_sh, rep), donate_argnums=0),
                jax.jit(self._eval_impl, in_shardings=(state_sh, batch_sh), out_shardings=rep),
                jax.jit(lambda state, b: self._gradients(state, b)[1],
                        in_shardings=(state_sh, batch_sh), out_shardings=self.grad_shardings),
            )
            self._check_offloaded_names(self._compiled[key].train, batch)
        return self._compiled[key]

    def _check_offloaded_names(self, train: Any, batch: Batch) -> None:
        """Warn, once, when an ``offload:<names>`` remat policy names activations the
        model never marks (``checkpoint_name``): those are recomputed, not saved to the
        host, and the policy does nothing for them."""
        names = remat_lib.offloaded_names(self.plan.remat)
        if not names or self._names_checked:
            return
        self._names_checked = True
        with self.plan.activate(mesh_context=True):
            marked = remat_lib.marked_names(train.trace(self.state, batch).jaxpr)
        missing = [n for n in names if n not in marked]
        if missing:
            warnings.warn(
                f"plan.remat={self.plan.remat!r}: {self._model_name} marks "
                f"no activation {', '.join(missing)} (jax.ad_checkpoint.checkpoint_name), "
                "so nothing of that name is saved to the host: name them in the model, or "
                "choose another policy", JaxparWarning, stacklevel=4)

    # --- construction ---------------------------------------------------------------------
    # --- the step -------------------------------------------------------------------------
    def _merged(self, params: nnx.State, frozen: nnx.State) -> nnx.Module:
        """The model with these weights, in the compute dtype (gathered in int8 under
        ``plan.quantize_gather``)."""
        parts = {"params": self._compute_params(params),
                 "frozen": self.policy.narrow_to_compute(frozen)}
        manual = jax.sharding.get_abstract_mesh().manual_axes  # qgZ gathered them already
        if self.plan.quantize_gather == "int8" and not manual:
            parts = {k: zeropp.gather_int8(v, self.state_shardings[k], self.plan.mesh,
                                    self.plan.data_parallel_axes) for k, v in parts.items()}
        if self.plan.hpz and not manual:  # ZeRO++ hpZ: one gather across slices a step
            parts = {k: zeropp.slice_copy(v, self.state_shardings[k], self.plan.mesh)
                     for k, v in parts.items()}
        model = nnx.merge(self._graphdef, parts["params"], parts["frozen"])
        if self._widened:
            precision_lib.widen_weight_gradients(model, self.policy.compute)
        return model

    def _compute_params(self, params: nnx.State) -> nnx.State:
        """The weights cast to the compute dtype; under ``plan.grad_dtype=float32`` the
        projection layers' kernels stay float32 (their matmuls cast them: see
        :func:`jaxpar.sharding.precision.widen_weight_gradients`)."""
        if not self._widened:
            return self.policy.cast_to_compute(params)
        flat = nnx.to_flat_state(params)
        keep = self._widened
        return nnx.from_flat_state([
            (path, var if tuple(path) in keep else self.policy.cast_to_compute(var))
            for path, var in flat])

    def _call_loss(self, model: nnx.Module, batch: Batch, key: jax.Array) -> Any:
        """The loss function on ``model``, its matmuls quantized as ``plan.quantize`` says."""
        rngs = {"rngs": nnx.Rngs(key)} if self._loss_rngs else {}
        plan = self.plan
        return quantization.quantized_loss(model, lambda m: self.loss_fn(m, batch, **rngs),
                                           plan.quantize, plan.quantize_target,
                                           plan.quantize_exclude, carried=_MUTABLE)

    def _loss(self, params: nnx.State, frozen: nnx.State, batch: Batch, key: jax.Array
              ) -> tuple[jax.Array, tuple[nnx.State, dict[str, jax.Array]]]:
        """Loss of the model with these weights in train mode, and (its non-parameter state
        afterwards, the loss function's extra metrics)."""
        model = self._merged(params, frozen)
        model.train()
        loss, extra = _split_loss(self._call_loss(model, batch, key))
        return loss, (nnx.state(model, _MUTABLE), extra)

    def _step_key(self, step: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.key(self.seed), step)

    @staticmethod
    def _keep_mutated(frozen: nnx.State, mutated: nnx.State) -> nnx.State:
        """``frozen`` with its non-parameter variables replaced by their new values (in
        their stored dtypes: a compute-dtype pass must not narrow batch statistics)."""
        if not jax.tree.leaves(mutated):
            return frozen
        flat_old = dict(nnx.to_flat_state(frozen))
        updated = []
        for path, var in nnx.to_flat_state(mutated):
            before = flat_old.get(path)
            value = var.get_value()
            if before is not None and hasattr(value, "astype"):
                value = value.astype(before.get_value().dtype)
            updated.append((path, var.replace(value)))
        return nnx.merge_state(frozen, nnx.from_flat_state(updated))

    def _gradients(self, state: dict[str, Any], batch: Batch
                   ) -> tuple[jax.Array, Any, nnx.State, dict[str, jax.Array]]:
        """Mean loss, gradients (scaled if loss scaling), the non-parameter state after
        the plan's microbatches, and the loss function's extra metrics (their mean)."""
        scale = state["loss_scale"]["scale"] if self.loss_scale is not None else 1.0

        key = self._step_key(state["step"])

        def loss_and_grads(params, frozen, micro, index=0):
            def scaled(p):
                loss, aux = self._loss(p, frozen, micro, jax.random.fold_in(key, index))
                return loss * scale, aux

            (loss, (mutated, extra)), grads = jax.value_and_grad(scaled, has_aux=True)(
                params)
            # Streamed weights' gradients come back in host memory: they stay on the device.
            grads = offload.to_device(grads)
            return loss / scale, grads, self._keep_mutated(frozen, mutated), extra

        k = self.plan.microbatches
        if k == 1:
            loss, grads, frozen, extra = loss_and_grads(state["params"], state["frozen"],
                                                        batch)
        else:
            rows = jax.tree.leaves(batch)[0].shape[0]
            if rows % (k * self.plan.data_parallel_size):
                raise JaxparError(
                    f"global batch {rows} does not split into {k} microbatches "
                    f"over {self.plan.data_parallel_size} data-parallel devices"
                )

            def split(x):
                # Microbatch i takes rows i, i + k, ...: a batch split in contiguous blocks
                # over the data-parallel axes splits every microbatch evenly over them, so
                # the split moves nothing (contiguous microbatches each sat on a part of
                # the devices: an all-to-all, and on an explicit mesh a refused reshape).
                names = (None, *batch_names(x.ndim))
                sharding = self.plan.sharding(self.plan.act_spec(names))
                rows = x.reshape(x.shape[0] // k, k, *x.shape[1:])
                return self.plan.place(jnp.swapaxes(rows, 0, 1), sharding)

            micro = jax.tree.map(split, batch)
            # One data-parallel reduction a step where it can wait (parallel/accumulation.py),
            # in the compute dtype.
            by_hand = accumulation.local_axes(self.plan, rows, k, state["frozen"],
                                              draws_keys=self._draws_keys)
            # ZeRO-2 and 3 sum into their shard of the gradients.
            sharded_sum = self.plan.zero_stage >= 2 and not by_hand
            loss, grads, frozen, extra = accumulation.accumulate(
                loss_and_grads, state["params"], state["frozen"], micro,
                mesh=self.plan.mesh, axes=by_hand, reduce_as=self._compute_params,
                lay_out=(lambda g: self.plan.place(g, self.grad_shardings)) if sharded_sum
                else lambda g: g)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
        if self.plan.zero_stage >= 2 or k > 1:
            # ZeRO-2/3 keep only their shard (a reduce-scatter); an accumulated sum is laid
            # out like the parameters. Otherwise XLA places the gradients itself, as a
            # hand-written step would (pinning them adds a collective: see
            # benchmarks/overhead.py).
            grads = self.plan.place(grads, self.grad_shardings)
        return loss, grads, frozen, extra

    def _update(self, grads: Any, opt_state: Any, master: Any) -> tuple[Any, Any]:
        """The optimizer's update applied: (new master weights, new optimizer state). State
        in host memory that cannot stream (see :attr:`streams_update`) comes to the device
        whole for it."""
        opt_state, master = offload.to_device((opt_state, master))
        if self.plan.explicit and self.plan.zero_stage in (1, 2):
            # Weights (and ZeRO-1's gradients) kept whole over data meet the moments'
            # shards: an explicit mesh types the mismatch, where GSPMD reshards on its own.
            grads, master = self.plan.place((grads, master), (self.update_shardings,) * 2)
        updates, opt_state = self.optimizer.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    def _step_impl(self, state: dict[str, Any], batch: Batch):
        errors = None
        if "grad_error" in state:  # one-bit averaging over data (parallel/compression.py)
            reduce = compression.data_parallel(self._gradients, self.plan,
                                               self.state_shardings["grad_error"])
            view = {k: v for k, v in state.items() if k != "grad_error"}
            loss, grads, frozen, extra, errors = reduce(view, batch, state["grad_error"])
        elif self.plan.quantize_reduce == "int8":  # ZeRO++ qgZ (parallel/zeropp.py)
            reduce = zeropp.reduce_int8(self._gradients, self.plan, self.state_shardings,
                                        self.grad_shardings)
            view = {k: state[k] for k in ("params", "frozen", "step", "loss_scale")
                    if k in state}
            loss, grads, frozen, extra = reduce(view, batch)
        else:
            loss, grads, frozen, extra = self._gradients(state, batch)
        if self.streams_update or self.plan.host_update:
            return offloaded_update.step_end(self, state, loss, grads, frozen, extra, errors)
        master = offload.to_device(state[self.master_key])
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
        metrics: dict[str, jax.Array] = {"loss": loss, **extra}
        if self.loss_scale is not None:
            grads = jax.tree.map(lambda g: g / state["loss_scale"]["scale"], grads)
            finite = self.loss_scale.all_finite(grads)
            metrics.update(loss_scale=state["loss_scale"]["scale"],
                           skipped=(~finite).astype(jnp.int32))
        metrics["grad_norm"] = optax.tree.norm(grads)
        new_master, opt_state = self._update(grads, state["opt_state"], master)
        new_state = dict(state, step=state["step"] + 1, frozen=frozen)
        if self.loss_scale is not None:
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            new_master = keep(new_master, master)
            opt_state = keep(opt_state, offload.to_device(state["opt_state"]))
            new_state["loss_scale"] = self.loss_scale.adjust(state["loss_scale"], finite)
        new_state["opt_state"] = opt_state
        if errors is not None:
            new_state["grad_error"] = errors
        if self.stores_copy:
            new_state.update(master=new_master,
                             params=self.policy.cast_to_compute(new_master))
        else:
            new_state["params"] = new_master
        return new_state, metrics

    def _eval_impl(self, state: dict[str, Any], batch: Batch) -> jax.Array:
        model = self._merged(state["params"], state["frozen"])
        model.eval()  # dropout off, running statistics used
        return _split_loss(self._call_loss(model, batch, self._step_key(state["step"])))[0]

    def gradients(self, batch: Batch) -> Any:
        """The gradients one step would apply, laid out as the ZeRO stage stores them."""
        self._concrete("compute gradients")
        batch = self._as_global(batch)
        with self.plan.activate(mesh_context=True):
            return self._steps(batch).gradients(self.state, batch)

    def memory_report(self, batch: Batch) -> dict[str, Any]:
        """Per-device bytes of parameters, gradients and optimizer state (master weights
        included), measured from the sharded arrays, beside the ZeRO formula;
        ``host_bytes`` is the part of the state kept in host memory (offload)."""
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
            "host_bytes": offload.host_bytes(self.state)[1],
        }

    def global_batch(self, local_rows: Batch) -> Batch:
        """Assemble the global batch from this process's rows (multi-host ready): every
        leaf of the pytree ``local_rows`` becomes one global array."""
        def one(rows):
            rows = np.asarray(rows)
            if rows.ndim == 0:
                raise JaxparError("every leaf of a batch needs a leading batch dimension, "
                                  "got a scalar")
            shape = (rows.shape[0] * jax.process_count(),) + rows.shape[1:]
            dp = self.plan.data_parallel_size
            if shape[0] % dp:
                raise JaxparError(
                    f"a global batch of {shape[0]} rows does not split over the "
                    f"data-parallel size {dp} (mesh axes "
                    f"{', '.join(self.plan.data_parallel_axes)}): use a multiple of {dp}")
            return jax.make_array_from_process_local_data(
                self.plan.batch_sharding(rows.ndim), rows, shape)

        return jax.tree.map(one, local_rows)

    def _as_global(self, batch: Batch) -> Batch:
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise JaxparError("the batch is empty: it has no arrays")
        if all(isinstance(x, jax.Array) for x in leaves):
            return batch
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):  # a global batch's shape
            return jax.tree.map(lambda x: x if x.sharding is not None else jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=self.plan.batch_sharding(x.ndim)), batch)
        return self.global_batch(batch)

    def lower(self, batch: Batch):
        """``jax.stages.Lowered`` of one train step on a batch like ``batch`` (for
        inspection and ahead-of-time compilation): arrays, or ``jax.ShapeDtypeStruct``s of
        the global batch. This is the program :meth:`step` runs."""
        batch = self._as_global(batch)
        with self.plan.activate(mesh_context=True):
            return self._steps(batch).train.lower(self.state, batch)

    def check_default_loss(self, batch: Batch) -> None:
        """Check, once, what the default loss assumes of the model: that its logits at
        position ``t`` depend on input token ``t`` (a model that shifts its inputs itself
        would be trained to skip a token) and on no later token (a bidirectional model
        would learn to copy). Runs one forward pass, in eval mode, on the first
        data-parallel rows of ``batch`` and a copy with token ``seq // 2`` changed; the
        Trainer calls it before its first step. Models with their own
        ``next_token_loss`` (the reference model) and custom losses are not checked.

        Raises:
          JaxparError: naming the model and what to pass instead.
        """
        if self._loss_checked:
            return
        self._loss_checked = True
        batch = token_ids(self._as_global(batch))  # (a packed batch: its ids)
        check_tokens(batch)
        model = nnx.merge(self._graphdef, self.state["params"], self.state["frozen"])
        seq = batch.shape[1] - 1
        if seq < 2 or callable(getattr(model, "next_token_loss", None)):
            return
        name, t, rows = type(model).__name__, seq // 2, self.plan.data_parallel_size

        def changed_logits(state, tokens):
            inputs = tokens[:rows, :-1]
            flipped = inputs.at[:, t].set(jnp.where(inputs[:, t] == 0, 1, 0))
            both = self.plan.place(jnp.concatenate([inputs, flipped]),
                                   self.plan.batch_sharding(2))
            logits = self._eval_logits(state, both).astype(jnp.float32)
            diff = jnp.abs(logits[:rows] - logits[rows:]).max(axis=(0, 2))
            return diff, jnp.abs(logits).max()

        with self.plan.activate(mesh_context=True), explained_model_errors(self.plan):
            diff, scale = jax.device_get(jax.jit(changed_logits)(self.state, batch))
        check_causal(name, diff, float(scale), t)

    def _eval_logits(self, state: dict[str, Any], inputs: jax.Array) -> jax.Array:
        """The default loss's logits on ``inputs``, the model in eval mode (to trace)."""
        model = self._merged(state["params"], state["frozen"])
        model.eval()
        return next_token_logits(model, inputs, nnx.Rngs(0))

    def vocabulary(self, batch: Batch) -> int:
        """The model's vocabulary size: ``model.config.vocab_size`` when it has one (the
        reference model), else the last dimension of its logits on ``batch``."""
        batch = token_ids(batch)
        if self._vocab is None:
            model = nnx.merge(self._graphdef, self.state["params"], self.state["frozen"])
            size = getattr(getattr(model, "config", None), "vocab_size", None)
            if not isinstance(size, int):
                with self.plan.activate(mesh_context=True), \
                        explained_model_errors(self.plan):
                    logits = jax.eval_shape(lambda st, b: self._eval_logits(st, b[:, :-1]),
                                            self.state, batch)
                size = int(logits.shape[-1])
            self._vocab = size
        return self._vocab

    def _check_token_ids(self, batch: Batch) -> None:
        """Refuse a batch holding ids outside the vocabulary (see ``check_ids``)."""
        if not self.check_ids:
            return
        batch = token_ids(batch)
        check_tokens(batch)
        vocab = self.vocabulary(batch)
        check = self._id_checks.get(batch.shape)
        if check is None:
            check = jax.jit(functools.partial(first_id_outside, vocab=vocab),
                            out_shardings=self.plan.replicated)
            self._id_checks[batch.shape] = check
        with self.plan.activate(mesh_context=True):
            at, value = (int(x) for x in jax.device_get(check(batch)))
        if at >= 0:
            raise id_outside_error(value, *divmod(at, batch.shape[1]), vocab)

    def step_async(self, batch: Batch) -> dict[str, jax.Array]:
        """One optimisation step, dispatched without waiting for it: the returned metrics
        (scalars: ``loss``, ``grad_norm``, with fp16 ``loss_scale`` and ``skipped``) stay on
        the devices until fetched (``jax.device_get``), so the host can prepare the next
        batch, or dispatch the next steps, while this one runs."""
        self._concrete("run it")
        batch = self._as_global(batch)
        self._check_token_ids(batch)
        if not self._loss_checked:
            self.check_default_loss(batch)
        with self.plan.activate(mesh_context=True), explained_model_errors(self.plan):
            self._state, metrics = self._steps(batch).train(self._state, batch)
        if self._host_step is not None:
            self._host_step += 1
        return metrics

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimisation step on this process's rows of the batch; waits for it and
        returns its metrics as host numbers (``step``: the step count after it)."""
        metrics = jax.device_get(self.step_async(batch))
        out = {k: float(v) for k, v in metrics.items()}
        out["step"] = self.step_count
        return out

    def eval_loss(self, batch: Batch) -> float:
        """Loss on a batch without updating anything (the model in eval mode)."""
        self._concrete("evaluate")
        batch = self._as_global(batch)
        self._check_token_ids(batch)
        with self.plan.activate(mesh_context=True), explained_model_errors(self.plan):
            return float(self._steps(batch).evaluate(self.state, batch))

    @property
    def structure(self) -> nnx.Module:
        """The model as the step runs it, sharing the state's arrays (no copy): for reading
        its structure (stacked blocks, pipeline layout), not for handing out weights, which
        the next step donates (use :attr:`model`)."""
        return nnx.merge(self._graphdef, self.state["params"], self.state["frozen"])

    @property
    def model(self) -> nnx.Module:
        """A snapshot of the model with the current weights, in arrays of its own.

        The step donates the Trainer's state buffers to the next state, so nothing handed
        out may share them: the snapshot stays valid after further steps (it does not
        follow them; ask again for newer weights), and a new Trainer built from it leaves
        this one intact. It costs one copy of the model's weights while it is held."""
        self._concrete("hand out weights")
        state = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False),
                             (self.state["params"], self.state["frozen"]))
        return nnx.merge(self._graphdef, *state)

    @property
    def master_key(self) -> str:
        """The state's key of the weights the optimizer updates: ``master`` when the state
        also holds a compute-dtype copy (:attr:`stores_copy`), else ``params``."""
        return "master" if self.stores_copy else "params"

    @property
    def state(self) -> dict[str, Any]:
        """The training state: ``params``, ``frozen``, ``opt_state``, ``step`` (and
        ``master``, ``loss_scale`` under mixed precision), sharded as
        :attr:`state_shardings` says. Assigning it (a restored checkpoint) is allowed."""
        return self._state

    @state.setter
    def state(self, value: dict[str, Any]) -> None:
        self._state = value
        self._host_step = None  # read from the new state when next asked

    @property
    def step_count(self) -> int:
        """Optimisation steps taken so far (counted on the host: asking does not wait for
        the steps in flight)."""
        if self._host_step is None:
            self._host_step = int(self._state["step"])
        return self._host_step
