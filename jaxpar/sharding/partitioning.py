"""Placing Flax models on the mesh: read logical names from variables, build shardings,
and create models directly into sharded device arrays.

Logical names come from Flax's own partitioning metadata: ``nnx.with_partitioning(init,
names)`` for NNX models (stored as the variable's ``out_sharding`` metadata) and
``nn.with_logical_partitioning`` for linen (``LogicallyPartitioned`` boxes). Stacked
layers created with ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})``
carry the extra leading name too.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx
from flax.core import meta as linen_meta
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import JaxparError, JaxparWarning
from jaxpar.sharding.annotations import annotate, logical_names
from jaxpar.sharding.block_remat import apply_remat
from jaxpar.sharding.layouts import AUTO, auto_layouts, constrain_outputs
from jaxpar.sharding.mesh import is_explicit
from jaxpar.sharding.paths import path_str
from jaxpar.sharding.plan import Plan
from jaxpar.sharding.scanned import block_lists, scan_model_blocks

M = TypeVar("M", bound=nnx.Module)

__all__ = ["HeadSplitWarning", "ReplicationWarning", "abstract_sharded", "init_sharded",
           "is_abstract", "linen_shardings",
           "logical_names", "mostly_replicated", "param_table", "prepare_model",
           "replication_report", "split_heads", "state_shardings", "variable_spec",
           "warn_if_heads_split", "warn_if_replicated"]


class ReplicationWarning(JaxparWarning):
    """Most parameter bytes are replicated although the plan could shard them."""


def variable_spec(plan: Plan, variable: nnx.Variable, path: str = "") -> PartitionSpec:
    """PartitionSpec of one variable under the plan's parameter rules.

    A variable without logical names (and scalars) is replicated. Names may be shorter
    than the array, and may name mesh axes directly.
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


def prepare_model(model: M, plan: Plan) -> M:
    """Apply the plan's ``annotations`` (logical names by path), ``layouts`` (pinned
    module outputs) and, to a model jaxpar did not write, its ``remat`` policy (see
    :mod:`jaxpar.sharding.block_remat`) to ``model``, in place; returns it."""
    if plan.annotations:
        annotate(model, plan.annotations, warn=False)
    if plan.layouts and not (plan.layouts == AUTO and is_explicit(plan.mesh)):
        # (a model written for explicit sharding types its activations itself)
        layouts = auto_layouts(model) if plan.layouts == AUTO else plan.layouts
        if layouts:
            constrain_outputs(model, layouts)
    module = type(model).__module__
    if module == "jaxpar.models.linen":
        if plan.remat != "none":
            raise JaxparError(f"plan.remat={plan.remat!r} cannot reach inside a linen model: "
                              "wrap its blocks in flax.linen.remat (nn.remat) in the model's "
                              "code, with the policy you want")
    elif not module.startswith("jaxpar."):  # jaxpar's own models scan and remat themselves
        mode = {True: "true", False: "false"}.get(plan.scan_blocks, plan.scan_blocks)
        if plan.remat_blocks and mode == "auto":  # blocks chosen by path stay apart
            mode = "false"
        scan_model_blocks(model, block_lists(model), mode, plan.remat)
        apply_remat(model, plan.remat, plan.remat_blocks)
    return model


def init_sharded(model_factory: Callable[[], M], plan: Plan) -> M:
    """Create a model straight into sharded device arrays.

    ``model_factory`` builds the model (e.g. ``lambda: Transformer(cfg, rngs=nnx.Rngs(0))``).
    Its shapes are found by abstract evaluation, then it runs once under ``jax.jit`` with
    the parameter shardings as ``out_shardings``, so no device or host ever holds a full
    copy of a sharded weight. The plan's ``annotations`` and ``layouts`` are applied to
    the model first; if the plan could shard parameters but most of their bytes stay
    replicated, a :class:`ReplicationWarning` says which and how to fix it.
    """
    build_model = lambda: prepare_model(model_factory(), plan)
    with plan.activate():
        abstract = nnx.eval_shape(build_model)
        graphdef, abstract_state = nnx.split(abstract)
        shardings = state_shardings(plan, abstract_state)
    with plan.activate(mesh_context=True):
        build = jax.jit(lambda: nnx.state(build_model()), out_shardings=shardings)
        state = build()
    model = nnx.merge(graphdef, state)
    warn_if_replicated(plan, abstract_state)
    return model


def abstract_sharded(model_factory: Callable[[], M], plan: Plan) -> M:
    """The model :func:`init_sharded` would create, with no memory behind it.

    Every variable holds a ``jax.ShapeDtypeStruct`` carrying the sharding the plan gives
    it, so the model (and a :class:`~jaxpar.Trainer` built from it) can be lowered and
    compiled for devices that are not attached to this machine, such as the devices of a
    TPU topology description (:mod:`jaxpar.analysis.targets`). The factory runs only
    under abstract evaluation: nothing is computed or allocated.
    """
    build_model = lambda: prepare_model(model_factory(), plan)
    with plan.activate():
        abstract = nnx.eval_shape(build_model)
        graphdef, abstract_state = nnx.split(abstract)
        shardings = state_shardings(plan, abstract_state)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         abstract_state, shardings)
    warn_if_replicated(plan, abstract_state)
    return nnx.merge(graphdef, state)


