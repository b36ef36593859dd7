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
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.errors import JaxparError
from jaxpar.sharding import quantization
from jaxpar.sharding import remat as remat_lib
from jaxpar.sharding import rules as rules_lib
from jaxpar.sharding.annotations import pairs
from jaxpar.sharding.mesh import compile_only, describe, is_explicit
from jaxpar.sharding.precision import Policy
from jaxpar.sharding.rules import LogicalNames, Rules, axes_entry, entry_axes

CONTEXT_ATTENTION = ("allgather", "ring")
"""The ways attention can span a sequence split over the ``context`` axis (see
:mod:`jaxpar.parallel.context`)."""
_SEQUENCE_PARALLEL = ("residual_seq", ("context", "tensor"))
_ACTIVE: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("jaxpar_plan", default=None)


@dataclasses.dataclass(frozen=True)
class Knob:
    """What a plan knob allows: a set of ``choices``, or a ``check`` with the text ``valid``
    saying what passes it; ``parse`` turns the config file's text into the value (the
    precision policy). The one definition the Plan, the config's ``plan`` section, its
    validation and the assembly of a run all read (see :func:`knobs`)."""

    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    valid: str = ""
    parse: Callable[[Any], Any] | None = None

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (None: nothing)."""
        if self.choices is not None and value not in self.choices:
            return f"choose one of {list(self.choices)}"
        if self.check is not None and not self.check(value):
            return self.valid
        return None


AUTO_KNOBS = ("vocab_over_fsdp",)
GRAD_DTYPES = ("compute", "float32")
"""What the projection layers' weight gradients are summed in (``Plan.grad_dtype``)."""
WEIGHT_COPY = ("auto", "stored", "in_step")
"""Whether a compute-dtype copy of the weights is kept between steps (``Plan.weight_copy``)."""
"""Knobs whose config default is ``auto``: resolved, when a run is assembled from its
config, to what the planner picks for the model, mesh and batch (see
:mod:`jaxpar.planner.auto`). A :class:`Plan` itself takes only a concrete value."""


def knob(default: Any, **allowed: Any) -> Any:
    """A :class:`Plan` field that is a training knob, with what it allows (see :class:`Knob`)."""
    return dataclasses.field(default=default, metadata={"knob": Knob(**allowed)})


def knobs() -> tuple[dataclasses.Field, ...]:
    """The Plan's knobs (every field but the mesh and the two rule sets), in order: the
    fields of the config's ``plan`` section besides the preset name and ``strict``."""
    return tuple(f for f in dataclasses.fields(Plan) if "knob" in f.metadata)


def _is_a(value: Any, kind: Any) -> bool:
    """Whether ``value`` has a knob's type (a list passes for a tuple, as YAML gives it;
    a bool never passes for an int)."""
    if isinstance(kind, types.UnionType):
        return any(_is_a(value, k) for k in typing.get_args(kind))
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is tuple:
        return isinstance(value, list | tuple)
    return isinstance(value, kind)


def check_knob(name: str, value: Any, key: str | None = None) -> Any:
    """``value`` parsed (a precision policy from its text) and checked against the knob
    ``name``; a bad one is a :class:`JaxparError` naming ``key`` (default: the name), the
    value and what is valid."""
    spec: Knob = next(f for f in knobs() if f.name == name).metadata["knob"]
    key = key or name
    if spec.parse is not None and isinstance(value, str):
        try:
            value = spec.parse(value)
        except JaxparError as err:
            raise JaxparError(f"{key}: {err}") from None
    kind = typing.get_type_hints(Plan)[name]
    if not _is_a(value, kind):
        names = " or ".join(k.__name__ for k in typing.get_args(kind) or (kind,))
        raise JaxparError(f"{key}={value!r}: must be {names}, not {type(value).__name__}")
    problem = spec.problem(value)
    if problem:
        raise JaxparError(f"{key}={value!r}: {problem}")
    return value


