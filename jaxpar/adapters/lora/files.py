"""Adapters saved and restored alone, as an orbax checkpoint of the ``nnx.LoRAParam`` state.
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from jaxpar.errors import JaxparError

# --- checkpoints --------------------------------------------------------------------------


def lora_state(model: nnx.Module) -> nnx.State:
    """The adapters alone (an ``nnx.State`` of ``nnx.LoRAParam``)."""
    return nnx.state(model, nnx.LoRAParam)


def save_adapters(model: nnx.Module, path: str | Path) -> Path:
    """Write the adapters alone to an orbax checkpoint at ``path`` (must not exist)."""
    import orbax.checkpoint as ocp

    state = lora_state(model)
    if not jax.tree.leaves(state):
        raise JaxparError("model has no LoRA adapters to save")
    path = Path(path).absolute()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, nnx.to_pure_dict(state))
    ckptr.wait_until_finished()
    return path


def load_adapters(model: nnx.Module, path: str | Path) -> nnx.Module:
    """Restore adapters saved by :func:`save_adapters` into ``model`` (in place).

    ``model`` must already have adapters of the same paths and shapes (apply LoRA with the
    same target and rank first); each restored array keeps the sharding of the one it
    replaces.
    """
    import orbax.checkpoint as ocp

    state = lora_state(model)
    if not jax.tree.leaves(state):
        raise JaxparError("model has no LoRA adapters to load into; call jaxpar.lora.apply first")
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        nnx.to_pure_dict(state))
    path = Path(path).absolute()
    try:
        restored = ocp.StandardCheckpointer().restore(path, target)
    except Exception as e:  # orbax raises many types; report them as one user error
        raise JaxparError(f"cannot load LoRA adapters from {path}: {e}") from e
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    return model
