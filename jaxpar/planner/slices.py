"""What crossing slices costs a plan, synchronously and with DiLoCo.

On a multislice machine the ``data`` axis (and any other axis given DCN slices) spans
slices joined by the data-centre network. For the plan the cost model chose
(:class:`~jaxpar.planner.cost.Estimate`) this module prices, per device and step:

* **synchronous** training: the DCN phase of every collective over an axis that crosses
  slices (:func:`jaxpar.planner.links.dcn_traffic`: after the in-slice phase each device
  carries ``1 / n_ici`` of the payload across, ``2 (s - 1) / s`` of it on the wire for an
  all-reduce over ``s`` slices, ``(s - 1) / s`` for the others). The cost model already
  counts the gradient reductions among them as exposed;
* **hpZ** (``plan.hpz``, when the plan keeps weights split over ``data``): the same
  synchronous step with the weights gathered across slices once a step and the
  gradients reduced inside the slice first, as the cost model prices it, and the
  in-slice copy's memory;
* **DiLoCo** (:mod:`jaxpar.training.diloco`) every ``H`` steps: the inner steps send
  nothing over ``data``; a meeting all-reduces the outer gradient in float32 over the
  slices, ``4 P / w`` bytes a device (``P`` parameters split over the ``w`` devices of a
  replica's non-``data`` axes), amortised as ``1 / H`` of it a step. Its step is the
  synchronous one without the exposed gradient reductions across slices, plus a
  meeting's DCN time over ``H`` (the meeting blocks the next step: its all-reduce is
  not overlapped). It holds the anchor and the outer momentum, ``8 P / w`` more bytes.

:func:`recommend` keeps synchronous training while the DCN time its step waits for (the
exposed reductions; weight gathers across slices hide under compute) is at most
:data:`SYNC_SHARE` of the step (DiLoCo changes the optimisation, which costs tokens to
the same loss); past that, DiLoCo at the smallest ``H`` whose amortised meeting is at
most :data:`DILOCO_SHARE` of its step (the DiLoCo papers train well at ``H`` from 10 to
a few hundred).
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.planner.catalog import Machine
from jaxpar.planner.cost import Estimate
from jaxpar.planner.links import Transfer, dcn_traffic

SYNC_SHARE = 0.10
"""Largest share of the step synchronous training may spend across slices."""
DILOCO_SHARE = 0.05
"""Largest share of the step DiLoCo's amortised meeting may take."""
SYNC_EVERY = (10, 50, 100, 500)
"""The ``H`` values the report prices."""


@dataclasses.dataclass(frozen=True)
class SliceOption:
    """One way to train across slices, per device and step: bytes sent over the DCN and
    the seconds the link is busy with them, the part of those the step waits for, the
    step time, and device bytes beyond the plan's."""

    method: str
    sync_every: int
    dcn_bytes: float
    dcn_s: float
    exposed_s: float
    step_time_s: float
    extra_bytes: float

    @property
    def dcn_share(self) -> float:
        """Share of the step that waits for the DCN."""
        return self.exposed_s / self.step_time_s if self.step_time_s else 0.0


def _transfers(est: Estimate) -> list[Transfer]:
    """The estimate's collectives as one transfer per (kind, axes) row (its mean bytes
    over all its executions: the same bytes and latency count)."""
    return [Transfer(r["kind"], tuple(r["axes"]), r["bytes_per_step"] / r["executions"],
                     r["executions"], "exposed")
            for r in est.collectives if r["executions"]]


def replica_params(est: Estimate, n_params: float) -> float:
    """Parameters each device of a replica holds when the weights are whole over
    ``data`` and split over the slice's other axes."""
    ici = dict(est.candidate.ici)
    return n_params / max(math.prod(s for a, s in ici.items() if a != "data"), 1)


def _synchronous(est: Estimate, machine: Machine, method: str, base: Estimate | None = None
                 ) -> SliceOption:
    """Synchronous training as ``est`` prices it (``base``: the plan it adds memory to)."""
    cand = est.candidate
    sync_bytes = sync_s = 0.0
    for tr in _transfers(est):
        b, t = dcn_traffic(tr, cand, machine)
        sync_bytes, sync_s = sync_bytes + b, sync_s + t
    waits = sum(t for k, t in est.breakdown.items()
                if k.startswith("exposed") and k.endswith("(DCN)"))
    extra = est.memory_per_device_bytes - base.memory_per_device_bytes if base else 0.0
    return SliceOption(method, 1, sync_bytes, sync_s, waits, est.step_time_s, extra)


