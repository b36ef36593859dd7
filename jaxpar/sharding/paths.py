"""Paths inside a model or a pytree as text: ``layers/mlp/w_up``, what annotations, rules,
reports and checkpoints match and print."""

from __future__ import annotations

from typing import Any


def key_str(key: Any) -> str:
    """One path entry as text: an NNX path's name or index, or a JAX key path's dict key,
    sequence index or attribute name."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: tuple) -> str:
    """``('layers', 'mlp', 'w_up')`` (or the JAX key path of the same) -> ``'layers/mlp/w_up'``."""
    return "/".join(key_str(p) for p in path)
