"""Putting adapters into a model and taking them out: :func:`apply` wraps the matching
projections, :func:`place` shards new adapters, :func:`merge` folds them into the base.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.adapters import quant, surgery
from jaxpar.adapters.lora.layers import (
    DEFAULT_TARGET,
    LoraConfig,
    LoraDropoutCount,
    LoraProjection,
    _check_args,
)
from jaxpar.errors import JaxparError
from jaxpar.models.linen import LinenModel
from jaxpar.sharding.partitioning import state_shardings
from jaxpar.sharding.paths import path_str
from jaxpar.sharding.plan import Plan, current_plan

# --- applying, finding, merging -----------------------------------------------------------


def adapted(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """``(path, module)`` of every adapter in ``model``: each :class:`LoraProjection`, and
    a linen model's adapters by their linen path (:mod:`jaxpar.models.linen`)."""
    found = [(path_str(p), m) for p, m in nnx.iter_graph(model)
             if isinstance(m, LoraProjection)]
    if isinstance(model, LinenModel):
        found += [(f"linen/{p}", m) for p, m in model.adapters.items()]
    return found


def _shown(path: tuple) -> str:
    return path_str(path) or "<root>"


def _scan(model: nnx.Module) -> tuple[list[tuple[tuple, nnx.Module]],
                                      list[tuple[tuple, nnx.Module]]]:
    """``(adaptable, others)``: the projections not yet adapted, and every other module
    that holds an ``nnx.Param`` itself (through plain attributes, lists or dicts, not
    through a child module). Adapters and what they wrap are in neither list."""
    nodes = [(tuple(p), n) for p, n in nnx.iter_graph(model)]
    modules = {p: n for p, n in nodes if isinstance(n, nnx.Module)}
    wrapped = [p for p, m in modules.items() if isinstance(m, LoraProjection)]

    def inside(path: tuple) -> bool:
        return any(path[:len(w)] == w for w in wrapped)

    owners = set()
    for path, node in nodes:
        if isinstance(node, nnx.Param) and not inside(path):
            owners.add(next((path[:k] for k in range(len(path) - 1, -1, -1)
                             if path[:k] in modules), None))
    adaptable = [(p, m) for p, m in modules.items()
                 if isinstance(m, quant.ADAPTABLE_TYPES) and not inside(p)]
    others = [(p, m) for p, m in modules.items()
              if p in owners and not isinstance(m, quant.ADAPTABLE_TYPES)]
    return adaptable, others


def apply(
    model: nnx.Module,
    target: str = DEFAULT_TARGET,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    *,
    rngs: nnx.Rngs | int = 0,
    base_dtype: str = "float32",
    plan: Plan | None = None,
) -> nnx.Module:
    """Add LoRA adapters to every projection of ``model`` whose path matches ``target``.

    Works in place and returns ``model``. Usable on a concrete (already sharded) model or
    inside a factory given to :func:`jaxpar.init_sharded`, so adapters are born sharded.

    Args:
      model: any Flax NNX model with ``nnx.Linear``/``nnx.LinearGeneral``/``nnx.Einsum``
        projections.
      target: regex searched (``re.search``) in module paths like ``blocks/attn/wq``.
        Container modules it matches (those holding no parameter themselves, such as an
        ``nnx.MultiHeadAttention`` at ``attn``) are passed over; their projections are
        matched by their own paths.
      rank: adapter rank ``r``.
      alpha: the update is scaled by ``alpha / rank``.
      dropout: dropout rate on the adapter input (0 disables it).
      rngs: seed or ``nnx.Rngs`` for ``A``'s initialisation (and the dropout stream).
      base_dtype: store the frozen base as ``float32``, ``bfloat16`` or ``int8``
        (see :func:`jaxpar.adapters.quant.convert_frozen`).
      plan: place the new variables by this plan's rules (default: the active plan, if
        any; skipped while tracing).

    Raises:
      JaxparError: if ``target`` matches no projection (the message lists them all), if
        it matches a module that holds parameters but cannot be adapted (``nnx.Conv``,
        ``nnx.Embed``, a norm; the message lists those and the adaptable paths), or for a
        bad rank, dropout, regex or base_dtype; the model is left unchanged.
    """
    pattern = _check_args(target, rank, dropout)
    if isinstance(model, LinenModel):  # linen projections, adapted by interception
        if dropout or base_dtype != "float32":
            raise JaxparError("LoRA on a linen model takes no dropout or base_dtype (its "
                              "adapters are added to the linen layers' outputs as they run)")
        key = rngs.params() if isinstance(rngs, nnx.Rngs) else jax.random.key(rngs)
        model.add_adapters(target, rank, alpha, key)
        return place(model, plan)
    if base_dtype not in quant.BASE_DTYPES:
        raise JaxparError(f"unknown base_dtype {base_dtype!r}; choose one of "
                          f"{quant.BASE_DTYPES}")
    candidates, others = _scan(model)
    chosen = [(p, m) for p, m in candidates if pattern.search(path_str(p))]
    available = [_shown(p) for p, _ in candidates]
    bad = [f"{_shown(p)} ({type(m).__module__}.{type(m).__qualname__})"
           for p, m in others if pattern.search(path_str(p))]
    if bad:
        raise JaxparError(
            f"LoRA target {target!r} matches modules that hold parameters but are not "
            f"projections LoRA can adapt (nnx.Linear, nnx.LinearGeneral, nnx.Einsum): "
            f"{', '.join(bad)}; "
            + ("narrow the regex (e.g. anchor it with '$')" if not target.endswith("$")
               else "leave them out of the regex")
            + f". Adaptable paths: {available}"
        )
    if not chosen:
        done = [p for p, _ in adapted(model)]
        raise JaxparError(
            f"LoRA target {target!r} matches no projection; available paths: {available}"
            + (f"; already adapted: {done}" if done else "")
        )
    if any(not p for p, _ in chosen):
        raise JaxparError("cannot adapt the root module itself; wrap it in a parent module")
    wrappers = []  # all built before the model changes, so a layer that fails leaves it intact
    for i, (_, module) in enumerate(chosen):
        if isinstance(rngs, nnx.Rngs):
            key = rngs.params()
        else:
            key = jax.random.fold_in(jax.random.key(rngs), i)
        wrappers.append(LoraProjection(module, rank=rank, alpha=alpha, dropout=dropout,
                                       key=key))
    for (path, _), wrapper in zip(chosen, wrappers, strict=True):
        surgery.replace_module(model, path, wrapper)
    quant.convert_frozen(model, base_dtype)
    return place(model, plan)