def options(est: Estimate, machine: Machine, n_params: float,
            sync_every: tuple[int, ...] = SYNC_EVERY, hpz: Estimate | None = None
            ) -> list[SliceOption]:
    """Synchronous training, with hpZ when ``hpz`` (the same plan estimated with
    ``hpz=True``) is given, and DiLoCo at each ``sync_every``, for the plan of ``est`` on
    ``machine`` (a model of ``n_params`` parameters)."""
    cand = est.candidate
    slices = dict(cand.dcn).get("data", 1)
    out = [_synchronous(est, machine, "synchronous")]
    if hpz is not None:
        out.append(_synchronous(hpz, machine, "hpz", est))
    if slices < 2:
        return out
    # DiLoCo keeps the traffic over other axes than data (and the waits for it)
    kept = [dcn_traffic(t, cand, machine) for t in _transfers(est) if "data" not in t.axes]
    kept_bytes, kept_s = sum(b for b, _ in kept), sum(t for _, t in kept)
    exposed = sum(t for k, t in est.breakdown.items() if k.startswith("exposed")
                  and k.endswith("(DCN)") and "data" in k)
    kept_waits = out[0].exposed_s - exposed
    local = replica_params(est, n_params)
    meeting = Transfer("all-reduce", ("data",), 4 * local, 1, "exposed")
    m_bytes, m_s = dcn_traffic(meeting, cand, machine)
    for h in sync_every:
        step = est.step_time_s - exposed + m_s / h
        out.append(SliceOption("diloco", h, kept_bytes + m_bytes / h, kept_s + m_s / h,
                               kept_waits + m_s / h, step, 8 * local))
    return out


def recommend(opts: list[SliceOption]) -> tuple[SliceOption, str]:
    """The option to use and why (see the module docstring; hpZ, when priced, is the
    synchronous choice when its step is faster and it fits)."""
    sync = opts[0]
    share = sync.dcn_share
    hpz = next((o for o in opts if o.method == "hpz"), None)
    diloco = [o for o in opts if o.method == "diloco"]
    if share <= SYNC_SHARE or not diloco:
        if hpz is not None and hpz.step_time_s < sync.step_time_s:
            return hpz, (f"synchronous with hpZ: its step waits {hpz.dcn_share:.1%} for "
                         f"the DCN ({share:.1%} without), for "
                         f"{hpz.extra_bytes / 2**30:.2f} GiB more a device")
        return sync, (f"synchronous: its step waits {share:.1%} of the time for the DCN "
                      f"(at most {SYNC_SHARE:.0%}), so DiLoCo would save little and change "
                      "the optimisation")
    for o in diloco:
        if o.dcn_share <= DILOCO_SHARE:
            return o, (f"DiLoCo H={o.sync_every}: synchronous waits {share:.1%} of its "
                       f"step for the DCN; meeting every {o.sync_every} steps costs "
                       f"{o.dcn_share:.1%}, a step {sync.step_time_s / o.step_time_s:.2f}x "
                       "faster")
    o = diloco[-1]
    return o, (f"DiLoCo H={o.sync_every}: synchronous waits {share:.1%} of its step for the "
               f"DCN; even H={o.sync_every} leaves {o.dcn_share:.1%}")


def report(est: Estimate, machine: Machine, n_params: float,
           hpz: Estimate | None = None) -> str:
    """The table ``jaxpar plan`` prints for a multislice machine."""
    opts = options(est, machine, n_params, hpz=hpz)
    best, why = recommend(opts)
    spans = {a: n for a, n in dict(est.candidate.dcn).items() if n > 1}
    over = " x ".join(f"{a}={n}" if len(spans) > 1 else a for a, n in spans.items())
    lines = [f"across {math.prod(spans.values())} slices ({over or 'nothing'} over DCN), "
             "per device and step:",
             f"  {'method':16} {'DCN bytes':>12} {'DCN s':>9} {'waited s':>9} {'step s':>9} "
             f"{'share':>6} {'extra GiB':>9}"]
    for o in opts:
        name = {"synchronous": "synchronous", "hpz": "sync + hpZ"}.get(
            o.method, f"DiLoCo H={o.sync_every}")
        lines.append(f"  {name:16} {o.dcn_bytes:12.4g} {o.dcn_s:9.4f} {o.exposed_s:9.4f} "
                     f"{o.step_time_s:9.4f} {o.dcn_share:6.1%} {o.extra_bytes / 2**30:9.2f}")
    lines.append(f"  recommended: {why}")
    if best.method == "diloco":
        lines.append(f"  (diloco.sync_every={best.sync_every}; DiLoCo keeps the weights whole "
                     "over data: plan.zero_stage=0, FSDP inside the slice)")
    return "\n".join(lines)
