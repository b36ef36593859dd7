"""Logical-axis rules: from the names a model gives its dimensions to mesh axes.

Model code names dimensions by what they mean (``"batch"``, ``"embed"``, ``"mlp"``);
it never mentions the mesh. A :class:`Rules` object is an ordered list of
``(logical name, mesh axes)`` pairs. Resolving one array's names walks the rules in
order; a rule fires for every still-unassigned dimension with its name when all of its
mesh axes are still free in that array, so earlier rules have priority and later rules
for the same name are fallbacks. A rule whose target is ``None`` pins its dimension to
be replicated. Mesh axes of size 1 are dropped from the result, so one rule set serves
every mesh shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jax.sharding import Mesh, PartitionSpec

from jaxpar.errors import JaxparError

MeshAxes = str | tuple[str, ...] | None
"""A rule's target: one mesh axis, several (the dimension is split over their product), or
``None`` (replicated)."""

LogicalNames = Sequence[str | None]
"""One logical name per array dimension; ``None`` means the dimension is never sharded."""


def _as_tuple(target: MeshAxes) -> tuple[str, ...]:
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


@dataclass(frozen=True)
class Resolution:
    """How one dimension was resolved: the rule that fired and the mesh axes it got."""

    name: str | None
    mesh_axes: tuple[str, ...]
    rule_index: int | None
    note: str

    def __str__(self) -> str:
        target = "x".join(self.mesh_axes) if self.mesh_axes else "replicated"
        return f"{self.name}: {target} ({self.note})"


class Rules:
    """An ordered list of ``(logical name, mesh axes)`` rules.

    Example::

        rules = Rules([("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor")])
        rules.spec(("embed", "mlp"), mesh)   # PartitionSpec('fsdp', 'tensor')
    """

    def __init__(self, rules: Iterable[tuple[str, MeshAxes]]):
        self.rules: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
            (str(name), _as_tuple(target)) for name, target in rules
        )

    def __repr__(self) -> str:
        return f"Rules({[(n, t or None) for n, t in self.rules]})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rules) and self.rules == other.rules

    def __hash__(self) -> int:
        return hash(self.rules)

    @property
    def names(self) -> frozenset[str]:
        """Every logical name some rule mentions."""
        return frozenset(name for name, _ in self.rules)

    def extend(self, rules: Iterable[tuple[str, MeshAxes]], *, first: bool = False) -> Rules:
        """A new rule set with ``rules`` appended (or, with ``first=True``, put in front)."""
        extra = Rules(rules).rules
        return Rules(extra + self.rules if first else self.rules + extra)

    def resolve(
        self,
        names: LogicalNames,
        mesh: Mesh,
        *,
        shape: Sequence[int] | None = None,
        path: str = "",
    ) -> list[Resolution]:
        """Resolve each dimension's name; see :meth:`spec` for the arguments."""
        where = f" of {path}" if path else ""
        if shape is not None and len(shape) != len(names):
            raise JaxparError(
                f"array{where} has {len(shape)} dimensions {tuple(shape)} but "
                f"{len(names)} logical names {tuple(names)}"
            )
        missing = [n for n in names if n is not None and n not in self.names]
        if missing:
            raise JaxparError(
                f"logical axis {missing[0]!r}{where} has no rule; rules cover "
                f"{sorted(self.names)}. Add a rule such as ({missing[0]!r}, None) to replicate it."
            )
        unknown = {a for _, t in self.rules for a in t if a not in mesh.shape}
        if unknown:
            raise JaxparError(
                f"rules name mesh axis {sorted(unknown)[0]!r}, not in mesh {tuple(mesh.shape)}"
            )
        out: list[Resolution | None] = [
            None if n is not None else Resolution(None, (), None, "unnamed") for n in names
        ]
        used: set[str] = set()
        for index, (rule_name, target) in enumerate(self.rules):
            for dim, name in enumerate(names):
                if out[dim] is not None or name != rule_name:
                    continue
                if not target:
                    out[dim] = Resolution(name, (), index, f"rule {index} replicates it")
                    continue
                axes = tuple(a for a in target if mesh.shape[a] > 1)
                if not axes:
                    continue  # every axis of this rule has size 1: try the next rule
                if any(a in used for a in axes):
                    continue
                if shape is not None:
                    size = math.prod(mesh.shape[a] for a in axes)
                    if shape[dim] % size:
                        raise JaxparError(
                            f"dimension {dim} ({name!r}, size {shape[dim]}){where} is not "
                            f"divisible by mesh axes {axes} of total size {size}"
                        )
                used.update(axes)
                out[dim] = Resolution(name, axes, index, f"rule {index}")
        return [
            r if r is not None else Resolution(n, (), None, "no rule's mesh axes were free")
            for r, n in zip(out, names, strict=True)
        ]

    def spec(
        self,
        names: LogicalNames,
        mesh: Mesh,
        *,
        shape: Sequence[int] | None = None,
        path: str = "",
    ) -> PartitionSpec:
        """The PartitionSpec for an array whose dimensions carry ``names``.

        Args:
          names: one logical name (or ``None``) per dimension.
          mesh: the mesh to shard over; size-1 axes never appear in the result.
          shape: if given, each sharded dimension must divide evenly.
          path: the array's name, used in error messages.

        Raises:
          JaxparError: for a name no rule mentions, or an indivisible dimension.
        """
        entries = []
        for r in self.resolve(names, mesh, shape=shape, path=path):
            entries.append(None if not r.mesh_axes else
                           r.mesh_axes[0] if len(r.mesh_axes) == 1 else r.mesh_axes)
        return PartitionSpec(*entries)

    def explain(self, names: LogicalNames, mesh: Mesh, *, shape: Sequence[int] | None = None
                ) -> str:
        """Say, for each dimension, which rule fired and what mesh axes it got."""
        lines = [f"  dim {i}: {r}" for i, r in
                 enumerate(self.resolve(names, mesh, shape=shape))]
        return "\n".join([f"{tuple(names)} on {dict(mesh.shape)}:", *lines])