def apply_config(model: nnx.Module, config: LoraConfig, *, rngs: nnx.Rngs | int = 0,
                 plan: Plan | None = None) -> nnx.Module:
    """:func:`apply` with the settings of a :class:`LoraConfig` (no-op if not enabled)."""
    if not config.enabled:
        return model
    return apply(model, config.target, config.rank, config.alpha, config.dropout, rngs=rngs,
                 base_dtype=config.base_dtype, plan=plan)


def place(model: nnx.Module, plan: Plan | None = None) -> nnx.Module:
    """Move every variable of ``model`` to its sharding under ``plan`` (default: the active
    plan). No-op without a plan or while tracing; arrays already in place are not copied."""
    plan = plan or current_plan()
    if plan is None:
        return model
    state = nnx.state(model)
    leaves = jax.tree.leaves(state)
    if not leaves or not all(isinstance(x, jax.Array) and not quant.is_tracing(x)
                             for x in leaves):
        return model
    with plan.activate():
        nnx.update(model, jax.device_put(state, state_shardings(plan, state)))
    return model


def merge(model: nnx.Module, *, dtype: Any = None, plan: Plan | None = None) -> nnx.Module:
    """Fold every adapter into its base weight (``W + A @ B * alpha / rank``), in place.

    Each :class:`LoraProjection` is replaced by its base layer, so the result has the
    original model's structure and paths. An int8 base becomes a float layer again.

    Args:
      model: a model with adapters.
      dtype: dtype of the merged kernels (default: the base kernel's own dtype, float32
        for an int8 base). Use ``jnp.float32`` to merge a bf16 base without rounding.
      plan: re-place the merged kernels by this plan (default: the active plan, if any).
    """
    if isinstance(model, LinenModel):  # adapters held by the wrapper, folded into kernels
        model.merge_adapters(dtype)
        return place(model, plan)
    found = [(p, m) for p, m in nnx.iter_graph(model) if isinstance(m, LoraProjection)]
    if not found:
        raise JaxparError("model has no LoRA adapters to merge")
    for path, lp in found:
        delta = lp.weight_delta()
        base = lp.base
        if isinstance(base, quant.QuantizedProjection):
            w = base.dequantize(jnp.float32) + delta
            merged = quant.rebuild_projection(base, w.astype(dtype or base.orig_dtype))
        else:
            w = base.kernel[...]
            base.kernel.set_value((w.astype(jnp.float32) + delta).astype(dtype or w.dtype))
            merged = base
        surgery.replace_module(model, tuple(path), merged)
    return place(model, plan)


def advance_dropout(tree: Any) -> Any:
    """Advance every adapter's dropout counter by one, so the next step draws new masks.

    Takes a model (updated in place) or an ``nnx.State`` (returns a new one, usable inside
    a jitted train step on the frozen state).
    """
    if isinstance(tree, nnx.Module):
        for _, node in nnx.iter_graph(tree):
            if isinstance(node, LoraDropoutCount):
                node.set_value(node[...] + 1)
        return tree
    return jax.tree.map(
        lambda v: v.replace(v.get_value() + 1) if isinstance(v, LoraDropoutCount) else v,
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
