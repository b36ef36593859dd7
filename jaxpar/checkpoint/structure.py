"""Checkpoints read across the layouts a model's blocks ran in.

A model of yours keeps its blocks in a list (``h/0/attn/c_attn/kernel``, ``h/1/...``).
A run may have stacked them: scanned (:mod:`jaxpar.sharding.scanned`: ``h/attn/c_attn/
kernel`` shaped ``(layers, ...)``) or split into pipeline stages
(:mod:`jaxpar.parallel.staged`: ``blocks/attn/c_attn/kernel`` shaped ``(repeat, stage,
...)``, the rest of the model under ``model/``). A checkpoint is written in the layout that
ran, with a description of its stacks in its meta (:func:`stacks_of`); reading it for a
model in another layout maps both sides to the model's own structure, the paths of the
model as written, and reads each target array from the saved arrays that hold its
values (:func:`relayout`): per-layer arrays stacked, stacked arrays sliced or restacked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.parallel import schedules
from jaxpar.sharding.scanned import scanned_paths


@dataclasses.dataclass(frozen=True)
class Stack:
    """Blocks held stacked: at ``path`` in the model's state, kept at ``home`` (a list of
    ``layers`` items) in the model as written; ``stages`` > 0: laid out as ``(repeat,
    stages, ...)`` with ``per`` layers a stage; ``rest``: prefix of the model's other
    variables in the state (``model/`` for a staged model)."""

    path: str
    home: str
    layers: int
    stages: int = 0
    per: int = 1
    rest: str = ""

    @property
    def lead(self) -> int:
        """Number of leading stacked dimensions."""
        return 2 if self.stages else 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stacks_of(model: Any) -> list[Stack]:
    """The stacks of ``model`` (an ``nnx.Module``; anything else has none)."""
    if not isinstance(model, nnx.Module):
        return []
    home = getattr(model, "_home", None)
    schedule = getattr(model, "pipeline_schedule", None)
    if home is not None and schedule is not None and hasattr(model, "blocks"):
        return [Stack("blocks", home[0], schedule.layers, schedule.stages,
                      schedule.layers_per_stage, "model/")]
    return [Stack(p, p, n) for p, n in scanned_paths(model).items()]


def from_meta(meta: Mapping[str, Any]) -> list[Stack]:
    """The stacks a checkpoint's meta describes (none for checkpoints written before)."""
    return [Stack(**s) for s in meta.get("stacks") or []]


def _own(model_path: str, stacks: list[Stack]
         ) -> tuple[list[tuple[str, int | None]], Stack | None]:
    """The model-as-written paths of one variable path of a layout, and the stack it is
    in: ``[(path, None)]``, or one ``(home/i/rest, i)`` per layer of a stacked variable."""
    for s in stacks:
        if model_path.startswith(s.path + "/"):
            rest = model_path[len(s.path) + 1:]
            return [(f"{s.home}/{i}/{rest}", i) for i in range(s.layers)], s
    for s in stacks:
        if s.rest and model_path.startswith(s.rest):
            return [(model_path[len(s.rest):], None)], None
    return [(model_path, None)], None


def _split(key: str, model_paths: list[str]) -> tuple[str, str] | None:
    """``(prefix, model path)`` of a state key: the longest model path it ends with."""
    for path in model_paths:
        if key == path:
            return "", path
        if key.endswith("/" + path):
            return key[:-len(path)], path
    return None


def _model_paths(keys: Mapping[str, Any]) -> list[str]:
    """A train state's model variable paths (the ``params``, ``frozen`` and ``master``
    subtrees), longest first."""
    out = {k.split("/", 1)[1] for k in keys
           if k.split("/", 1)[0] in ("params", "frozen", "master") and "/" in k}
    return sorted(out, key=lambda p: (-p.count("/"), p))


@dataclasses.dataclass
class _Index:
    """A state's keys by the model-as-written key each holds, and the stack of each."""

    own: dict[str, list[tuple[str, int | None]]]
    stack: dict[str, Stack | None]


