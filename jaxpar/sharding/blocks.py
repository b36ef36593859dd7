"""A model's repeated blocks: the layers remat wraps, pipeline stages stack and layouts
pin, found by what they are (modules of one class in a list, or one stack of them)."""

from __future__ import annotations

from flax import nnx

from jaxpar.sharding.annotations import logical_names
from jaxpar.sharding.paths import path_str


def stacked_over_layers(module: nnx.Module) -> bool:
    """Whether ``module`` holds its parameters stacked over a leading ``layers`` axis (a
    block scanned with ``nnx.scan``/``nnx.vmap``): some are named ``layers`` first, and
    the rest are unnamed with the same leading size (``nnx.vmap`` names only the
    parameters that had names, a norm's scale often has none)."""
    layers, unnamed = set(), set()
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Param):
            value = var.get_value()
            ndim = getattr(value, "ndim", 0)
            names = logical_names(var, ndim)
            if names and names[0] == "layers":
                layers.add(value.shape[0])
            elif names or not ndim:
                return False
            else:
                unnamed.add(value.shape[0])
    return len(layers) == 1 and unnamed <= layers


def repeated_blocks(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """``(path, module)`` of the model's repeated blocks: modules of one class, two or more
    side by side at integer positions of an ``nnx.List`` or list, or one stack scanned over
    ``layers`` (outermost only: blocks inside a repeated block are not listed). Blocks kept
    under string keys (a dict, or attributes) are not told apart from a layer's distinct
    parts, such as its query and key projections, so they are not counted."""
    graph = [(tuple(p), m) for p, m in nnx.iter_graph(model)
             if isinstance(m, nnx.Module) and p]
    siblings: dict[tuple, list[tuple[tuple, nnx.Module]]] = {}
    for path, module in graph:
        siblings.setdefault((path[:-1], type(module)), []).append((path, module))
    chosen: list[tuple[tuple, nnx.Module]] = []
    for (_, _), group in siblings.items():
        if len(group) >= 2 and all(isinstance(p[-1], int) for p, _ in group):
            chosen += group
    chosen += [(p, m) for p, m in graph if stacked_over_layers(m)]
    chosen.sort(key=lambda pm: len(pm[0]))
    outer: list[tuple[tuple, nnx.Module]] = []
    for path, module in chosen:
        if not any(path[:len(q)] == q for q, _ in outer):
            outer.append((path, module))
    return [(path_str(p), m) for p, m in sorted(outer, key=lambda pm: pm[0])]
