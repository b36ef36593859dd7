"""A model of yours written out under its own parameter names.

jaxpar's decoder has a Hugging Face layout (:mod:`jaxpar.hf.convert`); a model built by a
``model.factory`` has none that jaxpar could know. Its weights are written as the model
was written: blocks in their list (a scanned or staged run unstacked first), each
variable under its own path, dot-joined as PyTorch and Flax checkpoints name them
(``layers.0.self_attn.q_proj.kernel``), in one ``model.safetensors``. :func:`load_own_weights`
reads such a file back into the model as written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxpar.errors import JaxparError
from jaxpar.sharding.paths import path_str
from jaxpar.sharding.scanned import unscan_blocks

FILE = "model.safetensors"


def own_names(model: nnx.Module) -> dict[str, nnx.Variable]:
    """``{dotted path: variable}`` of the model's parameters, blocks in their list."""
    return {path_str(tuple(p)).replace("/", "."): v
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def save_own_weights(model: nnx.Module, folder: str | Path, *, dtype: Any = None) -> Path:
    """Write ``model``'s parameters (its stacks unscanned, in place) to
    ``folder/model.safetensors`` under their own names; returns the file."""
    unscan_blocks(model)
    tensors = {}
    for name, variable in own_names(model).items():
        value = np.asarray(jax.device_get(variable.get_value()))
        tensors[name] = value.astype(dtype) if dtype is not None else value
    path = Path(folder) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "jaxpar-own"})
    return path


def load_own_weights(model: nnx.Module, path: str | Path) -> nnx.Module:
    """Overwrite ``model``'s parameters (the model as written: blocks in a list) with those
    of a file :func:`save_own_weights` wrote; returns ``model``.

    Raises:
      JaxparError: naming the parameters missing from the file or shaped otherwise.
    """
    tensors = load_file(str(path))
    wanted = own_names(model)
    missing = sorted(set(wanted) - set(tensors))
    wrong = sorted(k for k in set(wanted) & set(tensors)
                   if tuple(tensors[k].shape) != tuple(wanted[k].get_value().shape))
    if missing or wrong:
        raise JaxparError(f"{path}: does not hold this model's parameters: "
                          f"missing {missing[:5]}, shaped otherwise {wrong[:5]}")
    for name, variable in wanted.items():
        variable.set_value(jax.numpy.asarray(tensors[name], variable.get_value().dtype))
    return model
