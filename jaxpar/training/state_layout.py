"""Where each part of a Trainer's state lives: the weights, master weights, optimizer
state and gradients under the plan's ZeRO stage, and what host offload moves to host
memory (:mod:`jaxpar.parallel.zero`, :mod:`jaxpar.parallel.offload`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.parallel import compression, offload, zeropp
from jaxpar.parallel.zero import stacked_dims, zero_shardings
from jaxpar.sharding.partitioning import logical_names, state_shardings
from jaxpar.sharding.plan import Plan
from jaxpar.sharding.precision import Policy


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The shardings of a training run's state and of the arrays its step makes."""

    state: dict[str, Any]
    """Each part of the state's (``params``, ``frozen``, ``opt_state``, ``step``, and
    ``master``, ``loss_scale``, ``grad_error`` where the run has them), host memory kinds
    included."""
    grads: Any
    """The gradients', where the reduction leaves them (ZeRO-2 and 3: their shards)."""
    update: Any
    """The optimizer update's: the optimizer state's layout (ZeRO-1 and up: shards)."""
    left_whole: list[str]
    """The weights ZeRO left whole (no dimension divides over the data-parallel axes)."""


def state_layout(plan: Plan, params: nnx.State, frozen: nnx.State,
                 optimizer: optax.GradientTransformation, policy: Policy, *,
                 stores_copy: bool, loss_scaled: bool) -> StateLayout:
    """Where each part of the state lives under ``plan``'s ZeRO stage and offload knobs.
    ``stores_copy``: a compute-dtype copy of the weights is kept beside the master;
    ``loss_scaled``: the state holds a dynamic loss scale."""
    stage = plan.zero_stage
    base = state_shardings(plan, params)
    stacked = jax.tree_util.tree_map(lambda v: v.replace(stacked_dims(logical_names(v))),
                                     params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    zero, left_whole = zero_shardings(base, params, plan.mesh, plan.data_parallel_axes,
                                      stacked)
    master = zero if stage >= 1 else base
    shardings = {"frozen": state_shardings(plan, frozen),
                 "opt_state": _opt_shardings(plan, optimizer, params, master),
                 "step": plan.replicated,
                 "params": zero if stage >= 3 else base}
    if policy.mixed and not stores_copy:  # the master weights are the params
        shardings["params"] = master
    if stores_copy:
        shardings["master"] = master
    if loss_scaled:
        shardings["loss_scale"] = plan.replicated
    if plan.compress_gradients != "none":
        shardings["grad_error"] = compression.error_shardings(plan, base)
    if plan.quantize_reduce != "none":
        zeropp.check(plan, zero if stage >= 2 else base)
    if plan.hpz:
        zeropp.check_hpz(plan, zero if stage >= 3 else base)
    shardings = _offloaded(plan, optimizer, policy, stores_copy, shardings, params, frozen)
    return StateLayout(shardings, zero if stage >= 2 else base, master, left_whole)


def _opt_shardings(plan: Plan, optimizer: optax.GradientTransformation, params: nnx.State,
                   param_sh: nnx.State) -> Any:
    """The optimizer state's shardings: each parameter-shaped leaf as ``param_sh`` says,
    the rest (counts, scalars) replicated."""
    shapes = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, shapes, param_sh,
        transform_non_params=lambda _: plan.replicated,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def _offloaded(plan: Plan, optimizer: optax.GradientTransformation, policy: Policy,
               stores_copy: bool, shardings: dict[str, Any], params: nnx.State,
               frozen: nnx.State) -> dict[str, Any]:
    """``shardings`` with the state the plan offloads in host memory (see
    :mod:`jaxpar.parallel.offload`): the stacked layers' weights, and the largest
    optimizer tensors up to the plan's fraction of their bytes."""
    if not (plan.offload_params or plan.offload_optimizer):
        return shardings
    offload.check_supported(plan.mesh)
    out = dict(shardings)
    if plan.offload_params:
        if plan.mesh.shape.get("stage", 1) > 1:
            raise JaxparError("plan.offload_params streams the layers of one layer "
                              "loop; it does not combine with pipeline stages "
                              "(mesh.stage > 1)")
        mask = offload.streamed_mask(params)
        if not any(jax.tree.leaves(mask)) and not any(
                jax.tree.leaves(offload.streamed_mask(frozen))):
            raise JaxparError("plan.offload_params: the model has no weights stacked "
                              "over a 'layers' axis to stream from the host")
        out["params"] = offload.in_memory(out["params"], mask)
        out["frozen"] = offload.in_memory(out["frozen"], offload.streamed_mask(frozen))
    if plan.offload_optimizer:
        moved = {"opt_state": jax.eval_shape(optimizer.init, params)}
        if stores_copy:
            moved["master"] = jax.eval_shape(policy.cast_to_params, params)
        mask = offload.largest_first(moved, plan.offload_optimizer)
        for key, part in mask.items():
            out[key] = offload.in_memory(out[key], part)
    else:
        moved = {}
    moved.update(params=params, frozen=frozen)
    offload.check_gpu_pool(plan.mesh, offload.pinned_bytes(
        moved, {k: out[k] for k in moved}))
    return out
