"""Pipeline parallelism as vectorized stages, the GSPMD way.

A stack of identical blocks is stored with two leading axes, ``(repeat, stage, ...)``,
named ``("repeat", "stage", ...)``: layer ``r * S + s`` lives at ``[r, s]`` (with ``L``
layers per stage, layer ``(c * S + s) * L + j`` at ``[c * L + j, s]``). The ``stage``
dimension is sharded over the ``stage`` mesh axis by the parameter rules, so each device
holds only the layers of its own stages, and the same storage layout serves training,
checkpoints and inspection; no weight ever moves between stages.

The batch is split into ``M`` microbatches. A buffer holds one microbatch activation per
stage, shaped ``(S, microbatch, ...)`` and sharded over ``stage``. Each iteration every
stage applies its current layer to its slot at once (``jax.vmap`` with
``spmd_axis_name="stage"``, so the blocks' own activation constraints gain the stage
axis), then the buffer rolls by one along the stage dimension, which XLA lowers to a
``collective-permute`` between neighbouring stages; stage 0 takes the next fresh
microbatch instead.

Circular schedule: with ``R`` repeats, stage ``s`` holds layers ``s, s + S, s + 2S, ...``
and a microbatch leaving the last stage goes round to stage 0 again for its next repeat.
Stage 0 processes ``M`` microbatches per repeat, so the last stage's output for
microbatch ``m`` is needed ``M - S + 1`` iterations after it is made: with ``M = S`` it
feeds straight back, with ``M > S`` it waits in a circular buffer held on the stage-0
devices. ``R * M + S - 1`` iterations run in all, so the bubble (idle stage-iterations)
is ``(S - 1) / (R * M + S - 1)`` instead of GPipe's ``(S - 1) / (M + S - 1)``.

Bubble iterations compute on zeros (or on stale values) whose results are never read;
their gradients are exactly zero. Embedding and head stay outside the pipeline.

Here ``jax.grad`` runs the backward pass over the whole forward loop, so every stage keeps
its activations of all ``M`` microbatches; the ``1f1b`` and ``interleaved_1f1b`` kinds of
:class:`Schedule` (run by :mod:`jaxpar.parallel.schedules`, on the same storage layout)
keep about ``S``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.parallel.schedules import peak_in_flight, stack_layers, unstack_layers
from jaxpar.sharding.annotations import _NAME_KEYS, logical_names
from jaxpar.sharding.plan import constrain

LAYERS, REPEAT, STAGE = "layers", "repeat", "stage"
DEFAULT_ACT_NAMES: tuple[str, ...] = ("batch", "seq", "embed")
"""Logical names of one microbatch of the residual stream of jaxpar's reference model."""