def _index(keys: Mapping[str, Any], stacks: list[Stack]) -> _Index:
    paths = _model_paths(keys)
    index = _Index({}, {})
    for key in keys:
        found = _split(key, paths)
        places, stack = (_own(found[1], stacks) if found else ([(key, None)], None))
        prefix = found[0] if found else ""
        index.stack[key] = stack
        for own, i in places:
            index.own.setdefault(prefix + own if found else own, []).append((key, i))
    return index


def differ(saved_stacks: list[Stack], target_stacks: list[Stack]) -> bool:
    """Whether a checkpoint's stacks and a target's are laid out at different paths (the
    pipeline restacking of a ``blocks`` stack alone keeps them: see
    :func:`jaxpar.checkpoint.reshard.match`)."""
    def paths(stacks: list[Stack]) -> list[tuple]:
        return sorted((s.path, s.home, s.rest) for s in stacks)
    return paths(saved_stacks) != paths(target_stacks)


def _spec(leaf: Any) -> tuple:
    sharding = getattr(leaf, "sharding", None)
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (len(leaf.shape) - len(spec))


def _with_spec(sharding: Any, spec: tuple) -> Any:
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def relayout(saved: Mapping[str, tuple], target: Mapping[str, Any],
             saved_stacks: list[Stack], target_stacks: list[Stack]
             ) -> tuple[dict[str, jax.ShapeDtypeStruct], dict[str, Callable], list[str],
                        list[str]]:
    """What to read to fill ``target`` (paths to arrays with shape, dtype and sharding)
    from a checkpoint holding ``saved`` (paths to shapes), the two laid out with the
    stacks given: ``(abstract arrays to read by saved key, {target key: fn(read values) ->
    array}, target keys with no source, saved keys no target uses)``."""
    have, want = _index(saved, saved_stacks), _index(target, target_stacks)
    sources: dict[str, list[tuple[int | None, str, int | None]]] = {}
    missing: set[str] = set()
    for own, places in want.own.items():
        found = have.own.get(own)
        for key, i in places:
            if found:
                sources.setdefault(key, []).append((i, *found[0]))
            else:
                missing.add(key)
    used = {skey for pairs in sources.values() for _, skey, _ in pairs}
    abstract: dict[str, jax.ShapeDtypeStruct] = {}
    builders: dict[str, Callable] = {}
    for key, pairs in sources.items():
        if key in missing:
            continue
        leaf, stack = target[key], want.stack[key]
        per_layer = _spec(leaf)[stack.lead if stack is not None else 0:]
        for _, skey, si in pairs:
            saved_stack = have.stack[skey]
            lead = saved_stack.lead if si is not None and saved_stack is not None else 0
            abstract.setdefault(skey, jax.ShapeDtypeStruct(
                tuple(saved[skey]), leaf.dtype,
                sharding=_with_spec(getattr(leaf, "sharding", None),
                                    (None,) * lead + per_layer)))
        builders[key] = _builder(pairs, getattr(leaf, "sharding", None), stack, have.stack)
    return abstract, builders, sorted(missing), sorted(k for k in saved if k not in used)


def _layer(x: jax.Array, i: int, stack: Stack | None) -> jax.Array:
    if stack is not None and stack.stages:
        x = schedules.unstack_layers(x, stack.per)
    return x[i]


def _builder(pairs: list, sharding: Any, target_stack: Stack | None,
             saved_stacks: Mapping[str, Stack | None]) -> Callable:
    """A function of the read values giving one target array."""
    keys = sorted({skey for _, skey, _ in pairs})
    pairs = sorted(pairs, key=lambda p: -1 if p[0] is None else p[0])

    def build(*arrays: jax.Array) -> jax.Array:
        values = dict(zip(keys, arrays, strict=True))
        layers = [values[skey] if si is None else _layer(values[skey], si, saved_stacks[skey])
                  for _, skey, si in pairs]
        if target_stack is None:
            return layers[0]
        x = jnp.stack(layers)
        if target_stack.stages:
            x = schedules.stack_layers(x, target_stack.stages, target_stack.per)
        return x

    run = jax.jit(build, out_shardings=sharding)
    return lambda values: run(*(values[k] for k in keys))
