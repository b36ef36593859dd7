"""Compilation targets: the devices a training step is compiled for, which need not be
attached to this machine.

``tpu-v5p:4x4x4`` names a TPU slice by generation and topology (chips along each torus
dimension); its devices come from the TPU compiler's topology description
(``jax.experimental.topologies.get_topology_desc``, in libtpu, installed by
``pip install 'jax[tpu]'``), which needs no TPU: XLA's TPU compiler runs on this host and
reports memory, collectives and FLOPs of the program it would run there. ``h100:16``
names NVIDIA GPUs by kind and count (nodes of 8, an NVLink domain each; ``h100:2x8``
says so): XLA's GPU compiler, in jax's CUDA plugin, compiles for them from a description
of the GPU (:data:`GPU_SPECS`) without a GPU or its driver. ``cpu`` is this machine's own
devices (with ``--devices N``, N simulated CPU devices), on which the compiled program
can also run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from jaxpar.analysis.tpu_log import unbuffer_compiler_log
from jaxpar.errors import JaxparError
from jaxpar.planner.catalog import ALIASES, BUILTIN, Chip, Machine, cpu_chip
from jaxpar.sharding.backends import libtpu_start_summarised, start_summarised

GENERATIONS = {"v4": "v4", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "v7": "tpu7x",
               "tpu7x": "tpu7x", "v7x": "tpu7x", "trillium": "v6e", "ironwood": "tpu7x"}
"""TPU generation as a target names it -> libtpu's topology prefix."""

CATALOG_KIND = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e",
                "tpu7x": "tpu-v7"}
"""libtpu's topology prefix -> the planner catalog's chip kind."""

TORUS_DIMS = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2, "tpu7x": 3}
"""Dimensions of each generation's topology (``2x4`` or ``4x4x4``)."""

_TARGET = re.compile(r"^(?:tpu-?)?(?P<gen>[a-z0-9]+):(?P<topo>\d+(?:x\d+){1,2})$")
_GPU_TARGET = re.compile(r"^(?P<kind>[a-z0-9-]+):(?:(?P<nodes>\d+)x)?(?P<gpus>\d+)$")


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA's GPU compiler reads of a GPU it compiles for without one: its
    ``GpuTargetConfigProto`` (the figures a CUDA device reports; from the datasheets, and
    for the memory size what the devices report, a little under the nominal size)."""

    name: str
    compute_capability: tuple[int, int]
    sms: int
    fp32_per_sm: int
    shared_per_sm: int
    shared_per_block_optin: int
    l2_bytes: int
    clock_ghz: float
    memory_bandwidth: float
    memory_bytes: int

    def target_config(self) -> str:
        """The text proto ``jax.experimental.topologies`` passes the compiler."""
        info = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
                "shared_memory_per_block": 49152, "shared_memory_per_core": self.shared_per_sm,
                "threads_per_core_limit": 2048, "core_count": self.sms,
                "fpus_per_core": self.fp32_per_sm, "block_dim_limit_x": 2**31 - 1,
                "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
                "memory_bandwidth": int(self.memory_bandwidth),
                "l2_cache_size": self.l2_bytes, "clock_rate_ghz": self.clock_ghz,
                "device_memory_size": self.memory_bytes,
                "shared_memory_per_block_optin": self.shared_per_block_optin,
                "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
        major, minor = self.compute_capability
        lines = "\n".join(f"  {k}: {v}" for k, v in info.items())
        return (f"gpu_device_info {{\n{lines}\n  cuda_compute_capability {{ major: {major} "
                f"minor: {minor} }}\n}}\nplatform_name: \"CUDA\"\n"
                "dnn_version_info { major: 9 minor: 8 }\n"
                "runtime_version { major: 12 minor: 8 }\n"
                f"device_description_str: \"{self.name}\"\n")


GPU_SPECS = {
    "a100-80gb": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 167936, 166912,
                         40 * 2**20, 1.41, 2039e9, 85_094_400_000),
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 233472, 232448, 50 * 2**20,
                    1.98, 3352e9, 84_929_347_584),
    "h200": GpuSpec("NVIDIA H200", (9, 0), 132, 128, 233472, 232448, 50 * 2**20, 1.98,
                    4800e9, 150_754_820_096),
}
"""The GPUs a step can be compiled for, by the planner catalog's kind."""


def tpu_compiler_missing() -> str | None:
    """Why the TPU compiler cannot be used here (one line), or None when it can."""
    if importlib.util.find_spec("libtpu") is None:
        import jax

        return ("the TPU compiler (libtpu) is not installed: pip install "
                f"'jax[tpu]=={jax.__version__}' (or jaxpar's extra: pip install 'jaxpar[tpu]')")
    return None


