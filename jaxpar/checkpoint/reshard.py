"""Matching saved arrays to a target layout: the path names checkpoints use, and reading
under another plan.

A train state pytree is addressed by ``/``-joined paths (``params/blocks/attn/wq/kernel``,
``opt_state/1/0/mu/embed``). :func:`match` compares the shapes a checkpoint holds with the
arrays of a target state and returns what to read: abstract arrays carrying the target's
shardings (so each device reads only its own slices), plus the on-device reshapes that
convert stacked layers between the plain ``(layers, ...)`` layout and the pipeline's
``(repeat, stage, ...)``. Anything else that differs is an error listing every path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import JaxparError
from jaxpar.parallel import schedules
from jaxpar.sharding.paths import key_str

DILOCO_STATE = ("anchor", "replicas", "momentum")
"""Top-level entries of a DiLoCo run's state that a synchronous run's does not have."""


# --- pytree <-> flat "a/b/c" paths --------------------------------------------------------
def flat_paths(tree: Any) -> dict[str, Any]:
    """``{"params/blocks/attn/wq/kernel": leaf, ...}`` in the tree's flattening order."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [key_str(k) for k in path]
        if len(parts) > 1 and parts[-1] == "value":  # an nnx.Variable's payload
            parts.pop()
        out["/".join(parts)] = leaf
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return root


def flatten_dict(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Inverse of :func:`nest` for nested mappings (non-mapping values are leaves)."""
    if not isinstance(tree, Mapping):
        return {prefix.rstrip("/"): tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten_dict(v, f"{prefix}{k}/"))
    return out


# --- matching a checkpoint to a target ----------------------------------------------------
def _stack_lead(have: tuple, want: tuple, stages_have: int, stages_want: int
                ) -> tuple[int, int] | None:
    """Leading dims to merge when ``have`` and ``want`` differ only in how stacked layers
    are laid out: ``(L, ...)`` unpipelined, ``(L // S, S, ...)`` over ``S`` pipeline
    stages. None when they differ in any other way."""
    ks = 2 if stages_have > 1 and len(have) >= 2 and have[1] == stages_have else 1
    kw = 2 if stages_want > 1 and len(want) >= 2 and want[1] == stages_want else 1
    if (ks, kw) == (1, 1) or len(have) < ks or len(want) < kw:
        return None
    if have[ks:] != want[kw:] or _prod(have[:ks]) != _prod(want[:kw]):
        return None
    return ks, kw


def _restack(x: jax.Array, *, unstack: bool, stack: bool, stages: int, have_layers: int,
             want_layers: int) -> jax.Array:
    """Stacked layers from the checkpoint's layout to the target's (through plain
    ``(layers, ...)``)."""
    if unstack:
        x = schedules.unstack_layers(x, have_layers)
    return schedules.stack_layers(x, stages, want_layers) if stack else x


def _prod(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def listing(items: list[str], limit: int = 10) -> str:
    """``items`` joined, the first ``limit`` of them and a count of the rest."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def match(saved: Mapping[str, tuple], target: Mapping[str, Any], what: str,
          stages: tuple[int, int] = (1, 1), layers_per_stage: tuple[int, int] = (1, 1)
          ) -> tuple[dict[str, jax.ShapeDtypeStruct], dict[str, Callable]]:
    """Abstract arrays to read for every ``target`` path, and reshapes to apply after.

    ``saved`` maps paths to stored shapes; ``target`` maps paths to arrays (or abstract
    arrays) carrying the wanted shape, dtype and sharding. ``stages``: pipeline stages the
    checkpoint and the target were laid out for, and ``layers_per_stage`` of each (stacked
    layers are converted: :func:`jaxpar.parallel.schedules.stack_layers`).

    Raises:
      JaxparError: listing every path whose shape differs, is missing from the
        checkpoint, or is in the checkpoint but not in the target.
    """
    missing = [k for k in target if k not in saved]
    extra = [k for k in saved if k not in target]
    diloco = [sorted({k.split("/")[0] for k in keys} & set(DILOCO_STATE))
              for keys in (missing, extra)]
    if any(diloco):
        side = "this config runs DiLoCo and the checkpoint does not" if diloco[0] else (
            "the checkpoint holds DiLoCo replicas and this config does not run DiLoCo")
        raise JaxparError(f"{what} does not match the config: {side}; resume with the "
                          "diloco.sync_every the run was saved with (0 for none)")
    wrong, abstract, fixes = [], {}, {}
    for key, leaf in target.items():
        if key not in saved:
            continue
        have, want = tuple(saved[key]), tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        lead = _stack_lead(have, want, *stages)
        if have == want and (lead is None or layers_per_stage[0] == layers_per_stage[1]
                             or stages[0] != stages[1]):
            abstract[key] = jax.ShapeDtypeStruct(want, leaf.dtype, sharding=sharding)
            continue
        if lead is None:
            wrong.append(f"{key}: checkpoint {have}, expected {want}")
            continue
        ks, kw = lead
        spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
        spec = spec + (None,) * (len(want) - len(spec))
        mid = (NamedSharding(sharding.mesh, PartitionSpec(*((None,) * ks + spec[kw:])))
               if isinstance(sharding, NamedSharding) else sharding)
        abstract[key] = jax.ShapeDtypeStruct(have, leaf.dtype, sharding=mid)
        fixes[key] = jax.jit(functools.partial(
            _restack, unstack=ks == 2, stack=kw == 2, stages=stages[1],
            have_layers=layers_per_stage[0], want_layers=layers_per_stage[1]),
            out_shardings=sharding)
    problems = []
    wrong.sort(key=lambda w: w.startswith("opt_state"))  # model weights first
    if wrong:
        problems.append(f"shape mismatch at {listing(wrong)}")
    if missing:
        problems.append(f"missing from the checkpoint: {listing(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in this model: {listing(extra)}")
    if problems:
        raise JaxparError(f"{what} does not match the config: " + "; ".join(problems))
    return abstract, fixes