def check_knob_pairs(knob_values: Any) -> None:
    """Refuse knobs that are valid alone but not together (``knob_values`` has the knobs
    as attributes: a Plan, or the config's ``plan`` section)."""
    if knob_values.quantize_gather != "none" and knob_values.offload_params:
        raise JaxparError("plan.quantize_gather quantizes weights on the device before "
                          "gathering them; it does not combine with plan.offload_params "
                          "(weights streamed from host memory)")
    if knob_values.hpz and (knob_values.quantize_gather != "none"
                            or knob_values.quantize_reduce != "none"
                            or knob_values.offload_params):
        raise JaxparError("plan.hpz gathers the weights' cross-slice part once a step in "
                          "the compute dtype: it does not combine with plan.quantize_gather, "
                          "plan.quantize_reduce or plan.offload_params")
    if knob_values.quantize_reduce != "none" and (
            knob_values.compress_gradients != "none" or knob_values.microbatches > 1
            or knob_values.offload_params):
        raise JaxparError("plan.quantize_reduce reduces each step's gradients once, by "
                          "hand: it does not combine with plan.compress_gradients, "
                          "plan.microbatches > 1 or plan.offload_params")
    precision = getattr(knob_values, "precision", None)
    if isinstance(precision, str):
        precision = Policy.parse(precision) if precision else None
    if (knob_values.quantize == "fp8" and precision is not None
            and jax.numpy.dtype(precision.compute) == jax.numpy.float16):
        raise JaxparError("plan.quantize=fp8 with float16 compute (plan.precision) is not "
                          "supported: fp8's rescaled products come back in float32, which "
                          "float16 gradients cannot take; compute in bfloat16, or use "
                          "plan.quantize=int8")
    if getattr(knob_values, "weight_copy", "auto") == "in_step" and (
            knob_values.offload_params or knob_values.offload_optimizer
            or knob_values.host_update):
        raise JaxparError("plan.weight_copy=in_step does not combine with offloaded state "
                          "(plan.offload_params, plan.offload_optimizer, "
                          "plan.host_update): the streamed weights and the update in host "
                          "memory work on the stored copy; use weight_copy: auto or stored")
    if getattr(knob_values, "grad_dtype", "compute") == "float32" and (
            knob_values.quantize != "none"):
        raise JaxparError("plan.grad_dtype=float32 widens the gradients of plain bf16 "
                          "matmuls; it does not combine with plan.quantize (the quantized "
                          "matmuls have their own gradients)")
    if knob_values.host_update and knob_values.offload_optimizer != 1:
        raise JaxparError("plan.host_update runs the optimizer update on the host and "
                          "needs all of its state there: set plan.offload_optimizer: 1 "
                          f"(it is {knob_values.offload_optimizer})")


