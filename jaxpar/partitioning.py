"""Placing Flax models on the mesh: read logical names from variables, build shardings,
and create models directly into sharded device arrays.

Logical names come from Flax's own partitioning metadata: ``nnx.with_partitioning(init,
names)`` for NNX models (stored as the variable's ``out_sharding`` metadata) and
``nn.with_logical_partitioning`` for linen (``LogicallyPartitioned`` boxes). Stacked
layers created with ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})``
carry the extra leading name too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx
from flax.core import meta as linen_meta
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.plan import Plan

M = TypeVar("M", bound=nnx.Module)

_NAME_KEYS = ("out_sharding", "sharding_names", "sharding")


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical names a variable was annotated with, or None if it has none."""
    metadata = variable.get_metadata()
    for key in _NAME_KEYS:
        names = metadata.get(key)
        if names:
            return tuple(names)
    return None


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


def variable_spec(plan: Plan, variable: nnx.Variable, path: str = "") -> PartitionSpec:
    """PartitionSpec of one variable under the plan's parameter rules.

    A variable without logical names (and scalars) is replicated.
    """
    names = logical_names(variable)
    shape = variable.get_value().shape
    if names is None or not shape:
        return PartitionSpec()
    return plan.param_spec(names, shape=shape, path=path)


def state_shardings(plan: Plan, state: nnx.State) -> nnx.State:
    """A tree like ``state`` whose leaves are the NamedShardings the parameter rules give.

    ``state`` may hold concrete arrays or ``jax.ShapeDtypeStruct``s (from ``nnx.eval_shape``).
    """
    def one(path, variable):
        spec = variable_spec(plan, variable, path_str(path))
        return variable.replace(NamedSharding(plan.mesh, spec))

    return jax.tree_util.tree_map_with_path(
        one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def init_sharded(model_factory: Callable[[], M], plan: Plan) -> M:
    """Create a model straight into sharded device arrays.

    ``model_factory`` builds the model (e.g. ``lambda: Transformer(cfg, rngs=nnx.Rngs(0))``).
    Its shapes are found by abstract evaluation, then it runs once under ``jax.jit`` with
    the parameter shardings as ``out_shardings``, so no device or host ever holds a full
    copy of a sharded weight.
    """
    with plan.activate():
        abstract = nnx.eval_shape(model_factory)
        graphdef, abstract_state = nnx.split(abstract)
        shardings = state_shardings(plan, abstract_state)

        build = jax.jit(lambda: nnx.state(model_factory()), out_shardings=shardings)
        state = build()
    return nnx.merge(graphdef, state)


def linen_shardings(plan: Plan, boxed: Any) -> Any:
    """NamedShardings for a linen variable tree whose leaves are ``LogicallyPartitioned``.

    Use it as ``out_shardings`` when initialising a linen model under ``jax.jit``:
    ``jax.jit(model.init, out_shardings=linen_shardings(plan, jax.eval_shape(model.init,
    ...)))``; unannotated leaves are replicated.
    """
    def one(path, leaf):
        if isinstance(leaf, linen_meta.Partitioned):
            names = tuple(leaf.names)
            spec = plan.param_spec(names, shape=leaf.value.shape, path=path_str(path))
            return leaf.replace_boxed(NamedSharding(plan.mesh, spec))
        return plan.replicated

    return jax.tree_util.tree_map_with_path(
        one, boxed, is_leaf=lambda x: isinstance(x, linen_meta.Partitioned)
    )


def param_table(plan: Plan, state: nnx.State) -> list[dict[str, Any]]:
    """One row per variable: path, shape, dtype, logical names, PartitionSpec, bytes per device."""
    rows = []
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        spec = variable_spec(plan, variable, path_str(path))
        shard = NamedSharding(plan.mesh, spec).shard_shape(value.shape)
        n = 1
        for d in shard:
            n *= d
        rows.append({
            "path": path_str(path),
            "shape": tuple(value.shape),
            "dtype": str(value.dtype),
            "logical_axes": logical_names(variable),
            "spec": spec,
            "shard_shape": tuple(shard),
            "bytes_per_device": n * value.dtype.itemsize,
        })
    return rows
