"""Which parameters train: the filter every run passes to the Trainer, from
``train.trainable`` (``lora``, ``all`` or a path regex).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.sharding.paths import path_str


def path_filter(pattern: str) -> Callable[[tuple, Any], bool]:
    """An nnx filter selecting ``nnx.Param``s (adapters included) whose path matches."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise JaxparError(f"train.trainable target={pattern!r}: is not a valid regular "
                          f"expression ({e})") from None

    def select(path: tuple, value: Any) -> bool:
        return isinstance(value, nnx.Param) and rx.search(path_str(path)) is not None

    return select


def trainable_filter(spec: str | None = None, *, lora: bool = False) -> Any:
    """Turn a config string into an nnx filter for ``Trainer(..., trainable=...)``.

    ``"lora"``: the adapters (``nnx.LoRAParam``). ``"all"``: every ``nnx.Param`` (adapters
    included; an int8 base is never trainable). Anything else is a regex over parameter
    paths (``blocks/attn/wq/lora_a``, ``final_norm/scale``). ``None``/``""``/``"auto"``
    means ``"lora"`` when LoRA is on, else ``"all"``.
    """
    spec = (spec or "auto").strip()
    if spec == "auto":
        spec = "lora" if lora else "all"
    if spec == "lora":
        return nnx.LoRAParam
    if spec == "all":
        return nnx.Param
    return path_filter(spec)


def select_trainable(model: nnx.Module, spec: str | None = None) -> Any:
    """:func:`trainable_filter` for ``model`` (LoRA counts as on if it has adapters, i.e.
    any ``nnx.LoRAParam``), checked: a filter that selects no parameter is an error listing
    the parameter paths."""
    filt = trainable_filter(spec, lora=bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam))))
    if not jax.tree.leaves(nnx.state(model, filt)):
        paths = [path_str(p) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
        raise JaxparError(f"train.trainable={spec!r} selects no parameter; parameters: {paths}")
    return filt


def count_params(model: nnx.Module, filt: Any = nnx.Param) -> int:
    """Number of elements in the variables ``filt`` selects (works on abstract models)."""
    return sum(int(math.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, filt)))