def stores_weight_copy(weight_copy: str, zero_stage: int, *, offloaded: bool) -> bool:
    """Whether a compute-dtype copy of the weights is kept between steps under mixed
    precision: as ``weight_copy`` says, and under ``auto`` when the copy would be split
    differently from the master weights (ZeRO-1/2: whole copy, split master) or the state
    lives in host memory (the streamed weights and the host update work on the copy)."""
    if weight_copy != "auto":
        return weight_copy == "stored"
    return offloaded or zero_stage in (1, 2)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Mesh plus rules, and the training knobs that depend on them.

    Attributes:
      mesh: the device mesh (see :func:`jaxpar.make_mesh`).
      param_rules: logical name -> mesh axes for weights (and optimizer state).
      act_rules: logical name -> mesh axes for activations and the input batch.
      precision: mixed-precision policy (master, compute and output dtypes).
      zero_stage: 0-3: shard optimizer state (1), gradients (2), parameters (3) over the
        data-parallel axes (see :mod:`jaxpar.parallel.zero`).
      remat: rematerialization policy name per block (see :mod:`jaxpar.sharding.remat`).
      remat_blocks: on a model jaxpar did not write, a regex of the paths of the blocks the
        remat policy wraps (default: its repeated blocks; see
        :mod:`jaxpar.sharding.block_remat`).
      scan_blocks: on a model jaxpar did not write, run its list of uniform blocks as one
        scanned stack (``auto``, the default: when the model's loop over them is a plain
        chain, else one by one with a warning; ``True``: refuse a model whose blocks cannot
        be scanned; ``False``: leave the list as written). See
        :mod:`jaxpar.sharding.scanned`.
      microbatches: gradient accumulation: split each batch into this many microbatches and
        apply one update.
      annotations: ``(path regex, logical names)`` pairs applied to the model's variables
        before they are placed (first matching pattern wins; see :func:`jaxpar.annotate`).
      layouts: ``(path regex or module type, logical names)`` pairs pinning module outputs
        (see :func:`jaxpar.constrain_outputs`); ``"auto"`` (the default) pins the outputs of
        the model's repeated blocks and its embedding tables (see
        :func:`jaxpar.sharding.layouts.auto_layouts`), ``()`` nothing.
      sequence_parallel: Megatron sequence parallelism: the residual stream (logical
        ``residual_seq``) is split over the ``tensor`` axis between blocks, so each tensor-
        parallel all-reduce becomes a reduce-scatter and an all-gather and the norm and
        residual activations shrink by the tensor degree.
      context_attention: with a ``context`` mesh axis (sequence split across devices),
        ``"allgather"`` (each device gathers all keys and values) or ``"ring"`` (key/value
        blocks passed around the axis, online softmax); see :mod:`jaxpar.parallel.context`.
      context_balance: under context parallelism, lay the sequence out in ``2 x context``
        chunks, device ``i`` holding chunks ``i`` and ``2c - 1 - i``, so every device does
        the same share of causal attention work.
      offload_optimizer: the fraction (0 to 1) of the optimizer state's bytes (master
        weights and moments, largest tensors first) kept in host memory between steps and
        streamed through device memory for the update (see :mod:`jaxpar.parallel.offload`).
      host_update: with all optimizer state offloaded, run the update on the host
        (ZeRO-Offload): gradients go down, new weights come up.
      update_chunk: with offloaded optimizer state updated on the device, the layers whose
        state comes down at a time (tensors outside the layer stack come in pieces no
        larger; see :mod:`jaxpar.parallel.streamed_update`).
      offload_params: keep the stacked layers' weights in host memory and stream each
        layer's shard to the device as the layer loop reaches it (ZeRO-Infinity).
      quantize: ``int8`` or ``fp8`` matmuls, forward and backward, for the modules whose
        paths match ``quantize_target`` and not ``quantize_exclude`` (regular expressions
        matched against whole paths such as ``blocks/mlp/w_up``); see
        :mod:`jaxpar.sharding.quantization`.
      quantize_target: the regular expression of the module paths ``quantize`` applies to
        (matched against whole paths; the default ``.*``: every matmul not excluded).
      quantize_exclude: the regular expression of module paths ``quantize`` leaves in
        full precision even when ``quantize_target`` matches them (the default: the
        embeddings, the output head and attention).
      quantize_gather: ``int8``: weights split over the data-parallel axes (FSDP, ZeRO-3)
        are all-gathered as int8 plus per-row scales (ZeRO++'s qwZ), see
        :func:`jaxpar.parallel.zeropp.gather_int8`.
      quantize_reduce: ``int8``: gradients split over the data-parallel axes (FSDP,
        ZeRO-2/3) are reduce-scattered by int8 all-to-alls, innermost axis first
        (ZeRO++'s qgZ), see :func:`jaxpar.parallel.zeropp.reduce_int8`.
      hpz: ZeRO++'s hierarchical partitioning: weights split over ``data`` (the axis
        that spans the slices) as well as inside the slice are gathered over ``data`` once
        a step into a copy split only over the other axes, so the layers' gathers, forward
        and backward, stay inside the slice (see :func:`jaxpar.parallel.zeropp.slice_copy`).
      vocab_over_fsdp: split the vocabulary of the embedding table, the output head and
        the logits over the ``fsdp`` axis as well as ``tensor``, so the head is never
        gathered: the final hidden states are, which moves less when a step's tokens in
        an FSDP group are fewer than the vocabulary (see
        :func:`jaxpar.sharding.rules.split_vocab_over_fsdp`).
      compress_gradients: ``sign``: the gradients are averaged over the ``data`` axis one
        bit a value with error feedback, after ``compress_warmup`` exact steps (see
        :mod:`jaxpar.parallel.compression`).
      compress_warmup: the steps averaged exactly before ``compress_gradients`` starts
        compressing (0: from the first step).
      weight_copy: under mixed precision, ``stored``: the state holds a compute-dtype copy
        of the weights beside the float32 master weights, made once a step after the
        update; ``in_step``: it holds the master weights only, and the step casts them
        as it uses them (no copy between steps: its bytes, 2 a parameter over the
        devices that share the weights, are saved). ``auto`` (the default): ``in_step``
        when the copy would be stored split like the master weights (ZeRO 0 or 3, no
        offloaded state), where casting in the step costs no collective; ``stored``
        otherwise (under ZeRO-1/2 the copy is whole on each device and the master split:
        casting in the step would gather the master's pieces at every use).
      grad_dtype: what the weight gradients of the model's projection layers
        (``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``) are formed and summed over
        devices in: ``compute`` (the default: the compute dtype, bf16 under mixed
        precision) or ``float32`` (formed in float32 and summed over the devices that split
        the batch in float32, twice the bytes of a bf16 reduction, then rounded to the
        compute dtype once). Either way microbatches are accumulated and the update
        applied in float32. See :func:`jaxpar.sharding.precision.widen_weight_gradients`.
    """

    mesh: Mesh
    param_rules: Rules
    act_rules: Rules
    precision: Policy = knob(Policy(), parse=Policy.parse)
    zero_stage: int = knob(0, choices=(0, 1, 2, 3))
    remat: str = knob("none", check=remat_lib.is_policy, valid=remat_lib.VALID)
    remat_blocks: str = knob("", check=quantization.is_pattern,
                             valid="must be a valid regular expression")
    scan_blocks: str | bool = knob("auto", check=lambda v: v in ("auto", True, False),
                                   valid="choose auto, true or false")
    microbatches: int = knob(1, check=lambda v: v >= 1, valid="must be at least 1")
    annotations: tuple = knob(())
    layouts: tuple | str = knob("auto", check=lambda v: not isinstance(v, str) or v == "auto",
                                valid="give a list of [target, [names]] pairs, 'auto' (pin "
                                      "repeated blocks' outputs) or [] (nothing)")
    sequence_parallel: bool = knob(False)
    context_attention: str = knob("allgather", choices=CONTEXT_ATTENTION)
    context_balance: bool = knob(True)
    offload_optimizer: float = knob(0.0, check=lambda v: 0 <= v <= 1,
                                    valid="must be a fraction from 0 (none) to 1 (all)")
    host_update: bool = knob(False)
    update_chunk: int = knob(1, check=lambda v: v >= 1, valid="must be at least 1")
    offload_params: bool = knob(False)
    quantize: str = knob("none", choices=quantization.MODES)
    quantize_target: str = knob(quantization.DEFAULT_TARGET, check=quantization.is_pattern,
                                valid="must be a valid regular expression")
    quantize_exclude: str = knob(quantization.DEFAULT_EXCLUDE, check=quantization.is_pattern,
                                 valid="must be a valid regular expression")
    quantize_gather: str = knob("none", choices=("none", "int8"))
    quantize_reduce: str = knob("none", choices=("none", "int8"))
    hpz: bool = knob(False)
    vocab_over_fsdp: bool | str = knob(False, choices=(False, True, "auto"))
    compress_gradients: str = knob("none", choices=("none", "sign"))
    compress_warmup: int = knob(0, check=lambda v: v >= 0, valid="must be 0 or more")
    weight_copy: str = knob("auto", choices=WEIGHT_COPY)
    grad_dtype: str = knob("compute", choices=GRAD_DTYPES)

    def __post_init__(self) -> None:
        for f in knobs():
            object.__setattr__(self, f.name, check_knob(f.name, getattr(self, f.name)))
            if f.name in AUTO_KNOBS and getattr(self, f.name) == "auto":
                raise JaxparError(f"Plan({f.name}='auto'): auto is resolved from a run "
                                  "config (jaxpar.planner.auto.resolve_auto); a Plan takes "
                                  "true or false")
        check_knob_pairs(self)
        rule = Rules([_SEQUENCE_PARALLEL]).rules[0]
        if self.sequence_parallel and rule not in self.act_rules.rules:
            object.__setattr__(self, "act_rules",
                               self.act_rules.extend([_SEQUENCE_PARALLEL], first=True))
        elif not self.sequence_parallel and rule in self.act_rules.rules:  # replace(...=False)
            kept = [r for r in self.act_rules.rules if r != rule]
            object.__setattr__(self, "act_rules", Rules(kept, strict=self.act_rules.strict))
        params, acts = rules_lib.split_vocab_over_fsdp(self.param_rules, self.act_rules,
                                                       self.vocab_over_fsdp)
        object.__setattr__(self, "param_rules", params)
        object.__setattr__(self, "act_rules", acts)
        object.__setattr__(self, "annotations", pairs(self.annotations, "plan.annotations"))
        if self.layouts != "auto":
            object.__setattr__(self, "layouts", pairs(self.layouts, "plan.layouts"))

    @classmethod
    def from_preset(cls, mesh: Mesh, name: str = "fsdp_tp", *, strict: bool = False,
                    **knobs) -> Plan:
        """A plan with one of the named rule presets (see :func:`jaxpar.sharding.rules.preset`);
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
        ``with_sharding_constraint`` on an ``Auto`` mesh, ``reshard`` on an explicit one.
        Inside ``shard_map`` (a pipeline schedule's stage) the sharding is restated on the
        context's mesh, whose mapped axes are manual."""
        sharding = _on_context_mesh(sharding)
        if self.explicit:
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)

    def shard_map(self, fn: Callable, *, in_specs: Any, out_specs: Any, **options: Any
                  ) -> Callable:
        """``jax.shard_map(fn)`` over the plan's mesh; inside another ``shard_map`` (gradient
        accumulation over ``data`` by hand, a pipeline stage), over the enclosing one's
        mesh with its manual axes dropped from the specs (each device holds its share of
        them already)."""
        context = jax.sharding.get_abstract_mesh()
        if context.empty or not context.manual_axes:
            return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                 **options)
        manual = set(context.manual_axes)
        drop = lambda spec: _without(spec, manual)
        is_spec = lambda x: isinstance(x, PartitionSpec)
        return jax.shard_map(fn, mesh=context,
                             in_specs=jax.tree.map(drop, in_specs, is_leaf=is_spec),
                             out_specs=jax.tree.map(drop, out_specs, is_leaf=is_spec),
                             axis_names=set(context.axis_names) - manual, **options)

    @property
    def stores_weight_copy(self) -> bool:
        """Whether a mixed-precision run keeps a compute-dtype copy of its weights between
        steps (``weight_copy``, ``auto`` resolved; see :func:`stores_weight_copy`)."""
        return stores_weight_copy(self.weight_copy, self.zero_stage, offloaded=bool(
            self.offload_params or self.offload_optimizer or self.host_update))

    @property
    def replicated(self) -> NamedSharding:
        """The sharding of a fully replicated array (scalars, step counters)."""
        return NamedSharding(self.mesh, PartitionSpec())

    def activation_sharding(self, names: LogicalNames, shape: tuple[int, ...]
                            ) -> NamedSharding:
        """The sharding an activation of ``shape`` with logical ``names`` takes."""
        return self.sharding(self.act_spec(names, shape=shape, path="activation"))

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
        because ``nnx.eval_shape`` under a mesh reads logical names as mesh axes. A mesh
        of devices that can only be compiled for (a TPU topology's) is set as the abstract
        mesh alone."""
        token = _ACTIVE.set(self)
        if not mesh_context:
            context = contextlib.nullcontext()
        elif compile_only(self.mesh):  # no memory behind it: only its abstract mesh is set
            context = jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)
        else:
            context = jax.set_mesh(self.mesh)
        try:
            with nnx.use_eager_sharding(False), context:
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
                   if self.mesh.shape.get("context", 1) > 1 else "")
                + (f", optimizer offload {self.offload_optimizer:g}"
                   + (" (update on host)" if self.host_update else "")
                   if self.offload_optimizer else "")
                + (", weights streamed from host" if self.offload_params else ""))


def batch_names(ndim: int) -> tuple[str | None, ...]:
    """Logical names of a batch leaf: ``batch`` on the leading axis, the rest whole.

    Token ids are small and their sequence (``seq + 1`` long, for next-token targets)
    rarely splits evenly, so under context parallelism the model splits the sequence at
    its first activation instead."""
    return ("batch", *(None,) * max(ndim - 1, 0))[:ndim]


def current_plan() -> Plan | None:
    """The plan activated by the innermost ``plan.activate()``, or None."""
    return _ACTIVE.get()


def _on_context_mesh(sharding: Any) -> Any:
    """``sharding`` (a pytree of them) on the abstract mesh of the enclosing
    ``shard_map``, when there is one with manual axes; unchanged otherwise."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty or not context.manual_axes:
        return sharding
    manual = set(context.manual_axes)
    return jax.tree.map(lambda s: NamedSharding(context, _without(s.spec, manual))
                        if isinstance(s, NamedSharding) else s, sharding)


def _without(spec: PartitionSpec, manual: set[str]) -> PartitionSpec:
    """``spec`` naming none of ``manual``: the axes an enclosing ``shard_map`` maps, which
    each device holds its share of already."""
    return PartitionSpec(*(axes_entry(a for a in entry_axes(e) if a not in manual)
                           for e in spec))


def explicit_sharding(names: LogicalNames, shape: tuple[int, ...]) -> NamedSharding | None:
    """The sharding an activation of ``shape`` with logical ``names`` takes under the
    current plan when its mesh is explicit (where an operation whose result sharding is
    ambiguous, a contraction over a split dimension, must be told it); None otherwise."""
    plan = _ACTIVE.get()
    if plan is None or not plan.explicit:
        return None
    return plan.activation_sharding(names, shape)


def constrain(x: jax.Array, names: LogicalNames) -> jax.Array:
    """Constrain activation ``x`` to the sharding its logical names imply under the current plan.

    Use inside model code: ``x = jaxpar.constrain(x, ("batch", "seq", "embed"))``. With no
    active plan (for example in a plain single-device run) it returns ``x`` unchanged.
    """
    plan = _ACTIVE.get()
    if plan is None:
        return x
    return plan.place(x, plan.activation_sharding(names, x.shape))

