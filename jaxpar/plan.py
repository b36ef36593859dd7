"""The Plan: one object that says how a training run is laid out on devices.

A :class:`Plan` holds the mesh, the parameter rules (how weights are stored) and the
activation rules (how computation is split). FSDP is the clearest example of why these
are two mappings: weights are stored split on ``embed`` over ``fsdp``, while the compute
batch is split over ``(data, fsdp)``, so each layer all-gathers its weights just in time.

``plan.activate()`` is the one context under which models are built and run: inside it,
:func:`constrain` applies the activation rules, the plan's mesh is JAX's current mesh
(with ``mesh_context=True``, as the Trainer runs its steps: model code may then call
``with_sharding_constraint`` with a bare ``PartitionSpec``, or ``reshard`` on an explicit
mesh), and Flax variables are not sharded
eagerly (jaxpar places them itself, through the parameter rules).

Two knobs adapt models jaxpar did not write: ``annotations`` (logical names for variables
by path, for models that carry none; see :func:`jaxpar.annotate`) and ``layouts`` (logical
names for the outputs of modules matched by path or type, for models without
``constrain`` calls inside; see :func:`jaxpar.constrain_outputs`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import context as context_lib
from jaxpar import remat as remat_lib
from jaxpar import rules as rules_lib
from jaxpar.annotate import pairs
from jaxpar.errors import JaxparError
from jaxpar.mesh import describe, is_explicit
from jaxpar.precision import Policy
from jaxpar.rules import LogicalNames, Rules

CONTEXT_ATTENTION = context_lib.KINDS
"""The ways attention can span a sequence split over the ``context`` axis."""
_SEQUENCE_PARALLEL = ("residual_seq", ("context", "tensor"))
_ACTIVE: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("jaxpar_plan", default=None)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Mesh plus rules, and the training knobs that depend on them.

    Attributes:
      mesh: the device mesh (see :func:`jaxpar.make_mesh`).
      param_rules: logical name -> mesh axes for weights (and optimizer state).
      act_rules: logical name -> mesh axes for activations and the input batch.
      precision: mixed-precision policy (master, compute and output dtypes).
      zero_stage: 0-3: shard optimizer state (1), gradients (2), parameters (3) over the
        data-parallel axes (see :mod:`jaxpar.zero`).
      remat: rematerialization policy name per block (see :mod:`jaxpar.remat`).
      microbatches: gradient accumulation: split each batch into this many microbatches and
        apply one update.
      annotations: ``(path regex, logical names)`` pairs applied to the model's variables
        before they are placed (first matching pattern wins; see :func:`jaxpar.annotate`).
      layouts: ``(path regex or module type, logical names)`` pairs pinning module outputs
        (see :func:`jaxpar.constrain_outputs`); ``"auto"`` (the default) pins the outputs of
        the model's repeated blocks and its embedding tables (see
        :func:`jaxpar.layouts.auto_layouts`), ``()`` nothing.
      sequence_parallel: Megatron sequence parallelism: the residual stream (logical
        ``residual_seq``) is split over the ``tensor`` axis between blocks, so each tensor-
        parallel all-reduce becomes a reduce-scatter and an all-gather and the norm and
        residual activations shrink by the tensor degree.
      context_attention: with a ``context`` mesh axis (sequence split across devices),
        ``"allgather"`` (each device gathers all keys and values) or ``"ring"`` (key/value
        blocks passed around the axis, online softmax); see :mod:`jaxpar.context`.
      context_balance: under context parallelism, lay the sequence out in ``2 x context``
        chunks, device ``i`` holding chunks ``i`` and ``2c - 1 - i``, so every device does
        the same share of causal attention work.
    """

    mesh: Mesh
    param_rules: Rules
    act_rules: Rules
    precision: Policy = Policy()
    zero_stage: int = 0
    remat: str = "none"
    microbatches: int = 1
    annotations: tuple = ()
    layouts: tuple | str = "auto"
    sequence_parallel: bool = False
    context_attention: str = "allgather"
    context_balance: bool = True

    def __post_init__(self) -> None:
        if self.context_attention not in CONTEXT_ATTENTION:
            raise JaxparError(f"context_attention={self.context_attention!r}: choose one of "
                              f"{list(CONTEXT_ATTENTION)}")
        if (self.sequence_parallel
                and Rules([_SEQUENCE_PARALLEL]).rules[0] not in self.act_rules.rules):
            object.__setattr__(self, "act_rules",
                               self.act_rules.extend([_SEQUENCE_PARALLEL], first=True))
        if self.zero_stage not in (0, 1, 2, 3):
            raise JaxparError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        remat_lib.check(self.remat)
        if self.microbatches < 1:
            raise JaxparError(f"microbatches must be >= 1, got {self.microbatches}")
        object.__setattr__(self, "annotations", pairs(self.annotations, "plan.annotations"))
        if self.layouts != "auto":
            object.__setattr__(self, "layouts", pairs(self.layouts, "plan.layouts"))

    @classmethod
    def from_preset(cls, mesh: Mesh, name: str = "fsdp_tp", *, strict: bool = False,
                    **knobs) -> Plan:
        """A plan with one of the named rule presets (see :func:`jaxpar.rules.preset`);
        ``strict`` makes an indivisible dimension an error instead of a fallthrough."""
        params, acts = rules_lib.preset(name, strict=strict)
        return cls(mesh=mesh, param_rules=params, act_rules=acts, **knobs)

    def replace(self, **changes) -> Plan:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # --- shardings ------------------------------------------------------------------------
    def param_spec(self, names: LogicalNames, shape=None, path: str = "") -> PartitionSpec:
        """PartitionSpec of a weight with these logical names."""
        return self.param_rules.spec(names, self.mesh, shape=shape, path=path)

    def act_spec(self, names: LogicalNames, shape=None, path: str = "") -> PartitionSpec:
        """PartitionSpec of an activation with these logical names."""
        return self.act_rules.spec(names, self.mesh, shape=shape, path=path)

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """A NamedSharding on this plan's mesh."""
        return NamedSharding(self.mesh, spec)

    @property
    def explicit(self) -> bool:
        """Whether the mesh uses explicit sharding (``AxisType.Explicit``)."""
        return is_explicit(self.mesh)

    def place(self, x: Any, sharding: Any) -> Any:
        """Put ``x`` (an array or pytree) in ``sharding`` inside traced code:
        ``with_sharding_constraint`` on an ``Auto`` mesh, ``reshard`` on an explicit one."""
        if self.explicit:
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)

    @property
    def replicated(self) -> NamedSharding:
        """The sharding of a fully replicated array (scalars, step counters)."""
        return NamedSharding(self.mesh, PartitionSpec())

    def batch_sharding(self, ndim: int = 2) -> NamedSharding:
        """Sharding of one leaf of an input batch, shaped ``(batch, seq, ...)`` (see
        :func:`batch_names`)."""
        return self.sharding(self.act_spec(batch_names(ndim)))

    @property
    def data_parallel_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (size-1 axes omitted)."""
        spec = self.act_spec(("batch",))[0]
        return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)

    @property
    def data_parallel_size(self) -> int:
        """How many ways the batch is split (the product of the batch's mesh axes)."""
        size = 1
        for a in self.data_parallel_axes:
            size *= self.mesh.shape[a]
        return size

    # --- context --------------------------------------------------------------------------
    @contextlib.contextmanager
    def activate(self, *, mesh_context: bool = False) -> Iterator[Plan]:
        """Make this the current plan: :func:`constrain` uses it, and variables are created
        unsharded so jaxpar can place them by the parameter rules.

        With ``mesh_context`` the mesh is also JAX's current mesh (``jax.set_mesh``), which
        model code that calls ``reshard`` or ``with_sharding_constraint`` with a bare
        ``PartitionSpec`` needs; the Trainer runs every step so. It is off by default
        because ``nnx.eval_shape`` under a mesh reads logical names as mesh axes."""
        token = _ACTIVE.set(self)
        try:
            with (nnx.use_eager_sharding(False),
                  jax.set_mesh(self.mesh) if mesh_context else contextlib.nullcontext()):
                yield self
        finally:
            _ACTIVE.reset(token)

    def describe(self) -> str:
        """A one-line summary for logs."""
        return (f"mesh {describe(self.mesh)}{' (explicit)' if self.explicit else ''}, "
                f"zero {self.zero_stage}, precision {self.precision}"
                f", remat {self.remat}, microbatches {self.microbatches}"
                + (", sequence parallel" if self.sequence_parallel else "")
                + (f", context attention {self.context_attention}"
                   if self.mesh.shape.get("context", 1) > 1 else ""))


def batch_names(ndim: int) -> tuple[str | None, ...]:
    """Logical names of a batch leaf: ``batch`` on the leading axis, the rest whole.

    Token ids are small and their sequence (``seq + 1`` long, for next-token targets)
    rarely splits evenly, so under context parallelism the model splits the sequence at
    its first activation instead."""
    return ("batch", *(None,) * max(ndim - 1, 0))[:ndim]


def current_plan() -> Plan | None:
    """The plan activated by the innermost ``plan.activate()``, or None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, names: LogicalNames) -> jax.Array:
    """Constrain activation ``x`` to the sharding its logical names imply under the current plan.

    Use inside model code: ``x = jaxpar.constrain(x, ("batch", "seq", "embed"))``. With no
    active plan (for example in a plain single-device run) it returns ``x`` unchanged.
    """
    plan = _ACTIVE.get()
    if plan is None:
        return x
    spec = plan.act_spec(names, shape=x.shape, path="activation")
    return plan.place(x, plan.sharding(spec))

