"""Rematerialization policies by name, applied per transformer block.

The reference model tags activations with ``checkpoint_name`` (``attention``,
``attention_out``, ``mlp_hidden``, ``mlp_out``); a policy decides which of a block's
intermediates are kept for the backward pass and which are recomputed.
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


def _offload_policy() -> Any:
    if jax.default_backend() == "cpu":
        raise JaxparError("remat 'offload_dots' needs host-memory offload, which the CPU "
                          "backend lacks; use it on TPU or GPU")
    return _CP.offload_dot_with_no_batch_dims("device", "pinned_host")


def check(name: str) -> str:
    """Validate a policy name."""
    if name not in POLICIES:
        raise JaxparError(f"unknown remat policy {name!r}; choose from {sorted(POLICIES)}")
    return name


def block_wrapper(name: str) -> Callable | None:
    """A ``block_fn(block, x, *args)`` that runs a block under the named policy, or None."""
    policy = POLICIES[check(name)]
    if policy is None:
        return None
    if policy == "offload":
        policy = _offload_policy()

    def run(block, x, *args):
        from flax import nnx

        graphdef, state = nnx.split(block)

        def call(state, x, *args):
            return nnx.merge(graphdef, state)(x, *args)

        return jax.checkpoint(call, policy=policy, prevent_cse=False)(state, x, *args)

    return run
