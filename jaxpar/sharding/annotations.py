"""Logical names on variables: read them wherever a model put them, or attach them by path.

A Flax model says how its weights may be split through sharding metadata on each
variable: ``nnx.with_partitioning(init, names)`` stores ``out_sharding``, and models
written against a mesh store a ``PartitionSpec`` there (entries that name mesh axes,
which the rules accept directly). :func:`logical_names` reads either. Most models on the
hub carry none; :func:`annotate` attaches names by path, first matching pattern first::

    jaxpar.annotate(model, [
        (r"embed_tokens/embedding$", ("vocab", "embed")),
        (r"(q|k|v)_proj/kernel$", ("embed", "heads")),   # short: trailing dims unnamed
        (r"o_proj/kernel$", ("heads", "embed")),
        (r"mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
        (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    ])

Names describe the array as it is stored (a leading ``layers`` dimension included, for
layers stacked with ``nnx.vmap``) and may be shorter than it.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.errors import JaxparError, JaxparWarning
from jaxpar.sharding.paths import path_str

_NAME_KEYS = ("out_sharding", "sharding_names", "sharding")

AnnotationRules = Sequence[tuple[str, Sequence[Any] | None]]
"""``(path regex, logical names)`` pairs; names ``None`` (or ``()``) mark a variable as
deliberately unnamed (replicated)."""


class AnnotationWarning(JaxparWarning):
    """An annotation pattern matched nothing, or a large array was left without names."""


def _entry(e: Any) -> str | tuple[str, ...] | None:
    if e is None or isinstance(e, str):
        return e
    return tuple(str(a) for a in e)


def logical_names(variable: nnx.Variable, ndim: int | None = None
                  ) -> tuple[Any, ...] | None:
    """The names a variable was annotated with (a ``PartitionSpec`` becomes a tuple of its
    entries), or None if it has none. An empty annotation (``()``) means "replicated".

    With ``ndim``, names shorter than the array are padded with ``None`` (Flax allows
    ``nnx.with_partitioning(init, ("embed", "heads"))`` on a 3-D kernel).

    Raises:
      JaxparError: with ``ndim``, for more names than dimensions.
    """
    metadata = variable.get_metadata()
    for key in _NAME_KEYS:
        names = metadata.get(key)
        if names is None or not isinstance(names, PartitionSpec | list | tuple):
            continue
        names = tuple(_entry(e) for e in names)
        if ndim is None:
            return names
        if len(names) > ndim:
            raise JaxparError(f"logical names {names} have more entries than the variable's "
                              f"{ndim} dimensions")
        return names + (None,) * (ndim - len(names))
    return None


def pairs(items: Iterable[Any], what: str) -> tuple[tuple[Any, Any], ...]:
    """``[[pattern, names], ...]`` (from YAML or code) checked and made hashable: each
    entry a ``(pattern, names)`` pair, list-valued names (and list entries) as tuples."""
    out = []
    for item in items or ():
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise JaxparError(f"{what} entries must be (pattern, logical names) pairs, "
                              f"got {item!r}")
        pattern, names = item
        if names is not None and not isinstance(names, str):
            names = tuple(tuple(n) if isinstance(n, list) else n for n in names)
        out.append((pattern, names))
    return tuple(out)


def _compile(rules: AnnotationRules) -> list[tuple[re.Pattern, tuple | None]]:
    out = []
    for pattern, names in pairs(rules, "annotation"):
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise JaxparError(f"annotation pattern {pattern!r} is not a valid regex: {e}") from None
        if isinstance(names, str):
            raise JaxparError(f"annotation {pattern!r}: names must be a sequence such as "
                              f"('embed', 'mlp'), got the string {names!r}")
        out.append((rx, tuple(_entry(n) for n in names) if names else ()))
    return out


def variables(model: nnx.Module) -> list[tuple[str, nnx.Variable]]:
    """``(path, variable)`` of every variable in ``model`` (array-valued or not)."""
    return [(path_str(p), v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]


def _size(variable: nnx.Variable) -> int:
    return int(math.prod(getattr(variable.get_value(), "shape", ())))


def annotate(model: nnx.Module, rules: AnnotationRules, *, warn: bool = True) -> nnx.Module:
    """Attach logical names to the variables of ``model`` whose path matches a pattern.

    Patterns are searched (``re.search``) in paths such as ``layers/0/mlp/up_proj/kernel``;
    the first pattern that matches a variable wins, and its names replace any the
    variable had. Works in place on concrete or abstract (``nnx.eval_shape``) models and
    returns ``model``.

    With ``warn``, an :class:`AnnotationWarning` lists patterns that matched no variable
    and large parameters (at least 1% of all parameter elements) left without names.

    Raises:
      JaxparError: for a bad regex, a pair that is not ``(pattern, names)``, or names
        longer than the array they are given to.
    """
    compiled = _compile(rules)
    used = [False] * len(compiled)
    for path, var in variables(model):
        for i, (rx, names) in enumerate(compiled):
            if rx.search(path):
                used[i] = True
                ndim = len(getattr(var.get_value(), "shape", ()))
                if len(names) > ndim:
                    raise JaxparError(f"annotation {rx.pattern!r} gives {path} (rank {ndim}) "
                                      f"{len(names)} names {names}")
                var.set_metadata(out_sharding=_keep_stack_axes(var, names, ndim))
                break
    if warn:
        unused = [rx.pattern for (rx, _), u in zip(compiled, used, strict=True) if not u]
        if unused:
            warnings.warn(f"jaxpar.annotate: patterns matched no variable: {unused}",
                          AnnotationWarning, stacklevel=2)
        left = unnamed_parameters(model)
        if left:
            listing = ", ".join(f"{p} {s}" for p, s in left[:8])
            warnings.warn(f"jaxpar.annotate: large parameters without logical names (they "
                          f"will be replicated): {listing}", AnnotationWarning, stacklevel=2)
    return model


STACK_PREFIXES: tuple[tuple[str, ...], ...] = (("repeat", "stage"), ("layers",))
"""Leading names of a variable that stacks identical layers (scanned, or laid out for
pipeline stages): a rule written for one layer's variable names the dimensions after them."""


def _keep_stack_axes(var: nnx.Variable, names: tuple, ndim: int) -> tuple:
    """``names`` behind the stack axes ``var`` already has, when they name one layer's
    dimensions exactly."""
    current = logical_names(var) or ()
    for prefix in STACK_PREFIXES:
        if tuple(current[:len(prefix)]) == prefix and len(names) + len(prefix) == ndim \
                and tuple(names[:len(prefix)]) != prefix:
            return (*prefix, *names)
    return names


def unnamed_parameters(model: nnx.Module, min_share: float = 0.01
                       ) -> list[tuple[str, tuple[int, ...]]]:
    """``(path, shape)`` of parameters holding at least ``min_share`` of all parameter
    elements that carry no logical names, largest first."""
    params = [(p, v) for p, v in variables(model) if isinstance(v, nnx.Param)]
    total = sum(_size(v) for _, v in params) or 1
    left = [(p, tuple(v.get_value().shape)) for p, v in params
            if logical_names(v) is None and _size(v) >= min_share * total and _size(v) > 1]
    return sorted(left, key=lambda x: -math.prod(x[1]))


