"""DiLoCo across the ``data`` axis: replicas that train apart and meet every ``H`` steps.

Synchronous data parallelism all-reduces every gradient over every data-parallel axis
each step; across slices that axis crosses the data-centre network. Here each index of
the ``data`` axis is a replica (a slice, on a multislice mesh whose ``data`` axis spans
the slices) holding its own copy of the weights and of the inner optimizer's state: it
takes steps on its share of the batch with no communication over ``data`` (the step
runs in a ``shard_map`` manual over it; FSDP and tensor parallelism inside the replica
are unchanged). Every ``H`` steps the replicas meet: the outer gradient is the mean over
replicas of ``anchor - replica weights`` (one all-reduce over ``data`` of the weights'
bytes), an outer optimizer (SGD with Nesterov momentum by default) moves the anchor,
and every replica restarts from it, keeping its inner optimizer state.

Streaming DiLoCo (``fragments = F``): the weights are cut into ``F`` fragments, the
stacked layers by layer ranges and other weights by size, and fragment ``f`` meets at
steps ``t`` with ``t mod H = (f + 1) H / F mod H``: each meeting all-reduces a fragment,
``1 / F`` of the bytes.

Low-bit outer gradients (``outer_bits = 8``): each replica's outer gradient is
quantized to int8 with a float32 scale per row and all-gathered over ``data``, then
dequantized and averaged on every device: for two replicas (slices) half the bytes of
the float32 all-reduce.

Bounded staleness (``staleness = tau``, the parameter server's bounded-delay model): an
outer gradient is applied ``tau`` meetings after it was computed, so its all-reduce is a
program of its own whose result nothing waits for until then; ``tau = 0`` is DiLoCo.

Overlapped meetings (``overlap``, streaming DiLoCo's overlap of communication with
computation): a meeting due after step ``t`` runs inside step ``t + 1``'s program. The
outer gradient is taken from the replicas' weights as that program starts, so its
all-reduce depends on nothing the step computes and XLA's scheduler runs it beside the
step's matmuls (on TPU and GPU; XLA:CPU runs collectives in turn); at the program's end
the outer optimizer moves the anchor and each replica's fragment becomes ``new anchor +
(its weights now - its weights at the meeting)``: the outer step lands one inner step
late, and the step taken meanwhile is kept. The anchor a run reports (evaluation, the
final model) has any meeting still in flight applied.

With ``H = 1``, outer SGD at learning rate 1 without momentum, and a linear inner
optimizer (SGD, with or without momentum), the anchor moves exactly as synchronous data
parallelism would.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import JaxparError
from jaxpar.parallel.offload import streamed_mask
from jaxpar.parallel.zeropp import quantize_int8
from jaxpar.sharding.mesh import is_explicit
from jaxpar.sharding.rules import entry_axes
from jaxpar.training.model_errors import explained_model_errors
from jaxpar.training.trainer import Trainer

AXIS = "data"
"""The mesh axis whose indices are replicas."""


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


def fragments_of(params: nnx.State, n: int) -> list[list[tuple[int, slice | None]]]:
    """Which part of which weight each of ``n`` fragments holds: per fragment a list of
    (leaf index, rows of the leading layer dimension or None for the whole leaf). Weights
    stacked over ``layers`` (a number of layers ``n`` divides) are cut by layer ranges;
    the others go whole to the fragment with the fewest elements so far."""
    leaves = _leaves(params)
    stacked = _leaves(streamed_mask(params))
    parts: list[list[tuple[int, slice | None]]] = [[] for _ in range(n)]
    sizes = [0] * n
    for i, (leaf, is_stacked) in enumerate(zip(leaves, stacked, strict=True)):
        if is_stacked and leaf.shape[0] % n == 0:
            rows = leaf.shape[0] // n
            for f in range(n):
                parts[f].append((i, slice(f * rows, (f + 1) * rows)))
                sizes[f] += leaf.size // n
    for i, (leaf, is_stacked) in sorted(enumerate(zip(leaves, stacked, strict=True)),
                                        key=lambda t: -t[1][0].size):
        if not (is_stacked and leaf.shape[0] % n == 0):
            f = int(np.argmin(sizes))
            parts[f].append((i, None))
            sizes[f] += leaf.size
    return parts


class DiLoCo:
    """A :class:`Trainer` run as DiLoCo replicas over the ``data`` axis (see the module
    docstring). It stands in for the trainer where runs use one: ``step``,
    ``step_async``, ``eval_loss`` (of the anchor), ``state`` (checkpointed whole:
    replicas, anchor, outer momentum, pending outer gradients), ``step_count``, ``model``.

    Args:
      trainer: the inner trainer; its plan's mesh needs ``data >= 2`` and its weights
        whole over ``data`` (ZeRO 0, no rule putting weights on ``data``).
      sync_every: ``H``, inner steps between meetings of each fragment.
      outer_lr, outer_momentum, nesterov: the outer optimizer (SGD).
      fragments: streaming DiLoCo's ``F`` (``H`` must divide by it).
      staleness: ``tau``, meetings an outer gradient waits before it is applied.
      outer_bits: 8 sends each replica's outer gradient as int8 with a float32 scale per
        row (its last dimension), gathered over ``data`` and averaged after
        dequantizing; 32 all-reduces it in float32.
      overlap: run each meeting inside the next inner step's program (its all-reduce
        beside that step's compute), applying it one inner step late.
    """

    def __init__(self, trainer: Trainer, *, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, fragments: int = 1,
                 staleness: int = 0, outer_bits: int = 32, overlap: bool = False):
        plan = trainer.plan
        self.replicas = plan.mesh.shape.get(AXIS, 1)
        check(plan, trainer.state_shardings, sync_every, fragments, staleness, overlap)
        self.overlap = overlap
        self.trainer, self.plan = trainer, plan
        self.sync_every, self.outer_lr = sync_every, outer_lr
        self.outer_momentum, self.nesterov = outer_momentum, nesterov
        self.fragments, self.staleness = fragments, staleness
        if outer_bits not in (8, 32):
            raise JaxparError(f"diloco.outer_bits={outer_bits}: choose 32 (float32 outer "
                              "gradients) or 8 (int8 with a scale per row)")
        self.outer_bits = outer_bits
        self.pipeline_schedule = trainer.pipeline_schedule
        schedule = trainer.pipeline_schedule
        if schedule is not None and schedule.backward_in_schedule:
            raise JaxparError(
                f"pipeline.schedule={schedule.kind} runs the backward pass inside its own "
                "shard_map, which DiLoCo's replicas (a shard_map over data) cannot nest: "
                "use pipeline.schedule=circular or gpipe with diloco.sync_every")
        self._key = trainer.master_key
        self._parts = fragments_of(trainer.state["params"], fragments)
        self._compiled: dict[Any, Any] = {}
        inner_sh = trainer.state_shardings
        self.state_shardings = {
            "step": plan.replicated,
            "replicas": jax.tree.map(lambda s: NamedSharding(plan.mesh, P(AXIS, *s.spec)),
                                     inner_sh, is_leaf=lambda x: isinstance(x, NamedSharding)),
            "anchor": inner_sh[self._key], "momentum": inner_sh[self._key]}
        if staleness:
            self.state_shardings["pending"] = jax.tree.map(
                lambda s: NamedSharding(plan.mesh, P(None, *s.spec)), inner_sh[self._key],
                is_leaf=lambda x: isinstance(x, NamedSharding))
        self._state = self._initial_state(trainer.state)
        self._host_step: int | None = 0

    @property
    def check_ids(self) -> bool:
        """The inner trainer's token-id check (runs switch it off once the data is
        checked)."""
        return self.trainer.check_ids

    @check_ids.setter
    def check_ids(self, value: bool) -> None:
        self.trainer.check_ids = value

    def __getattr__(self, name: str) -> Any:  # the inner trainer's checks and helpers
        if name.startswith("_") or name in ("trainer",):
            raise AttributeError(name)
        return getattr(self.trainer, name)

    # --- state ----------------------------------------------------------------------------
    def _initial_state(self, inner: dict[str, Any]) -> dict[str, Any]:
        n, sh = self.replicas, self.state_shardings

        def build(inner):
            anchor = jax.tree.map(lambda x: x.astype(jnp.float32), inner[self._key])
            state = {"step": inner["step"],
                     "replicas": jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)),
                                              inner),
                     "anchor": anchor, "momentum": jax.tree.map(jnp.zeros_like, anchor)}
            if self.staleness:
                state["pending"] = jax.tree.map(
                    lambda a: jnp.zeros((self.staleness, *a.shape), a.dtype), anchor)
            return state

        with self.plan.activate():
            if self.trainer.abstract:  # shapes only: the program can be compiled, not run
                return jax.tree.map(
                    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                    jax.eval_shape(build, inner), sh)
            return jax.jit(build, out_shardings=sh)(inner)

    @property
    def state(self) -> dict[str, Any]:
        """``step``, ``replicas`` (the inner trainer's state, a leading replica dimension
        split over ``data``), ``anchor`` and ``momentum`` (the outer weights and
        momentum, float32), and ``pending`` (outer gradients not yet applied)."""
        return self._state

    @state.setter
    def state(self, value: dict[str, Any]) -> None:
        self._state = value
        self._host_step = None

    @property
    def step_count(self) -> int:
        """Inner steps taken (each replica's count)."""
        if self._host_step is None:
            self._host_step = int(self._state["step"])
        return self._host_step

    # --- steps ----------------------------------------------------------------------------
    def _inner(self, batch: Any, fragment: int | None = None) -> Any:
        """The inner step on every replica; with ``fragment`` (``overlap``), the outer step
        of the meeting due before it too, in the same program: the outer gradient comes
        from the replicas' weights as the step starts and its all-reduce depends on
        nothing the step computes, so XLA can run it beside the step's compute; each
        replica then keeps its step's update on top of the new anchor."""
        key = ("inner", fragment, jax.tree.structure(batch),
               tuple(np.ndim(x) for x in _leaves(batch)))
        if key not in self._compiled:
            trainer, sh = self.trainer, self.state_shardings

            def local(replica, rows):
                state = jax.tree.map(lambda x: x[0], replica)
                state, metrics = trainer._step_impl(state, rows)
                metrics = jax.tree.map(lambda m: jax.lax.pmean(m, AXIS), metrics)
                return jax.tree.map(lambda x: x[None], state), metrics

            def step(state, batch):
                if fragment is not None:
                    grads = self._outer_gradients(state, fragment)
                replicas, metrics = jax.shard_map(
                    local, mesh=self.plan.mesh, in_specs=(P(AXIS), P(AXIS)),
                    out_specs=(P(AXIS), P()), axis_names={AXIS}, check_vma=False)(
                        state["replicas"], batch)
                out = dict(state, step=state["step"] + 1, replicas=replicas)
                if fragment is not None:
                    out = self._outer_update(out, fragment, grads,
                                             before=state["replicas"][self._key])
                return out, metrics

            self._compiled[key] = jax.jit(
                step, in_shardings=(sh, trainer.batch_shardings(batch)),
                out_shardings=(sh, self.plan.replicated), donate_argnums=0)
        return self._compiled[key]

    def _outer_gradients(self, state: dict[str, Any], fragment: int) -> list[jax.Array]:
        """The outer gradient of each part of ``fragment``: the mean over replicas of
        ``anchor - replica weights`` (the all-reduce over ``data``, or under
        ``outer_bits = 8`` the int8 all-gather)."""
        specs = [sh.spec for sh in jax.tree.leaves(
            self.state_shardings["replicas"][self._key],
            is_leaf=lambda x: isinstance(x, NamedSharding))]
        anchor, own = _leaves(state["anchor"]), _leaves(state["replicas"][self._key])
        grads = []
        for i, rows in self._parts[fragment]:
            at = (slice(None),) if rows is None else (rows,)
            deltas = anchor[i][at][None] - own[i][(slice(None), *at)].astype(jnp.float32)
            if self.outer_bits == 8:
                deltas = _int8_exchange(deltas, specs[i], self.plan.mesh)
            grads.append(jnp.mean(deltas, axis=0))
        return grads

    def _outer_update(self, state: dict[str, Any], fragment: int, grads: list[jax.Array],
                      before: Any = None) -> dict[str, Any]:
        """The outer optimizer's step on ``fragment`` with ``grads`` (of the gradient
        ``staleness`` meetings old, queuing this one), then the replicas' weights of it:
        the new anchor, or with ``before`` (their weights when the gradient was taken)
        the new anchor plus what each replica has learnt since."""
        lr, mu, nesterov, tau = (self.outer_lr, self.outer_momentum, self.nesterov,
                                 self.staleness)
        anchor, tdef = jax.tree_util.tree_flatten(state["anchor"])
        momentum = _leaves(state["momentum"])
        reps = state["replicas"]
        own, compute = _leaves(reps[self._key]), _leaves(reps["params"])
        pending = _leaves(state["pending"]) if tau else None
        then = _leaves(before) if before is not None else None
        for (i, rows), g in zip(self._parts[fragment], grads, strict=True):
            at = (slice(None),) if rows is None else (rows,)
            every = (slice(None), *at)
            if tau:
                queue = pending[i][every]
                g, queue = queue[0], jnp.concatenate([queue[1:], g[None]])
                pending[i] = pending[i].at[every].set(queue)
            a, m = outer_sgd(anchor[i][at], momentum[i][at], g, lr, mu, nesterov)
            anchor[i] = anchor[i].at[at].set(a)
            momentum[i] = momentum[i].at[at].set(m)
            if then is None:
                new = jnp.broadcast_to(a, (self.replicas, *a.shape))
            else:
                new = a[None] + (own[i][every].astype(jnp.float32)
                                 - then[i][every].astype(jnp.float32))
            own[i] = own[i].at[every].set(new.astype(own[i].dtype))
            if self._key == "master":
                compute[i] = compute[i].at[every].set(new.astype(compute[i].dtype))
        unflat = functools.partial(jax.tree_util.tree_unflatten, tdef)
        reps = dict(reps, **{self._key: unflat(own)})
        if self._key == "master":
            reps["params"] = unflat(compute)
        out = dict(state, anchor=unflat(anchor), momentum=unflat(momentum), replicas=reps)
        if tau:
            out["pending"] = unflat(pending)
        return out

    def _outer(self, fragment: int) -> Any:
        """The meeting of ``fragment`` as a program of its own: its outer gradient
        averaged over the replicas (the all-reduce over ``data``), the outer update (of
        the gradient ``staleness`` meetings old), every replica reset to the new
        anchor."""
        key = ("outer", fragment)
        if key not in self._compiled:
            def meet(state):
                return self._outer_update(state, fragment,
                                          self._outer_gradients(state, fragment))

            sh = self.state_shardings
            self._compiled[key] = jax.jit(meet, in_shardings=(sh,), out_shardings=sh,
                                          donate_argnums=0)
        return self._compiled[key]

    def _peek(self, fragment: int) -> Any:
        """The anchor after ``fragment``'s outer step, the state left as it is (under
        ``overlap``, the step due before the next inner step)."""
        key = ("peek", fragment)
        if key not in self._compiled:
            def peek(state):
                grads = self._outer_gradients(state, fragment)
                return self._outer_update(state, fragment, grads)["anchor"]

            self._compiled[key] = jax.jit(
                peek, in_shardings=(self.state_shardings,),
                out_shardings=self.state_shardings["anchor"])
        return self._compiled[key]

    def meeting(self, step: int) -> int | None:
        """The fragment that meets after inner step ``step`` (1-based), or None."""
        h, f = self.sync_every, self.fragments
        for frag in range(f):
            if step % h == (frag + 1) * h // f % h:
                return frag
        return None

    def step_async(self, batch: Any) -> dict[str, jax.Array]:
        """One inner step on every replica, then the meeting due after it, if any."""
        trainer = self.trainer
        batch = trainer._as_global(batch)
        trainer._check_token_ids(batch)
        with self.plan.activate(mesh_context=True), explained_model_errors(self.plan):
            step = self.step_count + 1
            if self.overlap:  # the meeting due after the last step, with this one
                self._state, metrics = self._inner(batch, self._due())(self._state, batch)
            else:
                self._state, metrics = self._inner(batch)(self._state, batch)
                frag = self.meeting(step)
                if frag is not None:
                    self._state = self._outer(frag)(self._state)
        self._host_step = step
        return metrics

    def _due(self) -> int | None:
        """Under ``overlap``: the fragment whose meeting fell after the last step taken
        and is not yet applied."""
        step = self.step_count
        return self.meeting(step) if step >= 1 else None

    def step(self, batch: Any) -> dict[str, float]:
        """:meth:`step_async`, waited for; host numbers."""
        out = {k: float(v) for k, v in jax.device_get(self.step_async(batch)).items()}
        out["step"] = self.step_count
        return out

    def lower(self, batch: Any, fragment: int | None = None) -> Any:
        """The inner step lowered; with ``fragment``, that fragment's meeting (under
        ``overlap``: the inner step that carries it)."""
        batch = self.trainer._as_global(batch)
        with self.plan.activate(mesh_context=True):
            if fragment is None or self.overlap:
                return self._inner(batch, fragment).lower(self._state, batch)
            return self._outer(fragment).lower(self._state)

    def anchor_state(self) -> dict[str, Any]:
        """An inner trainer state holding the anchor's weights (replica 0's other state)."""
        policy = self.trainer.policy
        with self.plan.activate():
            one = jax.tree.map(_first_replica, self._state["replicas"])
            anchor = self._state["anchor"]
            if self.overlap and self._due() is not None:  # the meeting in flight, applied
                with self.plan.activate(mesh_context=True):
                    anchor = self._peek(self._due())(self._state)
            one[self._key] = jax.tree.map(lambda a, x: a.astype(x.dtype), anchor,
                                          one[self._key])
            if self._key == "master":
                one["params"] = policy.cast_to_compute(one["master"])
            return jax.device_put(one, self.trainer.state_shardings)

    def eval_loss(self, batch: Any) -> float:
        """The anchor's loss on ``batch`` (eval mode)."""
        self.trainer.state = self.anchor_state()
        return self.trainer.eval_loss(batch)

    @property
    def model(self) -> nnx.Module:
        """The model with the anchor's weights."""
        self.trainer.state = self.anchor_state()
        return self.trainer.model


def outer_sgd(anchor: Any, momentum: Any, g: Any, lr: float, mu: float, nesterov: bool
              ) -> tuple[Any, Any]:
    """One step of the outer optimizer on arrays (jax or numpy): SGD at ``lr`` with
    momentum ``mu`` (Nesterov's when ``nesterov``) on the outer gradient ``g``; returns
    the new anchor and momentum."""
    m = mu * momentum + g
    return anchor - lr * (g + mu * m if nesterov else m), m


def _int8_exchange(deltas: jax.Array, spec: P, mesh: Any) -> jax.Array:
    """Every replica's ``deltas`` (leading replica dimension, split over ``data``, the
    rest as ``spec`` says) on every device, sent as int8 with a float32 scale per row of
    each device's block: each device quantizes its block and all-gathers the int8
    values over ``data`` in a ``shard_map`` manual over every axis ``spec`` names (left
    to GSPMD, XLA would widen them before the gather, or gather them whole), then
    dequantizes."""
    def local(d):
        q, scale = quantize_int8(d, d.ndim - 1)
        q = jax.lax.all_gather(q, AXIS, tiled=True)
        scale = jax.lax.all_gather(scale, AXIS, tiled=True)
        return q.astype(jnp.float32) * scale

    rest = tuple(spec)[1:]
    names = {AXIS} | {a for e in rest for a in entry_axes(e)}
    return jax.shard_map(local, mesh=mesh, in_specs=P(AXIS, *rest), out_specs=P(None, *rest),
                         axis_names=names, check_vma=False)(deltas)


def check(plan: Any, shardings: dict[str, Any], sync_every: int, fragments: int,
          staleness: int, overlap: bool = False) -> None:
    """Refuse, in one line, what DiLoCo cannot run."""
    if plan.mesh.shape.get(AXIS, 1) < 2:
        raise JaxparError("diloco runs one replica per index of the data axis: give the "
                          "mesh data >= 2 (on a multislice machine, dcn data = slices)")
    if sync_every < 1:
        raise JaxparError(f"diloco.sync_every={sync_every}: must be at least 1")
    if fragments < 1 or sync_every % fragments:
        raise JaxparError(f"diloco.fragments={fragments}: must divide diloco.sync_every="
                          f"{sync_every}")
    if staleness < 0:
        raise JaxparError(f"diloco.staleness={staleness}: must be 0 or more")
    if overlap and staleness:
        raise JaxparError(f"diloco.overlap applies each outer gradient one inner step "
                          f"late; diloco.staleness={staleness} delays it by meetings: "
                          f"choose one")
    if plan.zero_stage or plan.microbatches > 1 or plan.compress_gradients != "none" \
            or plan.quantize_reduce != "none":
        raise JaxparError("diloco keeps a whole optimizer state per replica: it needs "
                          "plan.zero_stage=0, plan.microbatches=1 and no gradient "
                          "compression or quantized reductions")
    for path, sh in jax.tree_util.tree_leaves_with_path(
            shardings["params"], is_leaf=lambda x: isinstance(x, NamedSharding)):
        if any(AXIS in entry_axes(e) for e in sh.spec):
            raise JaxparError(f"diloco needs the weights whole over the data axis; the "
                              f"rules split {jax.tree_util.keystr(path)} over it")


def _first_replica(x: jax.Array) -> jax.Array:
    """Replica 0 of an array stacked over the replicas: on an explicit-sharding mesh the
    stacked dimension is gathered first (its type says it is split over ``data``)."""
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    if spec is not None and mesh is not None and is_explicit(mesh) and spec and spec[0]:
        x = jax.sharding.reshard(x, jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(None, *spec[1:])))
    return x[0]
