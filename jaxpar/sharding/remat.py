"""Rematerialization policies by name, applied per transformer block.

The reference model tags activations with ``checkpoint_name`` (``layer_input``,
``attention``, ``attention_out``, ``mlp_hidden``, ``mlp_out``); a policy decides which of a block's
intermediates are kept for the backward pass and which are recomputed. Two policies keep
activations in host memory instead: ``offload_dots`` (every matmul output without a batch
dimension) and ``offload:<name>,<name>`` (the named ones; everything else is recomputed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxpar.errors import JaxparError

_CP = jax.checkpoint_policies

POLICIES: dict[str, Any] = {
    "none": None,
    "full": _CP.nothing_saveable,
    "dots_saveable": _CP.dots_saveable,
    "dots_with_no_batch_dims_saveable": _CP.dots_with_no_batch_dims_saveable,
    "save_attention_and_mlp_outputs": _CP.save_only_these_names("attention_out", "mlp_out"),
    "offload_dots": "offload",
}


OFFLOAD = "offload:"
"""Prefix of the policies that save named activations to host memory."""
NAMES = ("attention", "attention_out", "mlp_hidden", "mlp_out", "layer_input")
"""The checkpoint names the reference model (and its mixture-of-experts layer) tags."""
VALID = (f"choose one of {sorted(POLICIES)}, or {OFFLOAD}<names> with names among "
         f"{', '.join(NAMES)} (comma-separated) to save those to host memory")


def offloaded_names(name: str) -> tuple[str, ...]:
    """The activation names an ``offload:<names>`` policy saves to host memory (empty
    for any other policy)."""
    if not name.startswith(OFFLOAD):
        return ()
    return tuple(n.strip() for n in name[len(OFFLOAD):].split(",") if n.strip())


def marked_names(jaxpr: Any) -> set[str]:
    """The activation names ``jax.ad_checkpoint.checkpoint_name`` marks anywhere in
    ``jaxpr`` (a ``ClosedJaxpr`` or ``Jaxpr``, nested ones included): what an
    ``offload:<names>`` policy can find to save."""
    found: set[str] = set()
    stack = [getattr(jaxpr, "jaxpr", jaxpr)]
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive.name == "name":
                found.add(eqn.params["name"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, list | tuple) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        stack.append(inner)
    return found


def is_policy(name: str) -> bool:
    """Whether ``name`` is a remat policy (see :data:`VALID`)."""
    names = offloaded_names(name)
    if name.startswith(OFFLOAD):
        return bool(names) and all(n in NAMES for n in names)
    return name in POLICIES


def check(name: str) -> str:
    """Validate a policy name."""
    if not is_policy(name):
        raise JaxparError(f"unknown remat policy {name!r}: {VALID}")
    return name


def policy(name: str) -> Any:
    """The ``jax.checkpoint`` policy of the named one (None for ``none``)."""
    if name == "offload_dots":
        return _CP.offload_dot_with_no_batch_dims("device", "pinned_host")
    if name.startswith(OFFLOAD):
        return _CP.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(
                offloaded_names(name)), offload_src="device", offload_dst="pinned_host")
    return POLICIES[name]


def never_saving(policy: Any, names: tuple[str, ...]) -> Any:
    """``policy`` (None: save everything) except that activations named ``names``, and the
    transfers that made them (``device_put``), are never saved: the backward pass
    recomputes them."""
    def combined(prim, *args, **params):
        if prim.name == "device_put" or (prim.name == "name" and params.get("name") in names):
            return False
        return True if policy is None else policy(prim, *args, **params)

    return combined


def checkpointed(block_fn: Callable | None, policy: Any, prepare: Callable | None = None
                 ) -> Callable:
    """A ``block_fn(block, x, *args)`` that runs ``block_fn`` (default: call the block)
    under ``jax.checkpoint`` with ``policy``; ``prepare`` first maps the block's state
    inside the checkpoint (so what it makes is recomputed, not saved, unless the policy
    says so)."""
    inner = block_fn or (lambda block, x, *args: block(x, *args))

    def run(block, x, *args):
        from flax import nnx

        graphdef, state = nnx.split(block)

        def call(state, x, *args):
            if prepare is not None:
                state = prepare(state)
            return inner(nnx.merge(graphdef, state), x, *args)

        return jax.checkpoint(call, policy=policy, prevent_cse=False)(state, x, *args)

    return run


def block_wrapper(name: str, *, prepare: Callable | None = None,
                  never_save: tuple[str, ...] = ()) -> Callable | None:
    """A ``block_fn(block, x, *args)`` that runs a block under the named policy, or None
    (no policy, nothing to prepare). ``prepare`` maps the block's state inside the
    checkpoint (host-resident weights brought to the device, see
    :func:`jaxpar.parallel.offload.stream_layer`); activations named ``never_save`` are
    then recomputed whatever the policy."""
    chosen = policy(check(name))
    if prepare is None:
        return None if chosen is None else checkpointed(None, chosen)
    return checkpointed(None, never_saving(chosen, never_save), prepare)
