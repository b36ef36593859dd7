"""The end of a training step whose optimizer state lives in host memory (ZeRO-Offload):
the update streamed through the device slab by slab
(:mod:`jaxpar.parallel.streamed_update`), or run on the host (``plan.host_update``: the
gradients go down, the new working weights come up, a slab at a time).

The gradients stay in their dtype until their slab is updated; the global norm (for
clipping, handed to the optimizer as the extra argument ``global_norm``) and the
finiteness check under loss scaling read all of them once. An optimizer that cannot be
applied slab by slab (:func:`streams`) gets its state brought down, or its gradients
sent up, whole.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.parallel import offload, streamed_update


def streams(optimizer: optax.GradientTransformation, plan: Any, params: Any) -> bool:
    """Whether the update of ``plan``'s offloaded state can stream slab by slab: the plan
    offloads optimizer state and ``optimizer`` treats each element on its own (checked on
    a tiny copy of ``params``' tree); otherwise a warning says what happens instead."""
    if not plan.offload_optimizer:
        return False
    if streamed_update.is_elementwise(optimizer, params):
        return True
    where = ("all of the gradients go to the host at once" if plan.host_update else
             "all of the offloaded state comes to the device for the update")
    warnings.warn("plan.offload_optimizer: the optimizer's update mixes tensors (a global "
                  "norm it computes itself, factored moments), so it cannot be streamed slab "
                  f"by slab: {where} (jaxpar's train.grad_clip streams; so do Adam, AdamW, "
                  "SGD and Lion)", stacklevel=3)
    return False


def ready(grad: jax.Array, dtype: Any, scale: jax.Array | None) -> jax.Array:
    """A gradient in the optimizer's dtype, the loss scale divided out."""
    grad = grad.astype(dtype)
    return grad if scale is None else grad / scale


def slab_update(trainer: Any, grads: Any, opt_state: Any, master: Any, scalars: tuple
                ) -> tuple[Any, Any, Any]:
    """``trainer``'s optimizer applied to (a slab of) offloaded state: (new master
    weights, new optimizer state, new working weights). ``scalars``: the gradients'
    global norm, the loss scale and whether the gradients are finite (None without loss
    scaling): a step with non-finite gradients keeps the old state."""
    norm, scale, finite = scalars
    policy = trainer.policy
    grads = jax.tree.map(lambda g, m: ready(g, m.dtype, scale), grads, master)
    updates, new_s = optax.with_extra_args_support(trainer.optimizer).update(
        grads, opt_state, master, global_norm=norm)
    new_m = optax.apply_updates(master, updates)
    if finite is not None:
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_m, new_s = keep(new_m, master), keep(new_s, opt_state)
    return new_m, new_s, policy.cast_to_compute(new_m) if trainer.stores_copy else new_m


def step_end(trainer: Any, state: dict[str, Any], loss: jax.Array, grads: Any, frozen: Any,
             extra: dict[str, jax.Array], errors: Any) -> tuple[dict[str, Any], dict]:
    """Inside ``trainer``'s traced step, after the gradients: the offloaded update and the
    new state, with the step's metrics."""
    plan, mixed = trainer.plan, trainer.stores_copy
    master = state["master"] if mixed else state["params"]
    loss_scale = trainer.loss_scale
    scale = state["loss_scale"]["scale"] if loss_scale is not None else None
    full = jax.tree.map(lambda g, m: ready(g, m.dtype, scale), grads, master)
    metrics: dict[str, jax.Array] = {"loss": loss, **extra}
    norm = optax.tree.norm(full)
    finite = None
    if loss_scale is not None:
        finite = loss_scale.all_finite(full)
        metrics.update(loss_scale=scale, skipped=(~finite).astype(jnp.int32))
    metrics["grad_norm"] = norm
    scalars = (norm, scale, finite)
    space = jax.memory.Space.Host if plan.host_update else jax.memory.Space.Device
    if space == jax.memory.Space.Host:
        on_host = offload.on_host(lambda g, s, m, sc: slab_update(trainer, g, s, m, sc),
                                  out=space)
        host_scalars = offload.to_host(scalars)
        update = lambda g, s, m: on_host(g, s, m, host_scalars)  # noqa: E731
    else:
        update = lambda g, s, m: slab_update(trainer, g, s, m, scalars)  # noqa: E731
    if trainer.streams_update:
        owners = streamed_update.state_owners(trainer.optimizer, state["opt_state"], master)
        host = [offload.is_on_host(x) for x in jax.tree.leaves(master)]
        for x, j in zip(jax.tree.leaves(state["opt_state"]), owners, strict=True):
            if j >= 0 and offload.is_on_host(x):
                host[j] = True
        slabs = streamed_update.plan_slabs(
            master, trainer.state_shardings["master" if mixed else "params"], host,
            plan.update_chunk)
        new_master, opt_state, params = streamed_update.streamed_update(
            update, grads, state["opt_state"], master, state["params"] if mixed else None,
            owners=owners, slabs=slabs, space=space)
    else:  # host_update of an optimizer that does not stream: all of it at once
        new_master, opt_state, params = update(offload.to_host(grads),
                                               offload.to_host(state["opt_state"]),
                                               offload.to_host(master))
        params = offload.to_device(params)
        opt_state = jax.tree.map(lambda new, old: jax.device_put(
            new, jax.typeof(old).memory_space), opt_state, state["opt_state"])
    new_state = dict(state, step=state["step"] + 1, frozen=frozen, opt_state=opt_state)
    if loss_scale is not None:
        new_state["loss_scale"] = loss_scale.adjust(state["loss_scale"], finite)
    if errors is not None:
        new_state["grad_error"] = errors
    if mixed:
        new_state.update(master=new_master, params=params)
    else:
        new_state["params"] = new_master if params is None else params
    return new_state, metrics
