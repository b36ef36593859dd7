"""Activation layouts for models without ``constrain`` calls inside.

GSPMD propagates shardings from the weights and the batch, and between them it guesses.
In a model written without sharding in mind the guesses can be poor: an FSDP step of such
a model was seen to hold all-to-alls and twice the temporaries of the same model with
its block outputs pinned. :func:`constrain_outputs` pins the outputs of chosen modules
(every decoder layer, say) to logical names resolved by the active plan's activation
rules, without editing the model::

    jaxpar.constrain_outputs(model, [(DecoderLayer, ("batch", "seq", "embed")),
                                     (r"lm_head$", ("batch", "seq", "vocab"))])

Modules are matched by type (a class, or ``"type:ClassName"``) or by a regex searched in
their path. A matched module keeps its class's behaviour, attributes and path; only its
class is swapped for a subclass whose ``__call__`` constrains the result (array leaves of
rank at least the number of names; trailing dimensions unnamed). Outside an active plan
the constraint does nothing, so the model still runs on one device as before.

A regex that matches a *variable's* path (``r"embed_tokens/embedding$"``) pins that weight's
compute layout instead: while its module runs, the weight is constrained to its names
under the activation rules, as jaxpar's own embedding does, so FSDP gathers the table
whole before a lookup rather than exchanging the looked-up rows with all-to-alls.

Without layouts of its own, a plan pins by default (``layouts="auto"``, see
:func:`auto_layouts`): the outputs of a model's repeated blocks (modules of one class in
an ``nnx.List`` or list, or a stack scanned over a ``layers`` axis) and the tables of
its annotated ``nnx.Embed`` layers, which is what a user would write by hand for a
transformer. ``layouts=()`` (``layouts: []`` in YAML) turns that off.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.sharding.annotations import logical_names, pairs
from jaxpar.sharding.blocks import repeated_blocks
from jaxpar.sharding.paths import path_str
from jaxpar.sharding.plan import constrain
from jaxpar.sharding.scanned import layer_class, set_layer_class

LayoutRules = Sequence[tuple[Any, Sequence[Any]]]
"""``(module type, "type:ClassName" or path regex, logical names)`` pairs."""

_BASE = "_jaxpar_unpinned_class"

AUTO = "auto"
"""``Plan.layouts`` value asking for :func:`auto_layouts` (the default)."""

BLOCK_OUTPUT = ("<block output>",)
"""Names of a repeated block's output: ``("batch", "seq", "embed")`` for a 3-D array (a
sequence of vectors), ``("batch",)`` for the rest (an image batch, pooled vectors)."""


def _constrain_leaf(x: Any, names: tuple) -> Any:
    if names == BLOCK_OUTPUT and isinstance(x, jax.Array):
        names = ("batch", "seq", "embed") if x.ndim == 3 else ("batch",)
    if not isinstance(x, jax.Array) or x.ndim < len(names):
        return x
    return constrain(x, names)  # the rules leave trailing dimensions unnamed


@functools.cache
def _pinned_class(cls: type, names: tuple | None, weights: tuple = ()) -> type:
    """A subclass of ``cls`` whose ``__call__`` pins its outputs to ``names`` (if any) and
    the weights named in ``weights`` (``(attribute, names)`` pairs) while it runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        saved = []
        for attr, w_names in weights:
            var = getattr(self, attr)
            value = var.get_value()
            saved.append((var, value))
            var.set_value(_constrain_leaf(value, w_names))
        try:
            out = cls.__call__(self, *args, **kwargs)
        finally:
            for var, value in saved:
                var.set_value(value)
        if names is None:
            return out
        return jax.tree.map(lambda x: _constrain_leaf(x, names), out)

    return type(cls.__name__, (cls,), {
        "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__, _BASE: cls, "_jaxpar_output_names": names,
        "_jaxpar_weight_names": weights,
    })