def gpu_compiler_missing() -> str | None:
    """Why XLA's GPU compiler cannot be used here (one line), or None when it can: it is
    in jax's CUDA plugin (a bf16 step's attention, cuDNN's, also needs cuDNN)."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        import jax

        return ("the GPU compiler (jax's CUDA plugin) is not installed: pip install "
                f"'jax[cuda12-local]=={jax.__version__}' (or jaxpar's extra: pip install "
                "'jaxpar[gpu-compile]', which adds cuDNN)")
    return None


def cudnn_installed() -> bool:
    """Whether cuDNN's wheel (``nvidia-cudnn-cu12``) is installed."""
    try:
        return importlib.util.find_spec("nvidia.cudnn") is not None
    except ModuleNotFoundError:  # no nvidia package at all
        return False


CUDNN_MISSING = ("the step's attention is cuDNN's (model.attention=auto in bf16 on GPUs) and "
                 "cuDNN is not installed: pip install 'nvidia-cudnn-cu12>=9.8,<10' (or "
                 "compile with model.attention=chunked)")


@dataclasses.dataclass(frozen=True)
class Target:
    """Devices to compile a step for, and what the planner knows of them.

    Attributes:
      name: the target as given, e.g. ``tpu-v5p:4x4x4``.
      platform: ``tpu``, ``gpu`` or ``cpu``.
      devices: the devices, in the topology's order (slices consecutive).
      slices: slices (GPU nodes) joined by the DCN (InfiniBand).
      chips: chips in all slices.
      chip: the catalog's figures for one device (a chip, or for chips that expose two
        TensorCores as devices, half a chip).
      topology: libtpu's topology name (``v5p:4x4x4``), the GPUs' (``1x2x8``: one
        slice of 2 nodes of 8), or ``""`` for ``cpu``.
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
            f"name GPUs as KIND:COUNT, e.g. h100:16 ({', '.join(GPU_SPECS)}), or be cpu")
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
    unbuffer_compiler_log()  # its account of each program's HBM, read after the compile
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


def gpu_target(text: str) -> Target:
    """The devices of ``count`` GPUs named like ``h100:16`` (nodes of the catalog's NVLink
    domain, 8) or ``h100:2x8`` (nodes x GPUs a node), for XLA's GPU compiler.

    Raises:
      JaxparError: for a malformed name, a GPU not in :data:`GPU_SPECS`, a node larger
        than an NVLink domain, or a missing GPU compiler (the line says what to install).
    """
    m = _GPU_TARGET.match(text.strip().lower())
    kind = ALIASES.get(m["kind"], m["kind"]) if m else None
    if kind not in GPU_SPECS:
        raise JaxparError(f"--target {text!r} must name GPUs as KIND:COUNT or "
                          f"KIND:NODESxGPUS, e.g. h100:8 or h100:2x8 (kinds: "
                          f"{', '.join(GPU_SPECS)})")
    chip = BUILTIN[kind]
    count = int(m["gpus"]) * int(m["nodes"] or 1)
    per_node = int(m["gpus"]) if m["nodes"] else min(count, chip.domain)
    if count < 1 or count % per_node or per_node > chip.domain:
        raise JaxparError(f"--target {text!r}: {count} GPUs do not make nodes of at most "
                          f"{chip.domain} (an NVLink domain)")
    why = gpu_compiler_missing()
    if why:
        raise JaxparError(f"--target {text!r}: {why}")
    # The plugin checks the CUDA runtime's version as it registers, unless the platforms
    # exclude CUDA: compiling needs no runtime (the check is read when JAX first looks for
    # its plugins).
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    nodes = count // per_node
    topology = f"1x{nodes}x{per_node}"
    try:
        with start_summarised("jax's CUDA plugin", "starting the GPU compiler",
                              "it looks for a CUDA driver; compiling for a GPU needs none"):
            desc = topologies.get_topology_desc(
                platform="cuda", topology_name="", target_config=GPU_SPECS[kind].target_config(),
                topology=topology)
    except NotImplementedError:
        raise JaxparError(
            f"--target {text!r}: jax's CUDA plugin did not register in this process (it "
            "checked for a CUDA runtime when JAX started): set JAX_PLATFORMS=cpu or "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before JAX starts") from None
    return Target(text, "gpu", tuple(desc.devices), nodes, count, chip, topology)


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
    """``cpu`` (or None): this machine's devices; ``tpu-GEN:TOPOLOGY``: a TPU slice's;
    ``KIND:COUNT`` (``h100:16``): GPUs'."""
    if text is None or text.strip().lower() in ("cpu", "local"):
        if slices != 1:
            raise JaxparError("--slices needs a TPU --target (e.g. tpu-v5e:2x2 --slices 2)")
        return cpu_target()
    kind = text.strip().lower().partition(":")[0]
    if ALIASES.get(kind, kind) in GPU_SPECS:
        if slices != 1:
            raise JaxparError(f"--slices is for TPU slices; GPU nodes are in the target: "
                              f"--target {kind}:{slices}x8")
        return gpu_target(text)
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
