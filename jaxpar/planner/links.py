"""How long a step's collectives take on a machine's links, and the bytes they move.

:mod:`jaxpar.planner.comms` lists a step's collectives as :class:`Transfer` s; here each
is priced: latency per ring step plus bytes on the wire over the bandwidth its mesh axes
get, inside a slice over ICI (or NVLink) and across slices over the DCN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from jaxpar.planner.candidate import Candidate
from jaxpar.planner.catalog import Machine

PHASES = ("forward", "backward", "gradient", "exposed", "update")
"""When a transfer runs, which sets what it can overlap: ``forward`` and ``backward``:
inside the layers' forward or backward pass, prefetched or issued asynchronously beside
their compute (FSDP weight gathers, the context ring); ``gradient``: a gradient reduction,
issued as each layer's backward finishes (it hides under the backward of the step's last
microbatch only); ``exposed``: the compute waits for it (tensor- and sequence-parallel
activations, the context all-gather, expert all-to-alls, pipeline sends); ``update``:
after the optimizer step (ZeRO 1-2's parameter gather)."""


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective as it runs: ``nbytes`` per execution (result bytes), ``runs``
    executions per step, over ``axes``, in ``phase`` (:data:`PHASES`); ``wire_scale``:
    the bytes it puts on the links inside a slice over a ring of its kind's, as the
    compiler runs it (:meth:`jaxpar.planner.lowering.Lowering.wire_factor`)."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    runs: int
    phase: str
    wire_scale: float = 1.0


_CACHE_MAX = 4096  # entries a cache of this module holds before it starts again


_STEPS = {"all-reduce": lambda n: 2 * (n - 1), "collective-permute": lambda n: 1}
"""Sequential steps of a collective's ring over ``n`` devices (each pays the link
latency): ``n - 1`` for gathers, scatters and all-to-all, ``2 (n - 1)`` for an all-reduce
(a reduce-scatter, then an all-gather), 1 for a permute to a neighbour."""


def transfer_time(tr: Transfer, cand: Candidate, machine: Machine) -> float:
    """Seconds of one transfer's executions in a step: per execution, latency x ring steps
    plus bytes on the wire over the bandwidth the axes get, hierarchically: inside a
    slice over ICI (:meth:`~jaxpar.planner.catalog.Chip.axis_bandwidth`: the torus links
    the axes span, or the NVLink switch), then across slices over the DCN with ``1 /
    n_ici`` of the payload per device (an all-to-all sends its share for other slices
    itself). Bytes on the wire per device, as a multiple of the payload: ``2 (n-1)/n`` for
    an all-reduce, ``(n-1)/n`` for the others (the payload is the result for an
    all-gather, the input for a reduce-scatter, the buffer for an all-reduce or
    all-to-all), the block itself for a permute."""
    return link_terms(tr.kind, tr.axes, cand, machine).time(tr)


class Link(NamedTuple):
    """One kind of collective over some axes of a mesh, as :func:`transfer_time` prices
    it: its name (a key of :attr:`~jaxpar.planner.cost.Estimate.comm_s`), devices spanned
    in and across slices, and per level ring-step latency, wire bytes per payload byte and
    bandwidth (a permute: its one hop's, over whichever network it crosses, as ICI)."""

    name: str
    n_ici: int
    n_dcn: int
    ici_lat: float
    ici_wire: float
    ici_bw: float
    dcn_lat: float
    dcn_wire: float
    dcn_bw: float

    def time(self, tr: Transfer) -> float:
        """:func:`transfer_time` of ``tr``, a transfer of this kind over these axes."""
        if tr.kind == "collective-permute":
            return tr.runs * (self.ici_lat + tr.nbytes / self.ici_bw)
        n_ici, n_dcn = self.n_ici, self.n_dcn
        payload = tr.nbytes * n_ici * n_dcn if tr.kind == "reduce-scatter" else tr.nbytes
        t = 0.0
        if n_ici > 1:
            t += self.ici_lat + self.ici_wire * tr.wire_scale * payload / self.ici_bw
        if n_dcn > 1:
            wire = self.dcn_wire * _dcn_share(tr.kind, payload, n_ici)
            t += self.dcn_lat + wire / self.dcn_bw
        return tr.runs * t


def link_terms(kind: str, axes: tuple[str, ...], cand: Candidate, machine: Machine) -> Link:
    """:class:`Link` for ``kind`` over ``axes`` of ``cand``'s mesh on ``machine``,
    computed once per mesh and machine (a search prices hundreds of thousands)."""
    links = mesh_links(cand, machine)
    link = links.get((kind, axes))
    if link is None:
        link = links[(kind, axes)] = _link(kind, axes, cand, machine)
    return link


def mesh_links(cand: Candidate, machine: Machine) -> dict[tuple[str, tuple[str, ...]], Link]:
    """The :class:`Link` of each (kind, axes) known so far for ``cand``'s mesh on
    ``machine``: look one up here, and :func:`link_terms` for one not yet known."""
    key = (cand.ici, cand.dcn, id(machine))
    hit = _LINKS.get(key)
    if hit is None or hit[0] is not machine:
        if len(_LINKS) >= _CACHE_MAX:
            _LINKS.clear()
        hit = _LINKS[key] = (machine, {})
    return hit[1]


_LINKS: dict[tuple, tuple[Machine, dict[tuple[str, tuple[str, ...]], Link]]] = {}


def _link(kind: str, axes: tuple[str, ...], cand: Candidate, machine: Machine) -> Link:
    dcn, ici = dict(cand.dcn), dict(cand.ici)
    n_ici = math.prod(ici[a] for a in axes)
    n_dcn = math.prod(dcn.get(a, 1) for a in axes)
    chip = machine.chip
    eff = chip.collective_efficiency
    steps = _STEPS.get(kind, lambda n: n - 1)
    name = f"{kind} {'x'.join(axes)}"
    if kind == "collective-permute":
        if n_dcn > 1:
            bw, lat = chip.dcn_bw, chip.dcn_latency_s
        else:
            bw = chip.axis_bandwidth(n_ici, machine.per_slice)
            bw, lat = (bw / 2 if chip.torus_dims else bw), chip.ici_latency_s
        return Link(name, n_ici, n_dcn, lat, 1.0, bw * eff, 0.0, 0.0, 0.0)
    ici_lat = ici_wire = ici_bw = dcn_lat = dcn_wire = dcn_bw = 0.0
    if n_ici > 1:
        ici_bw = chip.axis_bandwidth(n_ici, machine.per_slice) * eff
        ici_lat, ici_wire = steps(n_ici) * chip.ici_latency_s, _wire(kind, n_ici)
    if n_dcn > 1:
        dcn_lat, dcn_wire = steps(n_dcn) * chip.dcn_latency_s, _wire(kind, n_dcn)
        dcn_bw = chip.dcn_bw * eff
    return Link(name, n_ici, n_dcn, ici_lat, ici_wire, ici_bw, dcn_lat, dcn_wire, dcn_bw)


def _wire(kind: str, n: int) -> float:
    """Bytes on the wire per device per byte of payload over ``n`` devices."""
    return 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n


def wire_bytes(kind: str, result_bytes: float, n: int) -> float:
    """Bytes a device receives over the links for one collective of ``kind`` whose result
    is ``result_bytes`` a device, over ``n`` devices, run as a ring: ``(n-1)/n`` of the
    result for an all-gather or all-to-all, ``2 (n-1)/n`` of the buffer for an all-reduce,
    ``n - 1`` results (the input less this device's share) for a reduce-scatter, the block
    itself for a permute. The unit in which a compiled program's collectives, whatever
    form the compiler gives them (a collective matmul's permutes), compare with the
    planner's (:func:`jaxpar.analysis.hlo.collective_table`)."""
    if kind == "collective-permute":
        return float(result_bytes)
    if n <= 1:
        return 0.0
    if kind == "reduce-scatter":
        return float(result_bytes) * (n - 1)
    return float(result_bytes) * _wire(kind, n)


def _dcn_share(kind: str, payload: float, n_ici: int) -> float:
    """The payload a device carries across slices: after the in-slice phase each device
    holds ``1 / n_ici`` of it (an all-to-all sends its share for other slices itself)."""
    return payload if kind == "all-to-all" else payload / n_ici


def dcn_traffic(tr: Transfer, cand: Candidate, machine: Machine) -> tuple[float, float]:
    """(bytes a device sends across slices in a step, seconds that takes) for one
    transfer: the DCN phase of :func:`transfer_time` alone; (0, 0) inside a slice."""
    link = link_terms(tr.kind, tr.axes, cand, machine)
    if link.n_dcn == 1:
        return 0.0, 0.0
    if tr.kind == "collective-permute":  # the link's one hop is across slices
        return tr.runs * tr.nbytes, tr.runs * (link.ici_lat + tr.nbytes / link.ici_bw)
    n_ici = link.n_ici
    payload = tr.nbytes * n_ici * link.n_dcn if tr.kind == "reduce-scatter" else tr.nbytes
    wire = link.dcn_wire * _dcn_share(tr.kind, payload, n_ici)
    return tr.runs * wire, tr.runs * (link.dcn_lat + wire / link.dcn_bw)