def is_abstract(tree: Any) -> bool:
    """Whether ``tree`` (a model, a state) holds shapes only (``jax.ShapeDtypeStruct``s)."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def replication_report(plan: Plan, state: nnx.State, *, top: int = 5) -> dict[str, Any]:
    """How much of the parameter bytes the plan's parameter rules leave replicated.

    Returns ``{"replicated_share", "replicated_bytes", "total_bytes", "largest",
    "largest_share"}``, with ``largest`` the ``top`` biggest replicated parameters as
    ``(path, shape)``, ``largest_share`` the biggest one's share of all parameter bytes, and
    ``"could_shard"``: whether some rule targets a mesh axis of size > 1 (under the ``dp``
    preset nothing is meant to be sharded).
    """
    total = replicated = 0
    largest: list[tuple[int, str, tuple[int, ...]]] = []
    for path, variable in nnx.to_flat_state(state):
        if not isinstance(variable, nnx.Param):
            continue
        value = variable.get_value()
        shape = tuple(getattr(value, "shape", ()))
        nbytes = math.prod(shape) * getattr(getattr(value, "dtype", None), "itemsize", 4)
        total += nbytes
        if all(e is None for e in variable_spec(plan, variable, path_str(path))):
            replicated += nbytes
            names = logical_names(variable) or ()
            layers = shape[0] if names and names[0] == "layers" else 1  # judged per layer
            largest.append((nbytes // layers, path_str(path), shape))
    largest.sort(key=lambda x: -x[0])
    targets = {a for _, t in plan.param_rules.rules for a in t}
    return {
        "replicated_share": replicated / total if total else 0.0,
        "replicated_bytes": replicated,
        "total_bytes": total,
        "largest": [(p, s) for _, p, s in largest[:top]],
        "largest_share": largest[0][0] / total if largest and total else 0.0,  # one layer
        "could_shard": any(plan.mesh.shape.get(a, 1) > 1 for a in targets),
    }


_WARNED: set[tuple] = set()
REPLICATED_WARN_SHARE = 0.5
"""Warn when more than this share of parameter bytes is replicated under a sharding plan."""
REPLICATED_ARRAY_SHARE = 0.05
"""... or when one replicated parameter holds more than this share of them (a tied
embedding left unnamed, say), whatever the total."""


def mostly_replicated(report: dict[str, Any]) -> bool:
    """Whether a :func:`replication_report` shows a plan that could shard parameters leaving
    more than :data:`REPLICATED_WARN_SHARE` of their bytes replicated, or one replicated
    array over :data:`REPLICATED_ARRAY_SHARE` of them."""
    return report["could_shard"] and (
        report["replicated_share"] > REPLICATED_WARN_SHARE
        or report.get("largest_share", 0.0) > REPLICATED_ARRAY_SHARE)


def warn_if_replicated(plan: Plan, state: nnx.State) -> dict[str, Any]:
    """Warn once (per mesh and set of arrays) when a plan that could shard parameters leaves
    most of their bytes, or one large array, replicated: the usual sign of a model (or a
    weight) without logical names."""
    report = replication_report(plan, state)
    if mostly_replicated(report):
        key = (tuple(plan.mesh.shape.items()), tuple(p for p, _ in report["largest"]))
        if key not in _WARNED:
            _WARNED.add(key)
            arrays = ", ".join(f"{p} {s}" for p, s in report["largest"])
            warnings.warn(
                f"jaxpar: {100 * report['replicated_share']:.0f}% of parameter bytes are "
                f"replicated on mesh {dict(plan.mesh.shape)} although the plan shards "
                f"weights; largest: {arrays}. Give them logical names with "
                "jaxpar.annotate(model, [(path_regex, names), ...]) or plan.annotations.",
                ReplicationWarning, stacklevel=3)
    return report


class HeadSplitWarning(JaxparWarning):
    """A fused heads dimension is split across devices inside a head."""


HEAD_COUNTS = {"heads": ("num_attention_heads", "n_heads", "num_heads"),
               "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads")}
"""Where a model's ``config`` keeps the head counts, per logical name."""


def split_heads(plan: Plan, model: nnx.Module) -> list[tuple[str, str, int, int]]:
    """Parameters whose ``heads``/``kv_heads`` dimension fuses several heads
    (``heads x head_dim`` in one axis) and is split over more devices than it has heads,
    or over a count that does not divide them, so a device holds part of a head: ``(path,
    name, heads, ways)``. The head counts come from ``model.config`` (:data:`HEAD_COUNTS`);
    without them nothing is reported. A dimension that holds one entry per head is
    judged by the rules' own divisibility check instead."""
    config = getattr(model, "config", None)
    counts = {name: next((v for k in keys if isinstance(v := getattr(config, k, None), int)),
                         None) for name, keys in HEAD_COUNTS.items()}
    counts["kv_heads"] = counts["kv_heads"] or counts["heads"]
    if not any(counts.values()):
        return []
    found = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = logical_names(variable)
        if not names:
            continue
        spec = variable_spec(plan, variable, path_str(path))
        shape = variable.get_value().shape
        for dim, name in enumerate(names):
            heads = counts.get(name) if isinstance(name, str) else None
            if not heads or dim >= len(spec) or shape[dim] == heads or shape[dim] % heads:
                continue
            axes = spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],)
            ways = math.prod(plan.mesh.shape[a] for a in axes if a is not None)
            if ways > 1 and heads % ways:
                found.append((path_str(path), name, heads, ways))
    return found


def warn_if_heads_split(plan: Plan, model: nnx.Module) -> None:
    """Warn, naming the parameters, when :func:`split_heads` finds any."""
    found = split_heads(plan, model)
    if found:
        path, name, heads, ways = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        warnings.warn(
            f"jaxpar: {path}{more}: its {name} dimension fuses {heads} heads and is split "
            f"{ways} ways, so a device holds part of a head (attention then needs extra "
            f"communication); use a mesh axis of a size that divides {heads} for {name}, "
            f"or give the heads their own dimension", HeadSplitWarning, stacklevel=3)


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
