"""Pipeline stages for a model of yours: an embedding, a stack of identical blocks, a head.

jaxpar's pipeline executors (:mod:`jaxpar.parallel.pipeline` for ``gpipe`` and
``circular``, :mod:`jaxpar.parallel.schedules` for ``1f1b`` and ``interleaved_1f1b``) run a
stack of identical layers. A model you wrote reaches them when it divides into three
parts, which a :class:`StageSplit` names:

* ``embed(model, inputs) -> h``: everything before the blocks (token lookup, positions),
  giving one activation ``h`` shaped ``(batch, ...)``, by default ``(batch, seq, embed)``;
* ``blocks``: the path of the blocks, a list (``nnx.List``) of modules of one class or
  one module stacked over a leading ``layers`` axis (``nnx.vmap``/``nnx.scan``); by
  default the model's only repeated blocks (:func:`~jaxpar.sharding.blocks.repeated_blocks`);
* ``head(model, h) -> logits``: everything after them (final norm, output projection).

``call(block, h) -> h`` applies one block (default ``block(h)``); build anything else a
block needs (a causal mask, rotary tables) inside it, from ``h``'s shape: the 1F1B
executors run it inside a ``shard_map`` where nothing may be closed over.

:func:`stage_model` moves the blocks out of your model into one stacked module in the
pipeline layout (``("repeat", "stage", ...)``, sharded over the ``stage`` mesh axis) and
returns a :class:`StagedModel` that holds both; the same weights, in the same order, so
it computes what your model computes. :meth:`StagedModel.unstaged` gives your model back
with its blocks in their original container. For example::

    split = jaxpar.StageSplit(embed=lambda m, t: m.embed(t), blocks="layers",
                              head=lambda m, h: m.lm_head(m.norm(h)))
    staged = jaxpar.stage_model(MyLM(rngs=nnx.Rngs(0)), split, stages=4, schedule="1f1b")
    model = jaxpar.init_sharded(lambda: staged, plan)  # or build it inside the lambda

The plan's remat policy and streamed weights (``plan.offload_params``) apply to each
block inside the pipeline, as on jaxpar's own model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.parallel import loss as loss_lib
from jaxpar.parallel import offload
from jaxpar.parallel import schedules as schedules_lib
from jaxpar.parallel.pipeline import (
    DEFAULT_ACT_NAMES,
    LAYERS,
    REPEAT,
    STAGE,
    Schedule,
    manual_batch_axes,
    pipeline_module,
)
from jaxpar.parallel.schedules import stack_layers, unstack_layers
from jaxpar.sharding import remat as remat_lib
from jaxpar.sharding.annotations import _NAME_KEYS, logical_names
from jaxpar.sharding.blocks import repeated_blocks, stacked_over_layers
from jaxpar.sharding.plan import current_plan

Call = Callable[[nnx.Module, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """How a model divides into the three parts a pipeline runs (see the module docstring).

    ``embed(model, inputs) -> h`` and ``head(model, h) -> logits`` receive the model
    without its blocks; ``blocks`` is their path (``"layers"``, ``"decoder/layers"``; empty:
    the model's only repeated blocks); ``call(block, h) -> h`` applies one block;
    ``act_names`` are the logical names of ``h``'s dimensions.
    """

    embed: Callable[[nnx.Module, Any], jax.Array]
    head: Callable[[nnx.Module, jax.Array], jax.Array]
    blocks: str = ""
    call: Call | None = None
    act_names: tuple[str | None, ...] = DEFAULT_ACT_NAMES


def _stack_names(variable: nnx.Variable, ndim: int, lead: tuple[str, ...]) -> tuple:
    """``lead`` + the names of ``variable``'s per-layer dimensions (``ndim`` of them)."""
    names = logical_names(variable)
    if names and names[0] == LAYERS:
        names = names[1:]
    names = tuple(names or ())
    return (*lead, *names, *(None,) * (ndim - len(names)))


def _with_names(variable: nnx.Variable, value: Any, names: tuple) -> nnx.Variable:
    new = variable.replace(value)
    key = next((k for k in _NAME_KEYS if variable.get_metadata().get(k) is not None),
               "out_sharding")
    new.set_metadata(key, names)
    return new


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _walk(model: nnx.Module, path: str) -> tuple[Any, str]:
    """The module holding the attribute at ``path`` (None if there is none) and its name."""
    parent: Any = model
    *keys, last = path.strip("/").split("/")
    for key in keys:
        parent = parent[int(key)] if key.isdigit() else getattr(parent, key, None)
    return parent, last


def _locate(model: nnx.Module, path: str) -> tuple[Any, str, Any, str]:
    """``(parent, key, container, path)`` of the blocks at ``path`` (default: the model's only
    repeated blocks)."""
    if not path:
        found = repeated_blocks(model)
        owners = sorted({p.rpartition("/")[0] if p.rpartition("/")[2].isdigit() else p
                         for p, _ in found})
        if len(owners) != 1:
            what = ", ".join(owners) if owners else "none"
            raise JaxparError(f"cannot tell which blocks to pipeline (repeated blocks found: "
                              f"{what}): name them with StageSplit(blocks=PATH)")
        path = owners[0]
    parent, last = _walk(model, path)
    container = getattr(parent, last, None) if parent is not None else None
    if container is None:
        raise JaxparError(f"StageSplit(blocks={path!r}): {type(model).__name__} has no "
                          f"attribute at that path")
    return parent, last, container, path


def _stacked_state(container: Any, path: str) -> tuple[nnx.GraphDef, Any, int, str]:
    """The blocks as ``(graphdef of one block, state with a leading layer axis, number of
    blocks, container kind)``."""
    if isinstance(container, nnx.List | list | tuple):
        blocks = list(container)
        if len(blocks) < 2 or not all(isinstance(b, nnx.Module) for b in blocks) or len(
                {type(b) for b in blocks}) != 1:
            raise JaxparError(f"StageSplit(blocks={path!r}) must be a list of two or more "
                              "modules of one class")
        splits = [nnx.split(b) for b in blocks]
        graphdef = splits[0][0]
        if any(g != graphdef for g, _ in splits):
            raise JaxparError(f"the blocks at {path!r} differ in structure: a pipeline "
                              "stacks identical blocks")

        def stack(*variables):
            value = jnp.stack([v.get_value() for v in variables])
            return _with_names(variables[0], value,
                               _stack_names(variables[0], value.ndim - 1, (LAYERS,)))

        state = jax.tree.map(stack, *(s for _, s in splits), is_leaf=_is_variable)
        return graphdef, state, len(blocks), type(container).__name__
    if isinstance(container, nnx.Module) and stacked_over_layers(container):
        graphdef, state = nnx.split(container)
        sizes = {v.get_value().shape[0] for v in jax.tree.leaves(state, is_leaf=_is_variable)
                 if getattr(v.get_value(), "ndim", 0)}
        if len(sizes) != 1:
            raise JaxparError(f"the module at {path!r} is not one stack of blocks over a "
                              f"leading layers axis (leading sizes {sorted(sizes)})")
        state = jax.tree.map(lambda v: _with_names(v, v.get_value(), _stack_names(
            v, v.get_value().ndim - 1, (LAYERS,))), state, is_leaf=_is_variable)
        return graphdef, state, sizes.pop(), "stack"
    raise JaxparError(f"StageSplit(blocks={path!r}) is a {type(container).__name__}, not a "
                      "list of blocks or a module stacked over a leading 'layers' axis "
                      "(nnx.vmap with transform_metadata={nnx.PARTITION_NAME: 'layers'})")


def _to_stages(state: Any, stages: int, per: int) -> Any:
    def one(v):
        value = stack_layers(v.get_value(), stages, per)
        return _with_names(v, value, (REPEAT, STAGE, *logical_names(v)[1:]))
    return jax.tree.map(one, state, is_leaf=_is_variable)


def _from_stages(state: Any, per: int) -> Any:
    def one(v):
        value = unstack_layers(v.get_value(), per)
        return _with_names(v, value, (LAYERS, *logical_names(v)[2:]))
    return jax.tree.map(one, state, is_leaf=_is_variable)


def layer_call(blocks: nnx.Module, call: Call | None) -> Call:
    """How each layer of ``blocks`` runs: ``call`` (default ``block(h, *args)``) under the
    active plan's remat policy; weights kept in host memory (``plan.offload_params``) are
    brought to the device inside the layer's checkpoint, one layer at a time, and fetched
    again for the backward pass rather than kept (see :mod:`jaxpar.parallel.offload`)."""
    streamed = any(offload.is_on_host(w) for w in jax.tree.leaves(nnx.state(blocks)))
    plan = current_plan()
    chosen = remat_lib.policy(remat_lib.check(plan.remat if plan is not None else "none"))
    if streamed:
        return remat_lib.checkpointed(call, remat_lib.never_saving(
            chosen, (offload.STREAMED,)), prepare=offload.stream_layer)
    if chosen is None:
        return call or (lambda block, h, *args: block(h, *args))
    return remat_lib.checkpointed(call, chosen)


class StagedModel(nnx.Module):
    """A model of yours with its blocks stacked for pipeline stages (:func:`stage_model`).

    Calling it runs ``head(embed(inputs))`` with the blocks as a vectorised pipeline
    (``gpipe``/``circular``); its :meth:`next_token_loss` runs a ``1f1b`` or
    ``interleaved_1f1b`` schedule, backward pass included, when training.
    """

    def __init__(self, model: nnx.Module, split: StageSplit, schedule: Schedule):
        with nnx.use_eager_sharding(False):
            parent, key, container, path = _locate(model, split.blocks)
            graphdef, state, n, kind = _stacked_state(container, path)
            if n != schedule.layers:
                raise JaxparError(f"the model has {n} blocks at {path!r}; the pipeline runs "
                                  f"{schedule.describe()} = {schedule.layers} layers")
            if any(isinstance(v, nnx.RngState) for v in jax.tree.leaves(
                    state, is_leaf=_is_variable)):
                raise JaxparError(f"the blocks at {path!r} hold random streams (dropout): "
                                  "the pipeline does not carry their state between steps; "
                                  "pass the blocks deterministic or drop their rngs")
            setattr(parent, key, nnx.List([]) if kind != "stack" else None)
            self.model = model
            self.blocks = nnx.merge(graphdef, _to_stages(state, schedule.stages,
                                                         schedule.layers_per_stage))
            self.split = split
            self.pipeline_schedule = schedule
            self._home = (path, kind)
            # model.eval() sets it: evaluation runs the forward pipeline, no 1F1B schedule.
            self.deterministic = False

    def __call__(self, inputs: Any) -> jax.Array:
        """``head(model, pipeline(embed(model, inputs)))``."""
        s = self.pipeline_schedule
        h = self.split.embed(self.model, inputs)
        h = pipeline_module(self.blocks, h, layer_call(self.blocks, self.split.call),
                            microbatches=s.microbatches, act_names=self.split.act_names,
                            layers_per_stage=s.layers_per_stage)
        return self.split.head(self.model, h)

    def next_token_loss(self, tokens: jax.Array) -> jax.Array | None:
        """Mean next-token cross-entropy on ``tokens`` ``(batch, seq + 1)`` by the 1F1B
        schedule (its gradients are the schedule's), or None for the other schedules and
        in evaluation: the loss is then taken from the logits of ``self(inputs)``."""
        s = self.pipeline_schedule
        if not s.backward_in_schedule or self.deterministic:
            return None
        plan = current_plan()
        if plan is None or plan.mesh.shape.get(STAGE, 1) != s.stages:
            raise JaxparError(f"schedule {s.kind} runs under a plan whose mesh has "
                              f"stage={s.stages}")
        call = layer_call(self.blocks, self.split.call)
        blocks_def, blocks = nnx.split(self.blocks)
        rest_def, rest = nnx.split(self.model)
        head = self.split.head

        def layer(layer_state, h):
            return call(nnx.merge(blocks_def, layer_state), h)

        def head_loss(params, y, targets):
            return loss_lib.cross_entropy(head(nnx.merge(rest_def, params), y), targets)

        loss = schedules_lib.pipelined_loss(
            layer, head_loss, mesh=plan.mesh, schedule=s.kind, microbatches=s.microbatches,
            virtual=s.repeats, stage_axis=STAGE,
            batch_axes=manual_batch_axes(plan, tokens.shape[0], s.microbatches))
        return loss(blocks, rest, self.split.embed(self.model, tokens[:, :-1]), tokens[:, 1:])

    def unstaged(self) -> nnx.Module:
        """Your model with its blocks back in their original container and layout (a
        copy; for export, evaluation on one device, or a run without stages)."""
        model = nnx.clone(self.model)
        graphdef, state = nnx.split(self.blocks)
        state = _from_stages(state, self.pipeline_schedule.layers_per_stage)
        path, kind = self._home
        parent, last = _walk(model, path)
        if kind == "stack":
            setattr(parent, last, nnx.merge(graphdef, state))
        else:
            n = self.pipeline_schedule.layers
            blocks = [nnx.merge(graphdef, jax.tree.map(
                lambda v, i=i: _with_names(v, v.get_value()[i], tuple(logical_names(v)[1:])),
                state, is_leaf=_is_variable)) for i in range(n)]
            setattr(parent, last, nnx.List(blocks) if kind == "List" else blocks)
        return model


def stage_model(model: nnx.Module, split: StageSplit, *, stages: int, microbatches: int = 0,
                repeats: int = 0, layers_per_stage: int = 0, schedule: str = ""
                ) -> StagedModel:
    """``model`` with its blocks stacked for ``stages`` pipeline stages: a
    :class:`StagedModel` running ``schedule`` (``gpipe``, ``circular`` (default),
    ``1f1b``, ``interleaved_1f1b``) on ``microbatches`` microbatches (0: one per stage),
    the other sizes filled as :meth:`Schedule.for_model` does from the number of blocks.
    The model is changed in place (its blocks move into the returned module).

    Raises:
      JaxparError: in one line, when ``model`` is not an NNX module or ``split`` not a
        :class:`StageSplit`, the blocks cannot be found or stacked, or their number does
        not split into the stages asked for.
    """
    if not isinstance(split, StageSplit):
        raise JaxparError(f"jaxpar.stage_model: split is a {type(split).__name__}, not a "
                          "jaxpar.StageSplit: pass StageSplit(embed=..., head=..., "
                          "blocks=...)" + (" (StageSplit(**split) from this dict)"
                                           if isinstance(split, dict) else ""))
    if not isinstance(model, nnx.Module):
        raise JaxparError(f"jaxpar.stage_model: model is a {type(model).__name__}, not an "
                          "NNX module (nnx.Module): pass the model itself")
    if isinstance(model, StagedModel):
        raise JaxparError("the model is already staged")
    if hasattr(model, "linen_modules"):  # jaxpar.from_linen's wrapper: no NNX blocks to stack
        raise JaxparError("a linen model (jaxpar.from_linen) cannot be divided into pipeline "
                          "stages yet: its blocks are linen modules, not NNX ones; train it "
                          "without stages, or write the model in NNX")
    _, _, container, path = _locate(model, split.blocks)
    n = len(container) if isinstance(container, nnx.List | list | tuple) else _stacked_state(
        container, path)[2]
    plan = Schedule.for_model(n, stages, microbatches, repeats, layers_per_stage, schedule)
    return StagedModel(model, split, plan)
