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
from jaxpar.sharding.mesh import canonical_axis

MeshAxes = str | tuple[str, ...] | None
"""A rule's target: one mesh axis, several (the dimension is split over their product), or
``None`` (replicated)."""

LogicalNames = Sequence[str | tuple[str, ...] | None]
"""One entry per array dimension: a logical name, ``None`` (never sharded), or mesh axes
given directly (a mesh axis name, an alias such as ``"tp"``, or a tuple of them, as a
``PartitionSpec`` entry would be). A sequence shorter than the array leaves the trailing
dimensions unnamed, as Flax and ``jax.sharding`` do."""


def entry_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry names: none for ``None``, else the axis or
    the tuple of them."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def axes_entry(axes: Sequence[str]) -> MeshAxes:
    """The ``PartitionSpec`` entry that names ``axes`` (``None``, one axis, or a tuple):
    the inverse of :func:`entry_axes`."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _as_tuple(target: MeshAxes) -> tuple[str, ...]:
    if target is None:
        return ()
    axes = (target,) if isinstance(target, str) else tuple(target)
    return tuple(canonical_axis(a) for a in axes)


@dataclass(frozen=True)
class Resolution:
    """How one dimension was resolved: the rule that fired and the mesh axes it got.

    ``rule_index`` is None for unnamed dimensions, for mesh axes named directly and when
    no rule applied; ``note`` says which rules were passed over and why.
    """

    name: str | tuple[str, ...] | None
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

    A dimension whose size its rule's mesh axes do not divide falls through to the next
    rule for that name (for example ``("kv_heads", "tensor")`` with 4 KV heads on 8-way
    tensor parallelism ends replicated, as Megatron does); with ``strict=True`` it is an
    error instead. A name no rule mentions may be a mesh axis (or an alias: ``dp``,
    ``tp``/``mp``, ``pp``), which shards the dimension over that axis directly, so models
    annotated with mesh-axis names or ``PartitionSpec`` entries work unchanged.
    """

    def __init__(self, rules: Iterable[tuple[str, MeshAxes]], *, strict: bool = False):
        self.rules: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
            (str(name), _as_tuple(target)) for name, target in rules
        )
        self.strict = bool(strict)

    def __repr__(self) -> str:
        strict = ", strict=True" if self.strict else ""
        return f"Rules({[(n, t or None) for n, t in self.rules]}{strict})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Rules) and self.rules == other.rules
                and self.strict == other.strict)

    def __hash__(self) -> int:
        return hash((self.rules, self.strict))

    @property
    def names(self) -> frozenset[str]:
        """Every logical name some rule mentions."""
        return frozenset(name for name, _ in self.rules)

    def extend(self, rules: Iterable[tuple[str, MeshAxes]], *, first: bool = False) -> Rules:
        """A new rule set with ``rules`` appended (or, with ``first=True``, put in front)."""
        extra = Rules(rules).rules
        return Rules(extra + self.rules if first else self.rules + extra, strict=self.strict)

    def with_strict(self, strict: bool = True) -> Rules:
        """The same rules, raising (``strict``) or falling through on indivisible sizes."""
        return Rules(self.rules, strict=strict)

    def _direct_axes(self, entry: str | tuple[str, ...], mesh: Mesh, where: str
                     ) -> tuple[str, ...] | None:
        """Mesh axes an entry names directly, or None if it is a logical name."""
        if isinstance(entry, str):
            if entry in self.names:
                return None
            axes = (canonical_axis(entry),)
        else:
            axes = tuple(canonical_axis(a) for a in entry)
        for axis, given in zip(axes, (entry,) if isinstance(entry, str) else entry,
                               strict=True):
            if axis not in mesh.shape:
                if isinstance(entry, str):
                    raise JaxparError(
                        f"logical axis {entry!r}{where} has no rule; rules cover "
                        f"{sorted(self.names)}. Add a rule such as ({entry!r}, None) to "
                        "replicate it.")
                raise JaxparError(f"mesh axis {given!r} in {entry}{where} is not in mesh "
                                  f"{tuple(mesh.shape)}")
        return axes

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
        names = list(names)
        if shape is not None:
            if len(names) > len(shape):
                raise JaxparError(
                    f"array{where} has {len(shape)} dimensions {tuple(shape)} but "
                    f"{len(names)} logical names {tuple(names)}"
                )
            names += [None] * (len(shape) - len(names))
        unknown = {a for _, t in self.rules for a in t if a not in mesh.shape}
        if unknown:
            raise JaxparError(
                f"rules name mesh axis {sorted(unknown)[0]!r}, not in mesh {tuple(mesh.shape)}"
            )
        out: list[Resolution | None] = [None] * len(names)
        used: set[str] = set()
        # Mesh axes named directly are the user's explicit choice: place them first.
        for dim, name in enumerate(names):
            if name is None:
                out[dim] = Resolution(None, (), None, "unnamed")
                continue
            axes = self._direct_axes(name, mesh, where)
            if axes is None:
                continue
            axes = tuple(a for a in axes if mesh.shape[a] > 1)
            clash = [a for a in axes if a in used]
            if clash:
                raise JaxparError(f"mesh axis {clash[0]!r} is used twice{where}: {tuple(names)}")
            size = math.prod(mesh.shape[a] for a in axes)
            if shape is not None and shape[dim] % size:
                raise JaxparError(
                    f"dimension {dim} (size {shape[dim]}){where} is not divisible by mesh "
                    f"axes {axes} of total size {size}, named directly by {name!r}")
            used.update(axes)
            out[dim] = Resolution(name, axes, None, "mesh axes named directly")
        skipped: dict[int, list[str]] = {}
        for index, (rule_name, target) in enumerate(self.rules):
            for dim, name in enumerate(names):
                if out[dim] is not None or name != rule_name:
                    continue
                if not target:
                    out[dim] = Resolution(name, (), index, _note(skipped.get(dim),
                                                                 f"rule {index} replicates it"))
                    continue
                axes = tuple(a for a in target if mesh.shape[a] > 1)
                if not axes:
                    continue  # every axis of this rule has size 1: try the next rule
                if any(a in used for a in axes):
                    continue
                if shape is not None:
                    size = math.prod(mesh.shape[a] for a in axes)
                    if shape[dim] % size:
                        if self.strict:
                            raise JaxparError(
                                f"dimension {dim} ({name!r}, size {shape[dim]}){where} is not "
                                f"divisible by mesh axes {axes} of total size {size}"
                            )
                        skipped.setdefault(dim, []).append(
                            f"rule {index} skipped: {shape[dim]} not divisible by "
                            f"{'x'.join(axes)}={size}")
                        continue
                used.update(axes)
                out[dim] = Resolution(name, axes, index, _note(skipped.get(dim), f"rule {index}"))
        return [
            r if r is not None else
            Resolution(n, (), None, _note(skipped.get(d), "no rule's mesh axes were free"))
            for d, (r, n) in enumerate(zip(out, names, strict=True))
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
          names: one logical name (or ``None``, or mesh axes named directly) per dimension;
            may be shorter than ``shape`` (trailing dimensions unnamed).
          mesh: the mesh to shard over; size-1 axes never appear in the result.
          shape: if given, a rule whose mesh axes do not divide a dimension is passed over
            (an error with ``strict`` rules).
          path: the array's name, used in error messages.

        Raises:
          JaxparError: for a name that is neither covered by a rule nor a mesh axis, more
            names than dimensions, or (strict rules) an indivisible dimension.
        """
        entries = []
        for r in self.resolve(names, mesh, shape=shape, path=path):
            entries.append(None if not r.mesh_axes else
                           r.mesh_axes[0] if len(r.mesh_axes) == 1 else r.mesh_axes)
        return PartitionSpec(*entries)

    def explain(self, names: LogicalNames, mesh: Mesh, *, shape: Sequence[int] | None = None
                ) -> str:
        """Say, for each dimension, which rule fired (and which were passed over) and what
        mesh axes it got."""
        lines = [f"  dim {i}: {r}" for i, r in
                 enumerate(self.resolve(names, mesh, shape=shape))]
        return "\n".join([f"{tuple(names)} on {dict(mesh.shape)}:", *lines])


def _note(skipped: list[str] | None, final: str) -> str:
    return "; ".join([*(skipped or []), final])


# --- Presets ------------------------------------------------------------------------------
# Logical names used by jaxpar's models. Weights: vocab, embed, mlp, heads, kv_heads,
# head_dim, layers, stage, norm, expert. Activations additionally: batch, seq (inside
# attention and the MLP), residual_seq (the residual stream between blocks, which sequence
# parallelism splits over tensor) and expert (tokens dispatched to experts).
#
# The sequence is split over the ``context`` axis (context parallelism) and experts over
# the ``expert`` axis; both axes have size 1 unless a mesh asks for them, so these rules
# change nothing otherwise. The expert axis also splits the batch outside MoE layers: an
# activation with an expert dimension gives ``expert`` to it and its batch falls back to
# the other batch axes, which is what makes dispatch an all-to-all.

_UNSHARDED = [("stage", "stage"), ("head_dim", None), ("layers", None), ("repeat", None),
              ("seq", "context"), ("residual_seq", "context"), ("norm", None),
              ("lora_rank", None), ("capacity", None)]

_PARAMS = {
    "dp": [("expert", "expert"), ("vocab", None), ("embed", None), ("mlp", None),
           ("heads", None), ("kv_heads", None)],
    "fsdp": [("expert", "expert"), ("embed", "fsdp"), ("vocab", None), ("mlp", None),
             ("heads", None), ("kv_heads", None)],
    "tp": [("expert", "expert"), ("vocab", "tensor"), ("mlp", "tensor"), ("heads", "tensor"),
           ("kv_heads", "tensor"), ("embed", None)],
    "fsdp_tp": [("expert", "expert"), ("vocab", "tensor"), ("mlp", "tensor"),
                ("heads", "tensor"), ("kv_heads", "tensor"), ("embed", "fsdp")],
}

_ACTIVATIONS = {
    "dp": [("expert", "expert"), ("batch", ("data", "fsdp", "expert", "tensor")),
           ("batch", ("data", "fsdp", "tensor")), ("embed", None), ("vocab", None),
           ("mlp", None), ("heads", None), ("kv_heads", None)],
    "fsdp": [("expert", "expert"), ("batch", ("data", "fsdp", "expert")),
             ("batch", ("data", "fsdp")), ("embed", None), ("vocab", None), ("mlp", None),
             ("heads", None), ("kv_heads", None)],
    "tp": [("expert", "expert"), ("batch", ("data", "expert")), ("batch", "data"),
           ("vocab", "tensor"), ("mlp", "tensor"), ("heads", "tensor"),
           ("kv_heads", "tensor"), ("embed", None)],
    "fsdp_tp": [("expert", "expert"), ("batch", ("data", "fsdp", "expert")),
                ("batch", ("data", "fsdp")), ("vocab", "tensor"), ("mlp", "tensor"),
                ("heads", "tensor"), ("kv_heads", "tensor"), ("embed", None)],
}

PRESETS: tuple[str, ...] = tuple(_PARAMS)


def preset(name: str, *, strict: bool = False) -> tuple[Rules, Rules]:
    """The (parameter rules, activation rules) of a named strategy.

    ``dp``: replicated weights, batch over every mesh axis. ``fsdp``: weights sharded on
    ``embed`` over ``fsdp``, batch over ``data`` and ``fsdp``. ``tp``: Megatron layout,
    heads/mlp/vocab over ``tensor``. ``fsdp_tp``: both (the default; with size-1 axes it
    reduces to whichever of DP, FSDP or TP the mesh asks for). ``strict``: an
    indivisible dimension is an error rather than falling through to the next rule.
    """
    if name not in _PARAMS:
        raise JaxparError(f"unknown rules preset {name!r}; choose one of {PRESETS}")
    return (Rules(_PARAMS[name] + _UNSHARDED, strict=strict),
            Rules(_ACTIVATIONS[name] + _UNSHARDED, strict=strict))


VOCAB_OVER_FSDP = ("vocab", ("tensor", "fsdp", "stage"))
"""The rule :func:`split_vocab_over_fsdp` puts first: the vocabulary over ``tensor``,
``fsdp`` and ``stage`` together."""
_BATCH_WITHOUT_FSDP = [("batch", ("data", "expert")), ("batch", "data")]


def split_vocab_over_fsdp(params: Rules, acts: Rules, on: bool = True) -> tuple[Rules, Rules]:
    """Rules that split the vocabulary (embedding table, output head, logits) over the
    ``fsdp`` axis as well as ``tensor`` (``on``; without it, those rules removed again).

    Under FSDP the output head is otherwise stored split on its ``embed`` dimension and
    all-gathered whole for the logits, forward and backward, and its whole gradient
    reduced: ``vocab x d_model`` values a device, twice. Split on the vocabulary over the
    same axes, the head stays where it lies: the step all-gathers the final hidden states
    over ``fsdp`` instead (``tokens x d_model``), each device computes its vocabulary slice
    of every token's logits, and the hidden states' gradient is reduced back. That moves
    less whenever the tokens of a step in one FSDP group are fewer than the vocabulary
    (the planner compares both). Activations whose vocabulary takes ``fsdp`` (the logits)
    fall back to a batch split over the other axes. Under pipeline parallelism the
    vocabulary is split over ``stage`` too: the embedding, head and loss run outside the
    pipeline, where every stage would otherwise compute the same logits."""
    rule = Rules([VOCAB_OVER_FSDP]).rules[0]
    extra = Rules(_BATCH_WITHOUT_FSDP).rules
    if (params.rules[:1] == (rule,)) == on:
        return params, acts
    if on:
        return (Rules((rule, *params.rules), strict=params.strict),
                Rules((rule, *acts.rules, *extra), strict=acts.strict))
    return (Rules(params.rules[1:], strict=params.strict),
            Rules(acts.rules[1:len(acts.rules) - len(extra)], strict=acts.strict))
