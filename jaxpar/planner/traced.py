"""Activation memory and model FLOPs of a model jaxpar did not write, from its traced step.

jaxpar's own :class:`~jaxpar.models.Transformer` has analytic formulas
(:mod:`jaxpar.planner.memory`, :func:`jaxpar.planner.cost.model_flops`). A ``model.factory``
model has none: its figures come from the program the Trainer runs. :class:`StepTracer`
assembles the run config's model on one CPU device, as ``jaxpar train`` builds it (the
plan's remat policy wrapping its blocks, its precision, its loss), at the batch rows one
device holds, and reads:

- ``temp_bytes``: XLA's temporaries of the loss and its gradient compiled for that one
  device: the activations the backward pass keeps under the remat policy and its working
  set, as the compiler lays them out (its fusions keep fewer tensors than the jaxpr names).
  This is what the planner adds to the gradients and the update to predict a step's
  temporaries; it is split over the data-parallel axes only (a tensor or context split of a
  user's activations is not modelled).
- ``residual_bytes``: what the VJP saves, summed from the traced jaxpr
  (``jax.ad_checkpoint``'s saved residuals, arguments left out): the remat policy's
  figure before XLA fuses anything.
- model FLOPs (:meth:`StepTracer.model_flops`): the ``dot_general`` FLOPs of the jaxpr of
  the loss's forward and backward without remat (scan bodies times their length): the
  matmuls a step needs, attention's included, recomputation not; the convention of
  :func:`~jaxpar.planner.cost.model_flops` (``6 N`` per token plus full ``s x s``
  attention) for any model.

Compiling costs seconds, so figures are cached per (remat, precision, seq, rows); after two
row counts of one policy, others are interpolated (temporaries are affine in the rows).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxpar.config.schema import Config, apply_overrides, from_dict
from jaxpar.errors import JaxparError
from jaxpar.sharding.mesh import MESH_AXES
from jaxpar.sharding.remat import marked_names


@dataclasses.dataclass(frozen=True)
class TracedMemory:
    """Per-device bytes of one device's loss and gradient at ``rows`` sequences."""

    temp_bytes: float
    residual_bytes: float
    rows: int
    source: str = "traced"


