"""Compilation targets: the devices a training step is compiled for, which need not be
attached to this machine.

``tpu-v5p:4x4x4`` names a TPU slice by generation and topology (chips along each torus
dimension); its devices come from the TPU compiler's topology description
(``jax.experimental.topologies.get_topology_desc``, in libtpu, installed by
``pip install 'jax[tpu]'``), which needs no TPU: XLA's TPU compiler runs on this host and
reports memory, collectives and FLOPs of the program it would run there. ``cpu`` is this
machine's own devices (with ``--devices N``, N simulated CPU devices), on which the
compiled program can also run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.planner.catalog import BUILTIN, Chip, Machine, cpu_chip
from jaxpar.sharding.backends import libtpu_start_summarised

GENERATIONS = {"v4": "v4", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "v7": "tpu7x",
               "tpu7x": "tpu7x", "v7x": "tpu7x", "trillium": "v6e", "ironwood": "tpu7x"}
"""TPU generation as a target names it -> libtpu's topology prefix."""

CATALOG_KIND = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e",
                "tpu7x": "tpu-v7"}
"""libtpu's topology prefix -> the planner catalog's chip kind."""

TORUS_DIMS = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2, "tpu7x": 3}
"""Dimensions of each generation's topology (``2x4`` or ``4x4x4``)."""

_TARGET = re.compile(r"^(?:tpu-?)?(?P<gen>[a-z0-9]+):(?P<topo>\d+(?:x\d+){1,2})$")


def tpu_compiler_missing() -> str | None:
    """Why the TPU compiler cannot be used here (one line), or None when it can."""
    if importlib.util.find_spec("libtpu") is None:
        import jax

        return ("the TPU compiler (libtpu) is not installed: pip install "
                f"'jax[tpu]=={jax.__version__}' (or jaxpar's extra: pip install 'jaxpar[tpu]')")
    return None


@dataclasses.dataclass(frozen=True)
class Target:
    """Devices to compile a step for, and what the planner knows of them.

    Attributes:
      name: the target as given, e.g. ``tpu-v5p:4x4x4``.
      platform: ``tpu`` or ``cpu``.
      devices: the devices, in the topology's order (slices consecutive).
      slices: slices joined by the DCN.
      chips: chips in all slices.
      chip: the catalog's figures for one device (a chip, or for chips that expose two
        TensorCores as devices, half a chip).
      topology: libtpu's topology name (``v5p:4x4x4``), or ``""`` for ``cpu``.
    """

    name: str
    platform: str
    devices: tuple[Any, ...]
    slices: int
    chips: int
    chip: Chip
    topology: str = ""

    @property
    def hbm_bytes(self) -> float:
        """Device memory of one device (HBM), from the catalog."""
        return self.chip.hbm_bytes

    @property
    def machine(self) -> Machine:
        """The planner's machine for these devices: one catalog chip a device."""
        return Machine(self.chip, len(self.devices), self.slices)

    @property
    def device_kind(self) -> str:
        return str(getattr(self.devices[0], "device_kind", self.platform))

    def describe(self) -> str:
        """E.g. ``tpu-v5p:4x4x4: 64 TPU v5 devices (64 chips, 1 slice)``."""
        s = "slice" if self.slices == 1 else "slices"
        return (f"{self.name}: {len(self.devices)} {self.device_kind} devices "
                f"({self.chips} chips, {self.slices} {s})")


def _host_bounds(dims: Sequence[int]) -> tuple[int, int, int]:
    """Chips per host along each dimension: a 2x2 tray, clipped to the slice."""
    padded = list(dims) + [1] * (3 - len(dims))
    return (min(2, padded[0]), min(2, padded[1]), 1)


def _per_device(chip: Chip, share: int) -> Chip:
    """A chip's figures split over the ``share`` devices it exposes."""
    if share == 1:
        return chip
    split = ("peak_flops", "hbm_bytes", "hbm_bw", "f32_flops", "int8_flops", "fp8_flops",
             "host_bytes", "host_mem_bw", "host_bw", "ici_bw", "dcn_bw", "ici_link_bw")
    return dataclasses.replace(chip, domain=chip.domain * share,
                               **{k: getattr(chip, k) / share for k in split})