# --- Presets ------------------------------------------------------------------------------
# Logical names used by jaxpar's models. Weights: vocab, embed, mlp, heads, kv_heads,
# head_dim, layers, stage, norm. Activations additionally: batch, seq, act_embed.

_UNSHARDED = [("stage", "stage"), ("head_dim", None), ("layers", None), ("repeat", None),
              ("seq", None), ("norm", None), ("lora_rank", None)]

_PARAMS = {
    "dp": [("vocab", None), ("embed", None), ("mlp", None), ("heads", None),
           ("kv_heads", None)],
    "fsdp": [("embed", "fsdp"), ("vocab", None), ("mlp", None), ("heads", None),
             ("kv_heads", None)],
    "tp": [("vocab", "tensor"), ("mlp", "tensor"), ("heads", "tensor"),
           ("kv_heads", "tensor"), ("embed", None)],
    "fsdp_tp": [("vocab", "tensor"), ("mlp", "tensor"), ("heads", "tensor"),
                ("kv_heads", "tensor"), ("embed", "fsdp")],
}

_ACTIVATIONS = {
    "dp": [("batch", ("data", "fsdp", "tensor")), ("embed", None), ("vocab", None),
           ("mlp", None), ("heads", None), ("kv_heads", None)],
    "fsdp": [("batch", ("data", "fsdp")), ("embed", None), ("vocab", None), ("mlp", None),
             ("heads", None), ("kv_heads", None)],
    "tp": [("batch", "data"), ("vocab", "tensor"), ("mlp", "tensor"), ("heads", "tensor"),
           ("kv_heads", "tensor"), ("embed", None)],
    "fsdp_tp": [("batch", ("data", "fsdp")), ("vocab", "tensor"), ("mlp", "tensor"),
                ("heads", "tensor"), ("kv_heads", "tensor"), ("embed", None)],
}

PRESETS: tuple[str, ...] = tuple(_PARAMS)


def preset(name: str) -> tuple[Rules, Rules]:
    """The (parameter rules, activation rules) of a named strategy.

    ``dp``: replicated weights, batch over every mesh axis. ``fsdp``: weights sharded on
    ``embed`` over ``fsdp``, batch over ``data`` and ``fsdp``. ``tp``: Megatron layout,
    heads/mlp/vocab over ``tensor``. ``fsdp_tp``: both (the default; with size-1 axes it
    reduces to whichever of DP, FSDP or TP the mesh asks for).
    """
    if name not in _PARAMS:
        raise JaxparError(f"unknown rules preset {name!r}; choose one of {PRESETS}")
    return Rules(_PARAMS[name] + _UNSHARDED), Rules(_ACTIVATIONS[name] + _UNSHARDED)
