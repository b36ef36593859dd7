"""Model surgery: reading and replacing modules inside an NNX model by graph path."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jaxpar.errors import JaxparError


def get_child(parent: Any, key: Any) -> Any:
    """One step down a graph path (attribute or item)."""
    key = getattr(key, "key", key)
    if isinstance(key, int) or (isinstance(parent, dict) and key in parent):
        return parent[key]
    return getattr(parent, key)


def set_child(parent: Any, key: Any, value: Any) -> None:
    """Replace one child of a module (attribute or item)."""
    key = getattr(key, "key", key)
    if isinstance(key, int) or isinstance(parent, dict):
        parent[key] = value
    else:
        setattr(parent, key, value)


def replace_module(model: nnx.Module, path: tuple, new: Any) -> None:
    """Put ``new`` at ``path`` inside ``model`` (in place)."""
    if not path:
        raise JaxparError("cannot replace the root module")
    parent = model
    for key in path[:-1]:
        parent = get_child(parent, key)
    set_child(parent, path[-1], new)