def tpu_target(text: str, slices: int = 1) -> Target:
    """The devices of a TPU slice (or ``slices`` of them) named like ``tpu-v6e:2x4``.

    Raises:
      JaxparError: for a malformed name, an unknown generation, a topology libtpu refuses,
        or a missing TPU compiler (the line says what to install).
    """
    m = _TARGET.match(text.strip().lower())
    if not m or m["gen"] not in GENERATIONS:
        raise JaxparError(
            f"--target {text!r} must name a TPU slice as tpu-GEN:TOPOLOGY, e.g. "
            f"tpu-v5p:4x4x4 or tpu-v6e:2x4 (generations: "
            f"{', '.join(sorted(set(GENERATIONS) - {'trillium', 'ironwood', 'v7x'}))}), "
            "or be cpu")
    if slices < 1:
        raise JaxparError(f"--slices {slices}: need at least 1 slice")
    gen = GENERATIONS[m["gen"]]
    dims = [int(d) for d in m["topo"].split("x")]
    if len(dims) != TORUS_DIMS[gen] or min(dims) < 1:
        example = "x".join(["2"] * TORUS_DIMS[gen])
        raise JaxparError(f"--target {text!r}: a {m['gen']} slice has "
                          f"{TORUS_DIMS[gen]} topology dimensions, e.g. {example}")
    why = tpu_compiler_missing()
    if why:
        raise JaxparError(f"--target {text!r}: {why}")
    # Compiling needs no TPU, so several processes may load libtpu at once (its lock file
    # guards a TPU's exclusive use).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    topology = f"{gen}:{m['topo']}"
    try:
        with libtpu_start_summarised():  # libtpu's lines on a host without a TPU, as one
            desc = topologies.get_topology_desc(
                platform="tpu", topology_name=topology,
                chip_config_name="megacore" if gen == "v4" else "default",
                chips_per_host_bounds=_host_bounds(dims), num_slices=slices)
    except Exception as err:  # noqa: BLE001 - libtpu's refusal is the user's answer
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise JaxparError(f"--target {text!r}: the TPU compiler refuses topology "
                          f"{topology!r}: {first}") from None
    devices = tuple(desc.devices)
    chips = math.prod(dims) * slices
    chip = _per_device(BUILTIN[CATALOG_KIND[gen]], len(devices) // chips)
    return Target(text, "tpu", devices, slices, chips, chip, topology)


def cpu_target(devices: Sequence[Any] | None = None) -> Target:
    """This process's devices (simulated CPU devices with ``--devices``)."""
    import jax

    devices = tuple(jax.devices() if devices is None else devices)
    platform = devices[0].platform
    chip = cpu_chip(len(devices)) if platform == "cpu" else _attached_chip(devices)
    return Target(platform, platform, devices, 1, len(devices), chip)


def _attached_chip(devices: Sequence[Any]) -> Chip:
    from jaxpar.planner.catalog import resolve_kind

    kind = str(devices[0].device_kind).lower().replace("tpu ", "tpu-").replace(" lite", "e")
    try:
        return BUILTIN[resolve_kind(kind)]
    except JaxparError:
        return cpu_chip(len(devices))


def parse_target(text: str | None, slices: int = 1) -> Target:
    """``cpu`` (or None): this machine's devices; ``tpu-GEN:TOPOLOGY``: a TPU slice's."""
    if text is None or text.strip().lower() in ("cpu", "local"):
        if slices != 1:
            raise JaxparError("--slices needs a TPU --target (e.g. tpu-v5e:2x2 --slices 2)")
        return cpu_target()
    return tpu_target(text, slices)


def topology_for(kind: str, chips: int) -> str:
    """A slice shape of ``chips`` chips for a catalog kind, as the TPU tooling names it:
    ``tpu-v6e`` and 256 -> ``16x16``, ``tpu-v5p`` and 512 -> ``8x8x8`` (the most cubic
    shape of powers of two, or a multiple of 4 along the last dimension).

    Raises:
      JaxparError: for a kind that is not a TPU, or a count no slice has.
    """
    gen = next((g for g, k in CATALOG_KIND.items() if k == kind), None)
    if gen is None:
        raise JaxparError(f"{kind!r} is not a TPU kind the compiler knows "
                          f"({', '.join(sorted(CATALOG_KIND.values()))})")
    dims = [1] * TORUS_DIMS[gen]
    left, i = chips, 0
    while left % 2 == 0 and left > 1:  # grow the smallest dimension first
        i = min(range(len(dims)), key=lambda d: (dims[d], -d))
        dims[i] *= 2
        left //= 2
    if left > 1:
        dims[-1] *= left
    if math.prod(dims) != chips:
        raise JaxparError(f"no {kind} slice of {chips} chips")
    return "x".join(str(d) for d in sorted(dims, key=lambda d: (d == 1, d)))