def _matcher(target: Any) -> Any:
    if isinstance(target, type):
        return lambda path, m: isinstance(m, target)
    if not isinstance(target, str):
        raise JaxparError(f"layout target {target!r} must be a module class, 'type:Name' or a "
                          "path regex")
    if target.startswith("type:"):
        name = target[5:]
        return lambda path, m: any(c.__name__ == name for c in type(m).__mro__)
    try:
        rx = re.compile(target)
    except re.error as e:
        raise JaxparError(f"layout pattern {target!r} is not a valid regex: {e}") from None
    return lambda path, m: rx.search(path) is not None


def constrain_outputs(model: nnx.Module, layouts: LayoutRules) -> nnx.Module:
    """Pin the outputs of the modules of ``model`` that each target matches (in place).

    The first target that matches a module decides its names. Returns ``model``.

    Raises:
      JaxparError: for a target that matches no module (the message lists module types),
        or a bad regex.
    """
    rules = [(target, _matcher(target), tuple(names))
             for target, names in pairs(layouts, "layout")]
    used = [False] * len(rules)
    graph = [(tuple(p), node) for p, node in nnx.iter_graph(model)]
    modules = [(path_str(p), m) for p, m in graph if isinstance(m, nnx.Module)]
    pins: dict[int, tuple[nnx.Module, tuple | None, dict[str, tuple]]] = {}
    owners = {p: m for p, m in graph if isinstance(m, nnx.Module)}
    for path, node in graph:
        if not path or not isinstance(node, nnx.Variable):
            continue
        for i, (target, match, names) in enumerate(rules):
            if isinstance(target, str) and not target.startswith("type:") and match(
                    path_str(path), node):
                owner = owners.get(path[:-1])
                if owner is None or not isinstance(path[-1], str):
                    raise JaxparError(f"layout {target!r} matches {path_str(path)}, which is "
                                      "not an attribute of a module")
                used[i] = True
                pins.setdefault(id(owner), (owner, None, {}))[2][path[-1]] = names
                break
    for path, module in modules:
        for i, (_, match, names) in enumerate(rules):
            if match(path, module):
                used[i] = True
                entry = pins.setdefault(id(module), (module, None, {}))
                pins[id(module)] = (module, names, entry[2])
                break
    for module, names, weights in pins.values():
        current = layer_class(module)  # a scanned stack pins each of its layers
        base = getattr(current, _BASE, current)
        set_layer_class(module, _pinned_class(base, names, tuple(sorted(weights.items()))))
    missing = [target for (target, _, _), u in zip(rules, used, strict=True) if not u]
    if missing:
        kinds = sorted({type(m).__name__ for _, m in modules})
        raise JaxparError(f"layout target {missing[0]!r} matches no module; module types: "
                          f"{kinds}")
    return model


def pinned(model: nnx.Module) -> list[tuple[str, tuple | None, tuple]]:
    """``(path, output names, ((weight, names), ...))`` of every pinned module."""
    return [(path_str(p), type(m)._jaxpar_output_names, type(m)._jaxpar_weight_names)
            for p, m in nnx.iter_graph(model)
            if isinstance(m, nnx.Module) and hasattr(type(m), _BASE)]


def auto_layouts(model: nnx.Module) -> list[tuple[str, tuple]]:
    """The layouts :data:`AUTO` applies to ``model``: each repeated block's output
    (:data:`BLOCK_OUTPUT`) and each annotated ``nnx.Embed`` table (its own names, so FSDP
    gathers the table for the lookup). Models of jaxpar's own, which place their
    activations themselves, get none."""
    if type(model).__module__.startswith("jaxpar."):
        return []
    out: list[tuple[str, tuple]] = [(f"^{re.escape(path)}$", BLOCK_OUTPUT)
                                    for path, _ in repeated_blocks(model)]
    for path, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Embed):
            table = module.embedding
            names = logical_names(table, table.get_value().ndim)
            if names and any(n is not None for n in names):
                out.append((f"^{re.escape(path_str(tuple(path) + ('embedding',)))}$", names))
    return out