def manual_batch_axes(plan: Any, batch: int, microbatches: int) -> tuple[str, ...]:
    """The data-parallel axes a tick-by-tick schedule can split its microbatches over by
    hand (:func:`jaxpar.parallel.schedules.pipeline_value_and_grad`'s ``batch_axes``), so
    that the weight gradients are summed over them once after the schedule, not in every
    backward tick: ``data`` when the batch is split over it, no parameter rule shards a
    weight over it (ZeRO-3 would), and it divides every microbatch. Empty otherwise (GSPMD
    then reduces each tick's gradients over the axis)."""
    mesh = plan.mesh
    if mesh.shape.get("data", 1) <= 1 or "data" not in plan.data_parallel_axes:
        return ()
    if plan.zero_stage >= 3 or any("data" in axes for _, axes in plan.param_rules.rules):
        return ()
    if microbatches <= 0 or batch % microbatches or (batch // microbatches) % mesh.shape["data"]:
        return ()
    return ("data",)


# --- Schedule and reporting ----------------------------------------------------------------
KINDS: tuple[str, ...] = ("gpipe", "circular", "1f1b", "interleaved_1f1b")
"""Pipeline schedules: ``gpipe`` and ``circular`` run the forward pass here and let
``jax.grad`` run it backwards; ``1f1b`` and ``interleaved_1f1b`` run forward and backward
tick by tick (:mod:`jaxpar.parallel.schedules`)."""


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Theoretical fraction of idle stage-iterations: ``(S - 1) / (R * M + S - 1)``.

    ``repeats=1`` is GPipe's ``(S - 1) / (M + S - 1)``. Every schedule here has this
    bubble (1F1B moves work, not idle time); Megatron states it as idle over busy time,
    ``(S - 1) / (R * M)``.
    """
    _check_positive(stages=stages, microbatches=microbatches, repeats=repeats)
    return (stages - 1) / (repeats * microbatches + stages - 1)


def describe_schedule(stages: int, microbatches: int, repeats: int = 1) -> str:
    """One line for logs and the CLI, e.g.
    ``pipeline: S=2 stages x R=2 repeats, M=4 microbatches, 9 iterations, bubble 11.1%``."""
    return Schedule(stages, microbatches, repeats).describe()


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if int(value) != value or value < 1:
            raise JaxparError(f"pipeline {name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``stages`` (S), ``microbatches`` (M), ``repeats`` (R), the
    schedule ``kind`` and ``layers_per_stage`` (L, layers in each of a stage's chunks).

    The model has ``S * R * L`` layers. A stage holds ``R`` chunks of ``L`` consecutive
    layers: chunk ``c`` of stage ``s`` is layers ``(c * S + s) * L ... + L - 1``, so with
    ``R > 1`` (``circular``, ``interleaved_1f1b``) a microbatch goes round the stages ``R``
    times. ``kind`` defaults to ``circular`` when ``R > 1``, else ``gpipe``; ``gpipe`` and
    ``1f1b`` take ``R = 1``. ``R > 1`` needs ``M >= S`` (a microbatch must leave the last
    stage before stage 0 needs it again), ``interleaved_1f1b`` ``M`` a multiple of ``S``.
    """

    stages: int
    microbatches: int
    repeats: int = 1
    kind: str = ""
    layers_per_stage: int = 1

    def __post_init__(self) -> None:
        _check_positive(stages=self.stages, microbatches=self.microbatches,
                        repeats=self.repeats, layers_per_stage=self.layers_per_stage)
        if not self.kind:
            object.__setattr__(self, "kind", "circular" if self.repeats > 1 else "gpipe")
        if self.kind not in KINDS:
            raise JaxparError(f"pipeline.schedule={self.kind!r}: choose one of "
                              f"{', '.join(KINDS)}")
        if self.kind in ("gpipe", "1f1b") and self.repeats != 1:
            other = "circular" if self.kind == "gpipe" else "interleaved_1f1b"
            raise JaxparError(f"pipeline.schedule={self.kind} runs one chunk per stage, got "
                              f"repeats={self.repeats}; use {other} or repeats=1")
        if self.repeats > 1 and self.microbatches < self.stages:
            raise JaxparError(
                f"a circular pipeline (repeats={self.repeats}) needs microbatches >= stages, "
                f"got microbatches={self.microbatches} < stages={self.stages}; raise "
                f"pipeline.microbatches or use repeats=1"
            )
        if self.kind == "interleaved_1f1b" and self.microbatches % self.stages:
            raise JaxparError(f"pipeline.schedule=interleaved_1f1b needs microbatches "
                              f"divisible by stages, got microbatches={self.microbatches}, "
                              f"stages={self.stages}")

    @classmethod
    def for_model(cls, n_layers: int, stages: int, microbatches: int = 0,
                  repeats: int = 0, layers_per_stage: int = 0, kind: str = ""
                  ) -> Schedule:
        """The schedule for a model of ``n_layers`` on ``stages`` stages, filling defaults.

        ``microbatches=0`` means one per stage (``M = S``). ``kind`` ``""`` means
        ``circular``. For ``gpipe`` and ``1f1b``, ``layers_per_stage=0`` means all of a
        stage's ``n_layers / stages``; for ``circular`` and ``interleaved_1f1b`` whichever
        of ``repeats`` and ``layers_per_stage`` is 0 is filled from the other, and with
        both 0 a stage runs one layer a chunk, as many repeats as it has layers (the
        smallest bubble).

        Raises:
          JaxparError: when ``n_layers`` is not ``stages * repeats * layers_per_stage``.
        """
        _check_positive(n_layers=n_layers, stages=stages)
        kind = kind or "circular"
        if n_layers % stages:
            raise JaxparError(f"model.n_layers={n_layers} is not divisible by "
                              f"{stages} pipeline stages (mesh.stage)")
        per_stage = n_layers // stages
        if kind in ("gpipe", "1f1b"):
            repeats = repeats or 1
            layers_per_stage = layers_per_stage or per_stage // repeats
        elif repeats and not layers_per_stage:
            layers_per_stage = max(per_stage // repeats, 1)
        else:
            layers_per_stage = layers_per_stage or 1
            repeats = repeats or max(per_stage // layers_per_stage, 1)
        if stages * repeats * layers_per_stage != n_layers:
            raise JaxparError(
                f"model.n_layers={n_layers} must equal stages x repeats x layers_per_stage = "
                f"{stages} x {repeats} x {layers_per_stage} (pipeline.schedule={kind}); "
                f"pick pipeline.repeats x pipeline.layers_per_stage = {per_stage}")
        return cls(stages, microbatches or stages, repeats, kind, layers_per_stage)

    @property
    def layers(self) -> int:
        """Number of layers the schedule runs: ``S * R * L``."""
        return self.stages * self.repeats * self.layers_per_stage

    @property
    def backward_in_schedule(self) -> bool:
        """Whether the schedule runs the backward pass itself (1F1B and interleaved)."""
        return self.kind in ("1f1b", "interleaved_1f1b")

    @property
    def iterations(self) -> int:
        """Pipeline iterations of the forward pass: ``R * M + S - 1`` (the 1F1B schedules
        run twice as many ticks, a forward and a backward slot each)."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """See :func:`bubble_fraction`."""
        return bubble_fraction(self.stages, self.microbatches, self.repeats)

    @property
    def in_flight(self) -> int:
        """Most (microbatch, chunk) activations a stage keeps at once for its backward
        pass: all ``R * M`` under gpipe and circular, ``min(M, S)`` under 1F1B, about
        ``(R + 1) * S`` interleaved."""
        if not self.backward_in_schedule:
            return self.repeats * self.microbatches
        return peak_in_flight(self.kind, self.stages, self.microbatches, self.repeats)

    def position(self, layer: int) -> tuple[int, int]:
        """Where layer ``layer`` is stored in the pipeline layout: ``(row, stage)``."""
        chunk, j = divmod(layer, self.layers_per_stage)
        c, s = divmod(chunk, self.stages)
        return c * self.layers_per_stage + j, s

    def layer_at(self, row: int, stage: int) -> int:
        """Inverse of :meth:`position`: the layer stored at ``[row, stage]``."""
        c, j = divmod(row, self.layers_per_stage)
        return (c * self.stages + stage) * self.layers_per_stage + j

    def describe(self) -> str:
        """One line for logs and the CLI: sizes, ticks, bubble and activations kept."""
        layers = f" x L={self.layers_per_stage} layers" if self.layers_per_stage > 1 else ""
        buffered = (", buffered" if self.kind == "circular" and self.microbatches > self.stages
                    else "")
        steps = (f"{2 * self.iterations} ticks" if self.backward_in_schedule
                 else f"{self.iterations} iterations")
        return (f"pipeline {self.kind}: S={self.stages} stages x R={self.repeats} repeats"
                f"{layers}, M={self.microbatches} microbatches ({steps}{buffered}), "
                f"bubble {100 * self.bubble:.1f}%, {self.in_flight} activations in flight "
                "per stage")


# --- Storage layout: ("layers", ...) <-> ("repeat", "stage", ...) --------------------------
def _renamed(variable: nnx.Variable, value: Any, names: tuple[str | None, ...]) -> nnx.Variable:
    new = variable.replace(value)
    metadata = variable.get_metadata()
    for key in _NAME_KEYS:
        if metadata.get(key):
            new.set_metadata(key, names)
            break
    return new


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def to_pipeline_layout(tree: Any, stages: int, layers_per_stage: int = 1) -> Any:
    """Restack every variable whose leading logical axis is ``"layers"`` as (repeat, stage).

    ``tree`` is any pytree of ``nnx.Variable`` s (an ``nnx.State`` of a model, its
    gradients, optimizer state built from it). A variable shaped ``(n, ...)`` named
    ``("layers", ...)`` becomes ``(n // stages, stages, ...)`` named
    ``("repeat", "stage", ...)`` by :func:`stack_layers` (with ``layers_per_stage`` 1,
    layer ``r * stages + s`` lands at ``[r, s]``: a pure reshape). Variables without a
    leading ``"layers"`` axis are returned unchanged.

    Raises:
      JaxparError: when a stacked variable's layer count is not a multiple of
        ``stages * layers_per_stage``.
    """
    _check_positive(stages=stages, layers_per_stage=layers_per_stage)

    def one(path, variable):
        if not _is_variable(variable):
            return variable
        names = logical_names(variable)
        if not names or names[0] != LAYERS:
            return variable
        value = variable.get_value()
        if value.shape[0] % (stages * layers_per_stage):
            raise JaxparError(
                f"{jax.tree_util.keystr(path)} stacks {value.shape[0]} layers, not a multiple "
                f"of {stages} pipeline stages x {layers_per_stage} layers per stage"
            )
        value = stack_layers(value, stages, layers_per_stage)
        return _renamed(variable, value, (REPEAT, STAGE, *names[1:]))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_variable)


def from_pipeline_layout(tree: Any, layers_per_stage: int = 1) -> Any:
    """Inverse of :func:`to_pipeline_layout`: ``("repeat", "stage", ...)`` -> ``("layers", ...)``.

    Use it to compare with, or to save a checkpoint for, an unpipelined model.
    """

    def one(variable):
        if not _is_variable(variable):
            return variable
        names = logical_names(variable)
        if not names or tuple(names[:2]) != (REPEAT, STAGE):
            return variable
        value = unstack_layers(variable.get_value(), layers_per_stage)
        return _renamed(variable, value, (LAYERS, *names[2:]))

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def relayout_module(module: nnx.Module, stages: int, layers_per_stage: int = 1
                    ) -> nnx.Module:
    """A copy of ``module`` (e.g. an ``nnx.vmap``-stacked block) in the pipeline layout."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, to_pipeline_layout(state, stages, layers_per_stage))


# --- The transform ------------------------------------------------------------------------
def pipeline(
    fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: jax.Array,
    *,
    microbatches: int,
    act_names: Sequence[str | None] = DEFAULT_ACT_NAMES,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
    unroll: int | bool = 1,
    layers_per_stage: int = 1,
) -> jax.Array:
    """Apply ``R * S * L`` stacked layers to ``x`` as an ``S``-stage, ``M``-microbatch pipeline.

    Numerically it equals applying layers ``0, 1, ..., R*S - 1`` in order to every row of
    ``x`` (``fn(layer_params, h)`` each time), but the layers of different stages run at
    once on different microbatches.

    Args:
      fn: ``fn(layer_params, h) -> h`` for one layer; ``h`` is one microbatch, shaped like
        ``x`` with a smaller leading (batch) dimension. Its output is cast to ``x.dtype``,
        the dtype of the pipeline's activation buffers.
      params: pytree whose leaves are shaped ``(R * L, S, ...)`` (see
        :func:`to_pipeline_layout`).
      x: the input, ``(batch, ...)``; ``batch`` must be divisible by ``microbatches``.
      microbatches: ``M``; for ``R > 1`` at least ``S``.
      act_names: logical names of one microbatch's dimensions (``("batch", "seq",
        "embed")`` for a transformer's residual stream). The state buffer gets
        ``("stage", *act_names)``.
      remat: recompute each stage's forward pass in the backward pass (``jax.checkpoint``),
        with ``remat_policy`` if given.
      unroll: passed to ``lax.scan`` over the iterations (``True`` unrolls fully, which lets
        XLA's cost analysis count every iteration).
      layers_per_stage: ``L``, the layers each stage applies (one after the other) to a
        microbatch per iteration.

    Returns:
      The output, shaped like ``x``.
    """
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise JaxparError("pipeline params are empty")
    if any(leaf.ndim < 2 or leaf.shape[:2] != leaves[0].shape[:2] for leaf in leaves):
        shapes = sorted({tuple(leaf.shape) for leaf in leaves})
        raise JaxparError(f"pipeline params must all lead with (repeat, stage), got {shapes}")
    rows, stages = (int(d) for d in leaves[0].shape[:2])
    if rows % layers_per_stage:
        raise JaxparError(f"pipeline params lead with {rows} rows, not a multiple of "
                          f"layers_per_stage={layers_per_stage}")
    repeats = rows // layers_per_stage
    sched = Schedule(stages, microbatches, repeats, layers_per_stage=layers_per_stage)
    names = tuple(act_names)
    if len(names) != x.ndim:
        raise JaxparError(f"act_names {names} do not match the input's shape {x.shape}")
    batch, rest = x.shape[0], tuple(x.shape[1:])
    if batch % microbatches:
        raise JaxparError(
            f"batch size {batch} is not divisible by pipeline.microbatches={microbatches}"
        )
    mb, n_iter = batch // microbatches, sched.iterations
    state_names, buffer_names = (STAGE, *names), (STAGE, None, *names)

    # Microbatch m takes rows m, m + M, m + 2M, ...: a batch split in contiguous blocks over
    # the data axes then splits every microbatch evenly over them, with no communication.
    xs = constrain(x.reshape(mb, microbatches, *rest).swapaxes(0, 1), (None, *names))
    first_stage = (jnp.arange(stages) == 0).reshape(stages, *(1,) * x.ndim)
    stage_ids = jnp.arange(stages)

    def stage_weights(params, t):
        # Stage s runs repeat (t - s) // M, clipped: with S <= M either the repeat of
        # stage 0 or the one before it. Both are sliced with one index for every stage
        # and each stage picks its own, so no index is batched over the stages: XLA's
        # GPU compiler rejects the transpose of a gather batched over them.
        newest = jnp.clip(t // microbatches, 0, repeats - 1)
        older = jnp.clip(t // microbatches - 1, 0, repeats - 1)
        repeat = jnp.clip((t - stage_ids) // microbatches, 0, repeats - 1)
        use_newest = (repeat == newest).reshape(stages, 1)

        def one(a):
            take = lambda r: jax.lax.dynamic_slice_in_dim(a, r * layers_per_stage,
                                                          layers_per_stage, 0)
            if repeats == 1:
                chunk = a
            else:
                mask = use_newest.reshape(1, stages, *(1,) * (a.ndim - 2))
                chunk = jnp.where(mask, take(newest), take(older))
            chunk = jnp.swapaxes(chunk, 0, 1)  # (S, L, ...)
            return chunk if layers_per_stage > 1 else chunk[:, 0]

        return jax.tree.map(one, params)

    def stage_step(layer, h):
        if layers_per_stage > 1:  # the chunk's layers, one after the other
            return jax.lax.scan(lambda h, lp: (fn(lp, h).astype(h.dtype), None), h, layer)[0]
        return fn(layer, h).astype(h.dtype)

    stages_at_once = jax.vmap(stage_step, spmd_axis_name=STAGE)

    def all_stages(params, t, h):
        return stages_at_once(stage_weights(params, t), h)

    if remat:  # the gather inside: only the stored weights are kept, not each iteration's
        all_stages = jax.checkpoint(all_stages, policy=remat_policy)

    state = constrain(jnp.where(first_stage, xs[0], jnp.zeros((), x.dtype)), state_names)
    # buffer[0, m] (on the stage-0 devices) holds the last stage's latest output for
    # microbatch m; rows 1.. are scratch, kept so that every write is local to a stage.
    buffer = constrain(jnp.zeros((stages, microbatches, mb, *rest), x.dtype), buffer_names)

    def body(carry, t):
        state, buffer = carry
        out = constrain(all_stages(params, t, state), state_names)
        # Shift one stage on: stage s + 1 receives stage s's output, stage 0 the last one's.
        shifted = constrain(jnp.roll(out, 1, axis=0), state_names)
        # The last stage finished slot t - (S - 1), i.e. microbatch (t - S + 1) mod M. Early
        # (t < S - 1) writes are garbage and are overwritten before anything reads them.
        column = (t - (stages - 1)) % microbatches
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, shifted, column, axis=1)
        buffer = constrain(buffer, buffer_names)
        nxt = (t + 1) % microbatches
        fresh = jax.lax.dynamic_index_in_dim(xs, nxt, 0, keepdims=False)
        if repeats > 1:
            again = jax.lax.dynamic_index_in_dim(buffer, nxt, 1, keepdims=False)
            fresh = jnp.where(t + 1 < microbatches, fresh[None], again)
        state = constrain(jnp.where(first_stage, fresh, shifted), state_names)
        return (state, buffer), None

    (_, buffer), _ = jax.lax.scan(body, (state, buffer), jnp.arange(n_iter), unroll=unroll)
    # Bring the finished microbatches from the stage-0 devices to every stage (one
    # all-reduce of the output over the stage axis), then undo the microbatch split.
    outs = jnp.sum(jnp.where(first_stage[:, None], buffer, jnp.zeros((), x.dtype)), axis=0)
    outs = constrain(outs, (None, *names))
    return constrain(outs.swapaxes(0, 1).reshape(batch, *rest), names)


def pipeline_module(
    blocks: nnx.Module,
    x: jax.Array,
    call: Callable[[nnx.Module, jax.Array], jax.Array] | None = None,
    *,
    microbatches: int,
    act_names: Sequence[str | None] = DEFAULT_ACT_NAMES,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
    unroll: int | bool = 1,
    layers_per_stage: int = 1,
) -> jax.Array:
    """:func:`pipeline` over an NNX module stacked in the pipeline layout.

    ``blocks`` is one module whose variables all lead with ``(repeat, stage)`` (build it
    with ``nnx.vmap`` and :func:`relayout_module`); ``call(block, h)`` applies one layer
    (default ``block(h)``). Stateful updates inside blocks (batch-norm statistics, say)
    are not carried out of the pipeline.
    """
    graphdef, state = nnx.split(blocks)
    call = call or (lambda block, h: block(h))

    def fn(layer_state, h):
        return call(nnx.merge(graphdef, layer_state), h)

    return pipeline(fn, state, x, microbatches=microbatches, act_names=act_names, remat=remat,
                    remat_policy=remat_policy, unroll=unroll, layers_per_stage=layers_per_stage)