def dot_flops(jaxpr: Any) -> tuple[float, int]:
    """FLOPs of every ``dot_general`` in ``jaxpr`` (a ``ClosedJaxpr`` or ``Jaxpr``), nested
    jaxprs included: a ``scan`` body counts ``length`` times, a ``cond`` its costliest
    branch, a ``while`` body once. Returns ``(flops, while_loops)``."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    total, loops = 0.0, 0
    for eqn in inner.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), (lb, _) = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in lc)
            continue
        subs = [v for v in eqn.params.values()
                for v in (v if isinstance(v, list | tuple) else (v,))
                if hasattr(getattr(v, "jaxpr", v), "eqns")]
        counted = [dot_flops(s) for s in subs]
        if not counted:
            continue
        loops += sum(c[1] for c in counted) + (name == "while")
        if name == "cond":
            total += max(c[0] for c in counted)
        else:
            total += sum(c[0] for c in counted) * (eqn.params.get("length", 1)
                                                    if name == "scan" else 1)
    return total, loops


def _one_device(config: Config, *, remat: str, precision: str, rows: int, seq: int
                ) -> Config:
    """``config`` on one device: every mesh axis 1, ``rows`` sequences of ``seq``, the remat
    policy and compute dtype given, no microbatches, ZeRO or host offload."""
    data = config.to_dict()
    data["mesh"] = {"explicit": bool(data["mesh"].get("explicit", False)),
                    **{a: 1 for a in MESH_AXES}, **{f"dcn_{a}": 1 for a in MESH_AXES}}
    compute = {"bf16": "bfloat16", "f32": "float32"}.get(precision, precision)
    overrides = [f"plan.remat={remat}", "plan.microbatches=1", "plan.zero_stage=0",
                 f"plan.precision=params=float32,compute={compute},output=float32",
                 f"train.global_batch={rows}", f"train.seq_len={seq}"]
    plan = data["plan"]
    for knob, off in (("offload_optimizer", 0.0), ("host_update", False),
                      ("offload_params", False), ("hpz", False),
                      ("quantize_gather", "none"), ("quantize_reduce", "none")):
        if knob in plan:
            plan[knob] = off
    data["diloco"] = {**data.get("diloco", {}), "sync_every": 0}
    data.pop("pipeline", None)  # one device has no stages (its knobs would be warned about)
    data["model"]["max_seq_len"] = max(int(data["model"].get("max_seq_len", seq)), seq)
    return from_dict(Config, apply_overrides(data, overrides))


class StepTracer:
    """The traced figures of one run config's ``model.factory`` model (see the module
    docstring), computed on demand and cached."""

    def __init__(self, config: Config):
        self.config = config
        self._exact: dict[tuple[str, str, int], dict[int, TracedMemory]] = {}
        self._flops: dict[int, tuple[float, int]] = {}
        self._marks: dict[int, set[str]] = {}

    def _step(self, remat: str, precision: str, rows: int, seq: int
              ) -> tuple[Any, Any, tuple[Any, Any]]:
        """``(trainer, loss, args)``: the Trainer's loss of its parameters and a batch, on one
        CPU device, and its abstract arguments."""
        import jax

        from jaxpar.config.assembly import assemble

        cfg = _one_device(self.config, remat=remat, precision=precision, rows=rows, seq=seq)
        try:
            cpu = jax.local_devices(backend="cpu")[:1]
        except RuntimeError:
            cpu = jax.devices()[:1]
        run = assemble(cfg, cpu, abstract=True)
        trainer = run.trainer
        state = trainer.state
        batch = jax.ShapeDtypeStruct((rows, seq + 1), np.int32,
                                     sharding=trainer.plan.batch_sharding(2))
        key = jax.random.key(0)

        def loss(params: Any, batch: Any) -> Any:
            return trainer._loss(params, state["frozen"], batch, key)[0]

        return trainer, loss, (state["params"], batch)

    def _measure(self, remat: str, precision: str, rows: int, seq: int) -> TracedMemory:
        import jax
        from jax._src.ad_checkpoint import saved_residuals

        trainer, loss, args = self._step(remat, precision, rows, seq)
        with trainer.plan.activate(mesh_context=True):
            compiled = jax.jit(jax.value_and_grad(loss)).lower(*args).compile()
            residuals = saved_residuals(loss, *args)
        saved = sum(math.prod(aval.shape) * aval.dtype.itemsize for aval, src in residuals
                    if "argument" not in src)
        temp = compiled.memory_analysis().temp_size_in_bytes
        return TracedMemory(float(temp), float(saved), rows, "compiled for one device")

    def activations(self, remat: str, precision: str, rows: int, seq: int) -> TracedMemory:
        """Per-device activation memory of ``rows`` sequences of ``seq`` under ``remat``
        with ``precision`` compute: measured for the first two row counts of a policy,
        interpolated (affinely) for the others."""
        rows = max(int(rows), 1)
        remat = self._effective(remat, seq)
        known = self._exact.setdefault((remat, precision, seq), {})
        if rows in known:
            return known[rows]
        if len(known) < 2:
            try:
                known[rows] = self._measure(remat, precision, rows, seq)
            except JaxparError:
                raise
            except Exception as err:  # noqa: BLE001 - user code: say which step failed
                raise JaxparError(f"could not trace model.factory "
                                  f"{self.config.model.factory!r}'s step (remat {remat}, "
                                  f"{rows} x {seq}): {type(err).__name__}: {err}") from None
            return known[rows]
        (r1, m1), (r2, m2) = sorted(known.items())[:2]
        slope = lambda a, b: (b - a) / (r2 - r1)
        t = m1.temp_bytes + slope(m1.temp_bytes, m2.temp_bytes) * (rows - r1)
        s = m1.residual_bytes + slope(m1.residual_bytes, m2.residual_bytes) * (rows - r1)
        return TracedMemory(max(t, 0.0), max(s, 0.0), rows, "interpolated from one device")

    def _effective(self, remat: str, seq: int) -> str:
        """``remat``, or ``full`` for a policy that saves only names the model never
        marks (``save_attention_and_mlp_outputs`` on most models: it then saves what
        ``full`` saves, and need not be compiled again)."""
        if remat != "save_attention_and_mlp_outputs":
            return remat
        self.model_flops(1, seq)
        return remat if self._marks[seq] & {"attention_out", "mlp_out"} else "full"

    def model_flops(self, global_batch: int, seq: int) -> float:
        """Model FLOPs of one step (every device together): the ``dot_general`` FLOPs of
        the loss's forward and backward without remat, for one sequence, times the
        sequences (:func:`dot_flops`)."""
        import jax

        if seq not in self._flops:
            trainer, loss, args = self._step("none", "float32", 1, seq)
            with trainer.plan.activate(mesh_context=True):
                jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(*args)
            self._flops[seq] = dot_flops(jaxpr)
            self._marks[seq] = marked_names(jaxpr)
        return self._flops[seq][0] * global_batch
