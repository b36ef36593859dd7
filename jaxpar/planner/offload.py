"""Host offload in the cost model: what moves to host memory, what stays on the device
for a while, and what the transfers cost.

A candidate may keep three kinds of state in host memory (the Plan knobs of
:mod:`jaxpar.parallel.offload`, mirrored by :class:`~jaxpar.planner.candidate.Candidate`):

* **optimizer state** (``offload_optimizer``, a fraction): the f32 master weights (mixed
  precision) and the moments, ZeRO-sharded as usual, the largest tensors first until the
  fraction of their bytes has moved (:func:`optimizer_offload`). Each step the offloaded
  part streams through the device for the update and back, a slab at a time (a layer of
  the stacked tensors, or a piece of another tensor no larger), so :data:`UPDATE_SLABS`
  slabs' state is on the device at once; or, with
  ``host_update``, the update runs on the host: the gradients go down, the new working
  weights come up, and the state never enters device memory;
* **the decoder layers' weights** (``offload_params``): each layer's shard (as stored:
  an FSDP shard is gathered after it arrives) comes in as the layer runs, in the forward
  pass and again in the backward pass, so :data:`STREAMED_LAYERS` layers' weights are on
  the device at a time (:func:`streamed_params`); their gradients leave the layer loop in
  host memory (the transpose of the fetch) and come back to the device for a device
  update, and after the update the new weights go back to the host;
* **activations** (``remat=offload:<names>`` or ``offload_dots``): what the policy saves
  goes to host memory during the forward pass and comes back in the backward pass,
  :data:`STAGING_LAYERS` layers' worth in flight (bytes: :func:`jaxpar.planner.activations.
  host_activation_bytes`).

Time (:func:`offload_times`): every transfer crosses the host link at ``host_bw`` (one
way; both directions run at once). Per step, with ``x(T, C) = max(T - overlap x C, 0)``,
``m`` microbatches, ``W`` the streamed weight bytes and ``A`` the offloaded activation
bytes of one microbatch, ``C_f``/``C_b`` the layers' forward and backward (with
recomputation) compute, ``U`` the device's update::

    weights and activations  x(m max(W, A) / host_bw, C_f) + x(m (W + A) / host_bw, C_b)
    streamed update          x(2 S / host_bw, U)     S: the offloaded optimizer bytes
    host update              x(G / host_bw, C_b / m) + update bytes / host_mem_bw
                             + P / host_bw          G: f32 gradients, P: new weights
    weights written back     W / host_bw            (device update with offload_params)
    gradients brought back   W / host_bw            (the same: the streamed layers' gradients)

The last four follow the layer loop and hide under nothing else. What moves and what it
costs are reported apart (``host_*`` memory keys, ``offload ...`` breakdown terms), and
:func:`offload_note` says it in words.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxpar.planner.candidate import OPTIMIZER_MOMENTS, Candidate, dtype_bytes
from jaxpar.planner.catalog import Chip
from jaxpar.planner.layout import Layout
from jaxpar.planner.model import ModelSpec
from jaxpar.planner.roofline import update_bytes, update_time

STREAMED_LAYERS = 2
"""Layers whose streamed weights are on the device at once: the one running and the next
one arriving."""
UPDATE_SLABS = 2
"""Slabs of offloaded optimizer state on the device at once during a streamed update
(:mod:`jaxpar.parallel.streamed_update`): the one being updated and the next one
arriving. A slab is ``update_chunk`` layers of the stacked tensors' state, or a piece of
a tensor outside the stack no larger than that."""
STAGING_LAYERS = 2
"""Layers' offloaded activations in flight on the device (one layer's leaving or
arriving while the next is computed)."""

STATES = ((0.0, False, False), (0.5, False, False), (1.0, False, False), (1.0, True, False),
          (0.0, False, True), (1.0, False, True), (1.0, True, True))
"""``(offload_optimizer, host_update, offload_params)`` settings the search tries."""
REMATS = ("offload:attention_out,mlp_out",)
"""Activation-offload policies the search tries beside the device-only ones: the
attention and MLP outputs saved to host memory, the rest recomputed (the device keeps
what ``full`` keeps)."""


def is_stacked(names: tuple[str | None, ...]) -> bool:
    """Whether a tensor with these logical names is stacked over the ``layers`` axis."""
    return bool(names) and names[0] == "layers"


def is_streamed(names: tuple[str | None, ...]) -> bool:
    """Whether a tensor with these logical names is streamed by ``offload_params``: a
    matrix (or more) per layer, stacked over the ``layers`` axis (see
    :func:`jaxpar.parallel.offload.streamed_mask`)."""
    return is_stacked(names) and len(names) >= 3


@dataclasses.dataclass(frozen=True)
class StateOffload:
    """Per-device bytes of state a candidate keeps in host memory.

    ``optimizer``: master weights and moments in host memory; ``update_transient``: the
    part of them on the device at once during a streamed update; ``params``: streamed
    layer weights in host memory; ``params_per_layer``: one layer's share of them.
    """

    optimizer: float = 0.0
    update_transient: float = 0.0
    params: float = 0.0
    params_per_layer: float = 0.0


def optimizer_offload(lay: Layout, cand: Candidate) -> tuple[float, float]:
    """(bytes in host memory, bytes on the device at once during a streamed update) of
    the optimizer state, per device.

    Like the Trainer (:func:`jaxpar.parallel.offload.largest_first`), the leaves (each
    tensor's master copy and moments) are taken largest first, by global size, until
    ``offload_optimizer`` of the state's bytes has moved; the bytes counted are the
    device's shard of each (ZeRO's layout from stage 1 on).
    """
    fraction = cand.offload_optimizer
    if not fraction:
        return 0.0, 0.0
    per_leaf = [1] * OPTIMIZER_MOMENTS.get(cand.optimizer, 2)
    if dtype_bytes(cand.precision) != 4:
        per_leaf.append(1)  # the f32 master copy
    leaves = []  # (global bytes, local bytes, tensor index)
    for i, p in enumerate(lay.placed):
        local = (p.zero if cand.zero_stage >= 1 else p.base) * 4
        leaves += [(p.tensor.size * 4, local, i)] * len(per_leaf)
    goal = fraction * sum(g for g, _, _ in leaves)
    moved_global, moved, by_tensor = 0.0, 0.0, {}
    for g, local, i in sorted(leaves, key=lambda leaf: -leaf[0]):
        if moved_global >= goal:
            break
        moved_global += g
        moved += local
        by_tensor[i] = by_tensor.get(i, 0.0) + local
    return moved, UPDATE_SLABS * update_slab(lay, by_tensor, cand.update_chunk)


def update_slab(lay: Layout, by_tensor: dict[int, float], chunk: int = 1) -> float:
    """Bytes of offloaded state (per device) in the largest slab of a streamed update,
    sliced as :func:`jaxpar.parallel.streamed_update.plan_slabs` slices it: ``chunk``
    layers of the stacked tensors (``by_tensor``: each offloaded tensor's bytes), then
    the largest other tensors alone, in pieces no larger than that, until the remainder
    is no larger either."""
    stacked = {i: b for i, b in by_tensor.items() if is_stacked(lay.placed[i].tensor.names)}
    loose = sorted((b for i, b in by_tensor.items() if i not in stacked), reverse=True)
    layers = max((lay.placed[i].tensor.shape[0] for i in stacked), default=1)
    per = max(d for d in range(1, min(chunk, layers) + 1) if layers % d == 0)
    layer_slab = sum(stacked.values()) * per / layers
    target = layer_slab or sum(loose) / 8
    left, pieces = sum(loose), []
    for b in loose:
        if left <= target:
            break
        left -= b
        pieces.append(b / math.ceil(b / target))
    return max([layer_slab, left, *pieces])


def streamed_params(spec: ModelSpec, lay: Layout, cand: Candidate) -> tuple[float, float]:
    """(bytes in host memory, one layer's share) of the weights ``offload_params``
    streams, per device: the working copy (compute dtype under mixed precision, else
    f32) of the tensors stacked over ``layers``, as stored (ZeRO-3 shards them)."""
    if not cand.offload_params:
        return 0.0, 0.0
    c = dtype_bytes(cand.precision)
    total, layers = 0.0, 0
    for p in lay.placed:
        if is_streamed(p.tensor.names):
            total += (p.zero if cand.zero_stage >= 3 else p.base) * c
            layers = max(layers, p.tensor.shape[0])
    return total, total / max(layers, 1)


def state_offload(spec: ModelSpec, lay: Layout, cand: Candidate) -> StateOffload:
    """What ``cand`` keeps of its state in host memory (see :class:`StateOffload`)."""
    if not cand.offloads_state:
        return StateOffload()
    opt, transient = optimizer_offload(lay, cand)
    params, per_layer = streamed_params(spec, lay, cand)
    return StateOffload(opt, transient, params, per_layer)


def check(spec: ModelSpec, cand: Candidate) -> str | None:
    """Why ``cand``'s offload settings cannot run ``spec`` (None when they can)."""
    if not 0 <= cand.offload_optimizer <= 1:
        return f"offload_optimizer={cand.offload_optimizer} is not a fraction in [0, 1]"
    if cand.host_update and cand.offload_optimizer != 1:
        return "host_update needs offload_optimizer=1"
    if cand.offload_params:
        if cand.sizes.get("stage", 1) > 1:
            return "offload_params does not combine with pipeline stages"
        if not any(is_streamed(t.names) for t in spec.tensors):
            return "offload_params needs weights stacked over a 'layers' axis"
    return None


@dataclasses.dataclass(frozen=True)
class OffloadTimes:
    """Exposed seconds of a candidate's host transfers and host work (see the module
    docstring): ``layers`` run inside the layer loop (a pipeline bubble stretches them),
    ``step`` after it; ``device_update`` replaces the device's update time (only the
    gradient accumulation is left on the device under ``host_update``); ``breakdown``
    names each part."""

    layers: float = 0.0
    step: float = 0.0
    device_update: float | None = None
    breakdown: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        """All exposed offload seconds of a step."""
        return self.layers + self.step


def _exposed(transfer: float, compute: float, overlap: float) -> float:
    return max(transfer - overlap * min(transfer, compute), 0.0)


def offload_times(chip: Chip, cand: Candidate, state: StateOffload, *, activations: float,
                  c_f: float, c_b: float, update: float, opt_elems: float,
                  store_elems: float, local_grads: float, microbatches: int = 1
                  ) -> OffloadTimes:
    """Exposed seconds of ``cand``'s offload on ``chip``, per step.

    Args:
      state: the state in host memory (:func:`state_offload`).
      activations: offloaded activation bytes of one microbatch (all layers here).
      c_f, c_b: the layers' forward and backward (with recomputation) compute seconds,
        over all microbatches.
      microbatches: how many microbatches the layers run per step (gradient
        accumulation times pipeline microbatches).
      update: the device's update seconds without offload.
      opt_elems: parameter elements whose optimizer state this device updates.
      store_elems: parameter elements of the stored working copy on this device.
      local_grads: gradient elements this device holds in the compute layout.
    """
    if not cand.offloads:
        return OffloadTimes()
    bw, ov = chip.host_bw, chip.overlap
    parts: dict[str, float] = {}
    w, a = microbatches * state.params, microbatches * activations
    if w or a:
        fwd = _exposed(max(w, a) / bw, c_f, ov)
        bwd = _exposed((w + a) / bw, c_b, ov)
        share = w / (w + a)  # the weights' part, by bytes
        if w:
            parts["offload weight streaming (exposed)"] = (fwd + bwd) * share
        if a:
            parts["offload activations (exposed)"] = (fwd + bwd) * (1 - share)
    layers = sum(parts.values())
    device_update = None
    c = dtype_bytes(cand.precision)
    if cand.host_update:
        grads = opt_elems * 4 / bw
        parts["offload gradients to the host (exposed)"] = _exposed(
            grads, c_b / max(cand.microbatches, 1), ov)
        parts["offload update on the host"] = (update_bytes(cand, opt_elems, 0)
                                              / chip.host_update_bw)
        weights = store_elems * c - state.params
        parts["offload new weights to the device"] = max(weights, 0.0) / bw
        device_update = update_time(chip, cand, 0, local_grads)  # the accumulation only
    elif state.optimizer:
        parts["offload optimizer state in and out (exposed)"] = _exposed(
            2 * state.optimizer / bw, update, ov)
    if state.params and not cand.host_update:
        parts["offload streamed gradients to the device"] = state.params / bw
        parts["offload new weights to the host"] = state.params / bw
    step = sum(parts.values()) - layers
    return OffloadTimes(layers, step, device_update, {k: v for k, v in parts.items() if v})


def host_fits(memory: dict[str, float], chip: Chip, headroom: float) -> bool:
    """Whether the host bytes fit the host memory the runtime will pin for the chip
    (:attr:`~jaxpar.planner.catalog.Chip.host_pool_bytes`; unknown: not checked)."""
    return not chip.host_bytes or memory.get("host_bytes", 0.0) <= (
        headroom * chip.host_pool_bytes)


# --- explanation --------------------------------------------------------------------------
def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def moved_text(est: Any) -> str:
    """What a plan (a :class:`jaxpar.planner.cost.Estimate`, which imports this module)
    keeps in host memory, per device, in words."""
    cand, mem = est.candidate, est.memory
    parts = []
    if mem.get("host_opt_bytes"):
        what = ("optimizer state (f32 master weights and moments)" if mem.get("master_bytes")
                else "optimizer state (moments)")
        frac = "" if cand.offload_optimizer == 1 else f" ({cand.offload_optimizer:g} of it)"
        how = ("updated on the host" if cand.host_update
               else "streamed through the device for the update")
        parts.append(f"{what}{frac} {_gib(mem['host_opt_bytes'])}, {how}")
    if mem.get("host_param_bytes"):
        parts.append(f"decoder layer weights {_gib(mem['host_param_bytes'])}, streamed in "
                     "layer by layer")
    if mem.get("host_activation_bytes"):
        names = cand.remat.split(":", 1)[1].replace(",", ", ") if ":" in cand.remat else (
            "matmul outputs")
        parts.append(f"activations ({names}) {_gib(mem['host_activation_bytes'])}")
    return "; ".join(parts)


def offload_note(est: Any) -> str:
    """Why and at what cost a plan offloads: what moved to host memory (GiB per device),
    the seconds a step it adds, and, when the search found nothing without offload, the
    leanest plan without it (``est.notes["no_offload"]``, a fitting one when it fits)."""
    mem = est.memory
    host = mem.get("host_bytes", 0.0)
    limit = est.host_capacity_bytes
    of = f" of {_gib(limit)}" if limit else ""
    cost = sum(v for k, v in est.breakdown.items() if k.startswith("offload"))
    text = (f"host offload moves {_gib(host)} per device to host memory{of} "
            f"({moved_text(est)}), at {cost:.3f} s a step exposed "
            f"({cost / est.step_time_s * 100:.0f}% of {est.step_time_s:.3f} s)")
    base = est.notes.get("no_offload")
    if base is None:
        return text
    if not base.fits:
        return (f"{text}; nothing fits without offload (the leanest plan without it, "
                f"{base.candidate.describe()}, zero {base.candidate.zero_stage}, remat "
                f"{base.candidate.remat}, needs {_gib(base.memory_per_device_bytes)} of "
                f"{_gib(0.9 * base.hbm_bytes)} usable per device)")
    gain = 1 - est.step_time_s / base.step_time_s if base.step_time_s else 0.0
    return (f"{text}; {gain * 100:.0f}% faster than the best plan without offload "
            f"({base.candidate.describe()}, {base.step_time_s:.3f} s)")


def summary(est: Any) -> dict[str, Any]:
    """The offload fields of a plan's JSON summary."""
    c = est.candidate
    return {"offload_optimizer": c.offload_optimizer, "host_update": c.host_update,
            "offload_params": c.offload_params, "offload": c.offload_text(),
            "host_bytes": int(est.memory.get("host_bytes", 0)),
            "host_capacity_bytes": int(est.host_capacity_bytes),
            "offload_s": sum(v for k, v in est.breakdown.items() if k.startswith("offload"))}


__all__ = ["REMATS", "STAGING_LAYERS", "STATES", "STREAMED_LAYERS", "UPDATE_SLABS",
           "OffloadTimes", "StateOffload", "check", "host_fits", "is_streamed",
           "moved_text", "offload_note", "offload_times", "optimizer_offload",
           "state_offload", "streamed_params", "summary"]
