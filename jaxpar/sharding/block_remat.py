"""Remat policies for models jaxpar did not write.

jaxpar's own transformer runs each layer under the plan's remat policy itself. A model of
yours gets the same by having its repeated blocks wrapped, in place and without editing
its code: :func:`apply_remat` swaps each block's class for a subclass whose ``__call__``
runs the original one under ``nnx.remat`` with the policy (so state the block updates,
dropout counters and batch statistics, still comes out). The blocks are those
:func:`~jaxpar.sharding.blocks.repeated_blocks` finds (modules of one class in an
``nnx.List`` or list, or a stack scanned over ``layers``), or those whose paths match
``plan.remat_blocks``.

Inside a wrapped block the first array argument is named ``layer_input``, so
``offload:layer_input`` keeps each block's input in host memory on any model. The other
names an ``offload:<names>`` policy reads (``attention``, ``attention_out``,
``mlp_hidden``, ``mlp_out``) are the model's to give, as the reference model does::

    from jax.ad_checkpoint import checkpoint_name
    h = checkpoint_name(self.mlp(x), "mlp_out")

``offload_dots`` and the other policies need no names.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.errors import JaxparError
from jaxpar.sharding import remat as remat_lib
from jaxpar.sharding.blocks import repeated_blocks
from jaxpar.sharding.paths import path_str
from jaxpar.sharding.scanned import is_scanned

_WRAPPED = "_jaxpar_remat_base"
"""Class attribute of a wrapped block's class: the class it wraps."""


def _is_array_tree(x: Any) -> bool:
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(v, jax.Array | np.ndarray) for v in leaves)


@functools.cache
def _wrapped_class(cls: type, name: str) -> type:
    """``cls`` with its ``__call__`` under the remat policy ``name`` (one class per pair,
    so sibling blocks keep sharing a class)."""
    policy = remat_lib.policy(name)
    call = cls.__call__

    def __call__(self, *args, **kwargs):
        dynamic = [i for i, a in enumerate(args) if _is_array_tree(a)]

        def run(module, *arrays):
            full = list(args)
            for i, a in zip(dynamic, arrays, strict=True):
                full[i] = a
            if dynamic and isinstance(full[dynamic[0]], jax.Array):
                full[dynamic[0]] = checkpoint_name(full[dynamic[0]], "layer_input")
            return call(module, *full, **kwargs)

        # prevent_cse: blocks called from a Python loop would otherwise have their
        # recomputation merged back into the forward pass by XLA.
        return nnx.remat(run, policy=policy, prevent_cse=True)(
            self, *(args[i] for i in dynamic))

    return type(cls.__name__, (cls,), {"__call__": __call__, _WRAPPED: cls,
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def remat_blocks(model: nnx.Module, pattern: str = "") -> list[tuple[str, nnx.Module]]:
    """``(path, module)`` of the blocks :func:`apply_remat` wraps: the modules whose paths
    ``pattern`` (a regex) matches, outermost only, or by default the model's repeated
    blocks."""
    if not pattern:
        return repeated_blocks(model)
    rx = re.compile(pattern)
    found: list[tuple[str, nnx.Module]] = []
    for path, module in nnx.iter_graph(model):
        text = path_str(tuple(path))
        if (path and isinstance(module, nnx.Module) and rx.search(text)
                and not any(text.startswith(p + "/") for p, _ in found)):
            found.append((text, module))
    return found


def apply_remat(model: nnx.Module, name: str, pattern: str = "") -> list[str]:
    """Run ``model``'s blocks (see :func:`remat_blocks`) under the remat policy ``name``,
    in place; returns their paths (none for the policy ``none``, which unwraps them).

    Raises:
      JaxparError: a policy other than ``none`` and no block to apply it to (one line
        saying what a block is and how to name one).
    """
    policy = remat_lib.policy(remat_lib.check(name))
    blocks = remat_blocks(model, pattern)
    for _, module in blocks:
        if is_scanned(module):  # a scanned stack applies the policy to each iteration
            module._jaxpar_remat = name
            continue
        base = getattr(type(module), _WRAPPED, type(module))
        cls = base if policy is None else _wrapped_class(base, name)
        object.__setattr__(module, "__class__", cls)
    if policy is not None and not blocks:
        where = (f"no module's path matches plan.remat_blocks={pattern!r}" if pattern else
                 "the model has no repeated blocks (modules of one class in an nnx.List or "
                 "list, or a stack scanned over 'layers'); name them with plan.remat_blocks "
                 "(a path regex)")
        raise JaxparError(f"plan.remat={name!r} checkpoints a model's blocks, but {where}")
    return [path for path, _ in blocks] if policy is not None else []
