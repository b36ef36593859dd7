"""Device catalog: what one chip of each kind computes, holds, reads and sends.

Every figure is per chip and comes from a public source named beside it (each entry's
``source``). The roofline cost model (:mod:`jaxpar.planner.roofline`) reads:

* ``peak_flops`` (dense bf16), ``f32_flops`` (the matmul rate in float32: bf16 passes on a
  TPU's MXU, plain FP32 on a GPU's CUDA cores), ``matmul_tile`` (the MXU's or tensor
  cores' tile: a matmul dimension is padded up to a multiple of it);
* ``hbm_bw``: bytes/s between HBM and the cores (the roof of memory-bound work);
* the interconnect: ``torus_dims``, ``ici_links`` and ``ici_link_bw`` (bytes/s one way
  per link) for a TPU slice (a mesh axis gets the links of the torus dimensions it spans),
  or for a switched fabric (NVLink) ``ici_bw``, bytes/s one way per chip whatever the axis
  size; ``domain`` chips share one ICI domain (a slice, an NVLink node); ``dcn_bw``,
  bytes/s one way per chip across domains (TPU DCN, InfiniBand between GPU nodes);
  ``ici_latency_s`` / ``dcn_latency_s`` per step of a collective's ring; ``host_bw``
  (PCIe, host <-> device);
* the host a chip hangs off, for host offload (:mod:`jaxpar.planner.offload`):
  ``host_bytes``, the host memory per chip (the host's DRAM, or its VM's, over the chips
  it drives), and ``host_mem_bw``, that host's memory bandwidth per chip (the rate of an
  optimizer update run on the host);
* and the efficiencies a chip reaches, which are not on datasheets:
  ``matmul_efficiency`` (fraction of the peak that large, well-shaped matmuls sustain in
  a training step), ``memory_efficiency`` (of ``hbm_bw``), ``collective_efficiency`` (of
  the link bandwidth), ``overlap`` (whether collectives run asynchronously beside compute:
  1 on TPUs and GPUs, 0 on XLA:CPU), ``contention`` (the share of a weight gather's or
  gradient reduction's time that stays on the step even when it runs beside compute:
  see :data:`CONTENTION`) and ``op_overhead_s`` (fixed cost per kernel launch).
  The built-in values are fitted on published runs (``benchmarks/published.py --fit``
  prints how; its half of the rows held out is the check), and ``jaxpar calibrate``
  measures them on the machine it runs on.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from jaxpar.errors import JaxparError

GB = 1e9
GiB = 2**30
_GBPS = GB / 8  # one gigabit per second, in bytes per second
HOST_POOL_SHARE = 0.8
"""The share of a host's memory that offloaded state may pin: the rest is the process's
own (Python, the data pipeline, XLA's host buffers) and the system's."""
CONTENTION = 0.0
"""The share of an FSDP or data-parallel collective's time (a layer's weight gather, its
gradient's reduce-scatter or all-reduce) that stays on the step when it runs beside the
layers' compute, every chip's default ``contention``: 0, hiding is free. Such a
collective may not be free beside compute (XLA runs it on a TPU as an asynchronous
collective fusion driven by the TensorCore, whose vector units also do a reduce-scatter's
sums; NCCL's kernels hold SMs and HBM bandwidth on a GPU), and the published runs whose
weight collectives are large beside their compute (a small batch a chip at scale: GPT-3
175B, Llama 2 70B and Llama 3.1 405B on v6e-256, torchtitan's Llama 3 8B on 64 A100s,
MPT-7B on 512 H100s) ran 12-35% slower than free hiding predicts. But
``benchmarks/published.py --fit --contention`` (the chips' efficiencies refitted at each
of 0, 0.25 ... 1) does not settle it: the fit half's median absolute log error is 0.047
at 0, 0.041 at 0.75 and 0.039 at 1 (0.049-0.053 between), and at 1 the held-out half is
no better (41 of 51 within 15%, median 6.5%, as at 0: those five runs come within 4-15%,
NeMo-AutoModel's 70B FSDP x context run falls to -31%, torchtitan's 70B on 256 H100s and
128B on 32 v5e slices to +19%), with a v5e matmul efficiency of 0.96 and the planner
then preferring tensor parallelism (whose collective matmul hides whole on a TPU) to FSDP
for a 7B model on v5p-256. Kept at 0 until the TPU's collective matmuls are known to hide
whole or not (``benchmarks/tpu_compile.py`` compares collectives, not their overlap); a
catalog entry may set it."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator kind (see the module docstring for what each figure means).

    Attributes:
      name: catalog key, e.g. ``tpu-v5p``.
      peak_flops: dense bf16 FLOP/s.
      hbm_bytes: device memory.
      ici_bw: bytes/s one way one chip sends into a collective on a switched fabric
        (NVLink); on a torus, the sum over its links (used when ``ici_links`` is 0).
      dcn_bw: bytes/s one way per chip across ICI domains.
      domain: chips per ICI domain (slice / NVLink node).
      hbm_bw: HBM bytes/s.
      f32_flops: float32 matmul FLOP/s (0: a third of ``peak_flops``, three bf16 passes).
      matmul_tile: matmul dimensions are padded to a multiple of this.
      torus_dims: 2 or 3 for a TPU torus, 0 for a switched fabric.
      ici_links: ICI links per chip (torus).
      ici_link_bw: bytes/s one way per link (torus).
      ici_latency_s: seconds per ring step of a collective inside a domain.
      dcn_latency_s: seconds per ring step across domains.
      host_bw: host <-> device bytes/s (PCIe).
      matmul_efficiency: fraction of the peak large matmuls sustain.
      memory_efficiency: fraction of ``hbm_bw`` streaming work sustains.
      collective_efficiency: fraction of link bandwidth collectives sustain.
      overlap: 1 when collectives run beside compute (asynchronously), 0 when they block.
      contention: share of an overlapped FSDP / data-parallel collective's time (weight
        gathers, gradient reductions) the compute beside it still loses
        (:data:`CONTENTION`).
      op_overhead_s: fixed seconds per kernel (launch, pipeline fill).
      saved_bw: bytes/s at which the activations a layer scan saves for the backward
        pass are stored and read back, beyond their compute (XLA:CPU: far below its
        streaming rate); 0 where that traffic is part of the roofline's memory terms.
      host_bytes: host memory per chip for offloaded state (0: not known, not checked).
      host_mem_bw: host memory bytes/s per chip, the roof of an optimizer update run on
        the host (0: not known; :attr:`host_update_bw` then assumes four times
        ``host_bw``).
      int8_flops, fp8_flops: dense int8 / fp8 matmul op/s (0: no faster 8-bit path, such
        matmuls run at ``peak_flops``).
      source: where the figures come from.
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    ici_bw: float
    dcn_bw: float
    domain: int
    hbm_bw: float = 1e12
    f32_flops: float = 0.0
    matmul_tile: int = 128
    torus_dims: int = 0
    ici_links: int = 0
    ici_link_bw: float = 0.0
    ici_latency_s: float = 2e-6
    dcn_latency_s: float = 2e-5
    host_bw: float = 32 * GB
    matmul_efficiency: float = 0.75
    memory_efficiency: float = 0.85
    collective_efficiency: float = 0.8
    overlap: float = 1.0
    contention: float = CONTENTION
    op_overhead_s: float = 0.0
    saved_bw: float = 0.0
    host_bytes: float = 0.0
    host_mem_bw: float = 0.0
    int8_flops: float = 0.0
    fp8_flops: float = 0.0
    source: str = ""

    def quantized_flops(self, mode: str) -> float:
        """Matmul op/s of ``mode`` (``int8``, ``fp8``) operands: the 8-bit rate, or the
        bf16 peak where the chip has none."""
        rate = {"int8": self.int8_flops, "fp8": self.fp8_flops}.get(mode, 0.0)
        return rate or self.peak_flops

    @property
    def host_pool_bytes(self) -> float:
        """Host memory per chip that offloaded state can occupy: the share of the host's
        memory (:data:`HOST_POOL_SHARE`) jaxpar sizes the runtime's pinned pool to at
        most (:mod:`jaxpar.runs.host_memory`); 0 where the host's memory is not known."""
        return HOST_POOL_SHARE * self.host_bytes

    @property
    def host_update_bw(self) -> float:
        """Host memory bytes/s per chip an update on the host streams at."""
        return self.host_mem_bw or 4 * self.host_bw

    @property
    def matmul_flops_f32(self) -> float:
        """float32 matmul FLOP/s."""
        return self.f32_flops or self.peak_flops / 3

    def axis_bandwidth(self, n: int, per_slice: int) -> float:
        """Bytes/s one way one chip puts into a collective over ``n`` chips of one ICI
        domain of ``per_slice`` chips.

        On a torus of ``torus_dims`` dimensions each ``per_slice ** (1 / torus_dims)``
        long, an axis of ``n`` chips spans ``ceil(log n / log side)`` of them and sends
        both ways on each (a bidirectional ring): ``2 x ici_link_bw`` per dimension. A
        switched fabric gives every axis ``ici_bw``.
        """
        if n <= 1:
            return math.inf
        if not self.torus_dims or not self.ici_links:
            return self.ici_bw
        side = max(per_slice ** (1 / self.torus_dims), 2.0)
        dims = min(self.torus_dims, max(1, math.ceil(math.log(n) / math.log(side) - 1e-9)))
        return 2 * dims * self.ici_link_bw


# Host offload figures (``host_bytes``, ``host_mem_bw``), per chip. GPUs: the DGX system's
# DRAM and its two CPUs' memory bandwidth (DDR channels x transfer rate x 8 bytes a
# socket) over its eight GPUs. TPUs: the TPU VM's RAM over its chips, from the Cloud TPU
# pages (v4: the ct4p-hightpu-4t machine type, 407 GB for 4 chips); the hosts' memory
# bandwidth is not published: two sockets of 8 DDR5-4800 channels (614 GB/s) over the
# chips of a host are assumed (DDR4-3200 for v4).
_DDR5_4800_2S = 2 * 8 * 4800e6 * 8
_DDR4_3200_2S = 2 * 8 * 3200e6 * 8

# 8-bit matmul rates (dense): TPU v4 runs int8 at its bf16 rate; v5e 394, v5p 918 and
# v6e 1836 int8 TOP/s (Cloud TPU pages); v7 4614 fp8 TFLOP/s; A100 624 int8 TOP/s (no
# fp8); H100 and H200 1979 int8 / fp8, B200 4500 (datasheets).
BUILTIN: dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s, 3D torus,
    # 4096-chip pod. ICI: six links of 50 GB/s (Jouppi et al., "TPU v4", ISCA 2023); MXU
    # 128x128. DCN per chip is not published for v4: 25 Gbps assumed.
    "tpu-v4": Chip("tpu-v4", 275e12, 32 * GiB, 300 * GB, 25 * _GBPS, 4096, hbm_bw=1200 * GB,
                   matmul_tile=128, torus_dims=3, ici_links=6, ici_link_bw=45 * GB,
                   host_bw=16 * GB, host_bytes=407 * GB / 4, host_mem_bw=_DDR4_3200_2S / 4,
                   matmul_efficiency=0.92, memory_efficiency=0.6,
                   int8_flops=275e12,
                   source="cloud.google.com/tpu/docs/v4; ISCA 2023 TPU v4 paper; "
                          "jax-ml.github.io/scaling-book (TPUs)"),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GiB HBM2 at 819 GB/s (libtpu's
    # compiler, refusing a step, gives 15.75 GiB of it to a program), ICI
    # 1600 Gbps over 4 links (2D torus), pod of 256, DCN 6.4 Tbps per pod (25 Gbps a chip);
    # MXU 128x128. Host: ct5lp-hightpu-8t VMs, 384 GB for 8 chips.
    "tpu-v5e": Chip("tpu-v5e", 197e12, 16 * GiB, 1600 * _GBPS, 25 * _GBPS, 256,
                    hbm_bw=819 * GB, matmul_tile=128, torus_dims=2, ici_links=4,
                    ici_link_bw=45 * GB, host_bw=16 * GB, host_bytes=384 * GB / 8,
                    host_mem_bw=_DDR5_4800_2S / 8, matmul_efficiency=0.86, memory_efficiency=1.0,
                    int8_flops=394e12, source="cloud.google.com/tpu/docs/v5e; scaling-book (TPUs)"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2765 GB/s, ICI
    # 4800 Gbps over 6 links (3D torus), DCN 50 Gbps per chip, slices up to 6144 chips;
    # MXU 128x128. Host: 448 GB of RAM and 208 vCPUs for the 4 chips of a VM.
    "tpu-v5p": Chip("tpu-v5p", 459e12, 95 * GiB, 4800 * _GBPS, 50 * _GBPS, 6144,
                    hbm_bw=2765 * GB, matmul_tile=128, torus_dims=3, ici_links=6,
                    ici_link_bw=90 * GB, host_bw=16 * GB, host_bytes=448 * GB / 4,
                    host_mem_bw=_DDR5_4800_2S / 4, matmul_efficiency=0.76, memory_efficiency=0.7,
                    int8_flops=918e12, source="cloud.google.com/tpu/docs/v5p; scaling-book (TPUs)"),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GiB HBM at 1640 GB/s (libtpu's
    # compiler gives a program 31.25 GiB of it), ICI
    # 3584 Gbps over 4 links (2D torus), pod of 256, DCN 25.6 Tbps per pod (100 Gbps a
    # chip); MXU 256x256. Host: 1536 GiB of DRAM for 8 chips.
    "tpu-v6e": Chip("tpu-v6e", 918e12, 32 * GiB, 3584 * _GBPS, 100 * _GBPS, 256,
                    hbm_bw=1640 * GB, matmul_tile=256, torus_dims=2, ici_links=4,
                    ici_link_bw=90 * GB, host_bw=32 * GB, host_bytes=1536 * GiB / 8,
                    host_mem_bw=_DDR5_4800_2S / 8, matmul_efficiency=0.84, memory_efficiency=1.0,
                    int8_flops=1836e12,
                    source="cloud.google.com/tpu/docs/v6e; scaling-book (TPUs)"),
    # cloud.google.com/tpu/docs/tpu7x (Ironwood): 2307 TFLOP/s bf16 (4614 fp8), 192 GB
    # GiB HBM3e at 7.38 TB/s, a 3D torus of 4x4x4 cubes (links as v5p's: scaling-book),
    # 9216-chip superpod; MXU 256x256 (not published: taken as v6e's). Its host figures
    # are not in the catalog (offloaded bytes are not checked against host memory).
    "tpu-v7": Chip("tpu-v7", 2307e12, 192 * GiB, 540 * GB, 100 * _GBPS, 9216,
                   hbm_bw=7380 * GB, matmul_tile=256, torus_dims=3, ici_links=6,
                   ici_link_bw=90 * GB, host_bw=32 * GB,
                   matmul_efficiency=0.86, memory_efficiency=0.9,
                   fp8_flops=4614e12, source="cloud.google.com/tpu/docs/tpu7x"),
    # NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s dense bf16, 19.5 TFLOP/s FP32, 80 GB
    # HBM2e at 2039 GB/s, NVLink 600 GB/s (300 each way); DGX A100: 8 GPUs per NVLink
    # domain, one 200 Gb/s HDR InfiniBand port per GPU, PCIe Gen4 x16; DGX A100 640GB:
    # 2 TB of system memory, two AMD EPYC 7742 (8 DDR4-3200 channels each).
    "a100-80gb": Chip("a100-80gb", 312e12, 80 * GB, 300 * GB, 200 * _GBPS, 8,
                      hbm_bw=2039 * GB, f32_flops=19.5e12, matmul_tile=128,
                      ici_latency_s=5e-6, dcn_latency_s=1e-5, host_bw=32 * GB,
                      host_bytes=2000 * GB / 8, host_mem_bw=_DDR4_3200_2S / 8,
                      matmul_efficiency=0.76, memory_efficiency=0.8,
                      int8_flops=624e12, source="NVIDIA A100 datasheet; DGX A100 user guide"),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense bf16, 67 TFLOP/s FP32, 80 GB HBM3 at
    # 3.35 TB/s, NVLink 900 GB/s (450 each way); DGX H100: 8 GPUs, 400 Gb/s NDR per GPU,
    # PCIe Gen5 x16, 2 TB of system memory, two Intel Xeon Platinum 8480C (8 DDR5-4800
    # channels each).
    "h100": Chip("h100", 989e12, 80 * GB, 450 * GB, 400 * _GBPS, 8, hbm_bw=3350 * GB,
                 f32_flops=67e12, matmul_tile=128, ici_latency_s=5e-6, dcn_latency_s=1e-5,
                 host_bw=64 * GB, matmul_efficiency=0.64, memory_efficiency=0.7,
                 host_bytes=2000 * GB / 8, host_mem_bw=_DDR5_4800_2S / 8,
                 int8_flops=1979e12, fp8_flops=1979e12,
                 source="NVIDIA H100 datasheet; DGX H100 user guide"),
    # NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense bf16, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s; HGX H200: 8 GPUs, 400 Gb/s InfiniBand per GPU; DGX H200: 2 TB of
    # system memory, two Xeon Platinum 8480C.
    "h200": Chip("h200", 989e12, 141 * GB, 450 * GB, 400 * _GBPS, 8, hbm_bw=4800 * GB,
                 f32_flops=67e12, matmul_tile=128, ici_latency_s=5e-6, dcn_latency_s=1e-5,
                 host_bw=64 * GB, host_bytes=2000 * GB / 8, host_mem_bw=_DDR5_4800_2S / 8,
                 int8_flops=1979e12, fp8_flops=1979e12,
                 source="NVIDIA H200 datasheet; DGX H200 datasheet"),
    # NVIDIA DGX B200 datasheet: 8 GPUs, 1440 GB HBM3e (180 GB each) at 8 TB/s a GPU,
    # 72 PFLOP/s FP8 training for eight (4.5 PFLOP/s dense FP8, 2.25 dense bf16 a GPU),
    # NVLink 5 at 1.8 TB/s (900 GB/s each way), ConnectX-7 400 Gb/s per GPU, 2 TB of
    # system memory, two Xeon Platinum 8570 (8 DDR5-5600 channels each).
    "b200": Chip("b200", 2250e12, 180 * GB, 900 * GB, 400 * _GBPS, 8, hbm_bw=8000 * GB,
                 f32_flops=75e12, matmul_tile=128, ici_latency_s=5e-6, dcn_latency_s=1e-5,
                 host_bw=64 * GB, host_bytes=2000 * GB / 8,
                 host_mem_bw=2 * 8 * 5600e6 * 8 / 8, int8_flops=4500e12, fp8_flops=4500e12,
                 source="NVIDIA DGX B200 datasheet"),
}

ALIASES = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e",
           "a100": "a100-80gb", "h100-80gb": "h100", "trillium": "tpu-v6e", "v7": "tpu-v7",
           "tpu7x": "tpu-v7", "ironwood": "tpu-v7"}


def cpu_chip(n_devices: int) -> Chip:
    """The host CPU split into ``n_devices`` simulated devices, uncalibrated.

    Rough figures: cores x 2 GHz x 32 f32 FLOP/cycle (AVX2 FMA) and about 8 GB/s of
    memory traffic a core, shared by the simulated devices; host RAM over the devices (as
    device memory, and again as host memory for offloaded state);
    collectives are memory copies that block (``overlap`` 0). ``jaxpar calibrate`` measures
    the real figures (``jaxpar plan --catalog``).
    """
    cores = os.cpu_count() or 1
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GiB
    n = max(n_devices, 1)
    flops = cores * 2e9 * 32 / n
    return Chip("cpu", flops, ram / n, 5 * GB, 5 * GB, 1 << 30, hbm_bw=cores * 8 * GB / n,
                f32_flops=flops, matmul_tile=8, ici_latency_s=2e-5, dcn_latency_s=2e-5,
                host_bw=cores * 8 * GB / n, host_bytes=ram / n,
                host_mem_bw=cores * 8 * GB / n, matmul_efficiency=0.5, memory_efficiency=1.0,
                collective_efficiency=1.0, overlap=0.0, op_overhead_s=5e-6,
                source="host estimate (uncalibrated)")


_REQUIRED = ("peak_flops", "hbm_bytes", "ici_bw", "dcn_bw", "domain")


def chip_from_mapping(name: str, entry: Mapping[str, Any], *, where: str = "") -> Chip:
    """A :class:`Chip` from a mapping of its fields (a catalog file's entry).

    Raises:
      JaxparError: naming the entry, for an unknown or missing field or a value of the
        wrong type.
    """
    types = {f.name: f.type for f in dataclasses.fields(Chip)}
    fields = set(types) - {"name"}
    unknown = set(entry) - fields
    if unknown:
        raise JaxparError(f"catalog entry {name!r} has unknown field {sorted(unknown)[0]!r}"
                          f"; fields are {sorted(fields)}")
    missing = [k for k in _REQUIRED if k not in entry]
    if missing:
        raise JaxparError(f"catalog entry {name!r} lacks {missing}")
    values: dict[str, Any] = {}
    for key, value in entry.items():
        kind = {"int": int, "str": str}.get(str(types[key]), float)
        try:
            values[key] = kind(value)
        except (TypeError, ValueError):
            raise JaxparError(f"catalog entry {name!r}: {key}={value!r} is not a number"
                              ) from None
    for key, value in values.items():
        problem = _field_problem(key, value)
        if problem:
            raise JaxparError(f"catalog entry {name!r}{f' in {where}' if where else ''}: "
                              f"{key}={value!r} {problem}")
    values.setdefault("source", where)
    return Chip(name=str(name), **values)


_POSITIVE = ("peak_flops", "hbm_bytes", "ici_bw", "dcn_bw", "domain", "hbm_bw", "host_bw",
             "matmul_tile", "matmul_efficiency", "memory_efficiency",
             "collective_efficiency")
"""Chip figures that must be above zero (a rate, a size, a share of a peak)."""


def _field_problem(key: str, value: Any) -> str:
    """Why a catalog figure is impossible (empty when it is fine): every number finite,
    rates, sizes and efficiencies positive, the rest not negative, ``overlap`` and
    ``contention`` shares,
    ``torus_dims`` 0 (switched), 2 or 3."""
    if isinstance(value, str):
        return ""
    if not math.isfinite(value):
        return "must be a finite number"
    if key == "torus_dims" and value not in (0, 2, 3):
        return "must be 0 (a switched fabric), 2 or 3"
    if key in ("overlap", "contention") and not 0 <= value <= 1:
        return "must be between 0 and 1"
    if key in _POSITIVE and value <= 0:
        return "must be positive"
    if value < 0:
        return "must not be negative"
    return ""


def load_catalog(path: str | Path | None) -> dict[str, Chip]:
    """The built-in chips plus those in a YAML file.

    The file maps names to fields of :class:`Chip` (``peak_flops``, ``hbm_bytes``,
    ``ici_bw``, ``dcn_bw`` and ``domain`` required, the rest optional); an entry may also
    ``base: <known kind>`` and override only some fields. ``jaxpar calibrate`` writes such
    a file.
    """
    chips = dict(BUILTIN)
    if path is None:
        return chips
    p = Path(path)
    if p.is_dir():
        raise JaxparError(f"catalog file {str(p)!r} is a folder; give a YAML file")
    if not p.is_file():
        raise JaxparError(f"catalog file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise JaxparError(f"catalog file {str(p)!r} is not YAML: {err}") from None
    if not isinstance(data, Mapping):
        raise JaxparError(f"catalog file {str(p)!r} must map chip names to their figures")
    for name, entry in data.items():
        if not isinstance(entry, Mapping):
            raise JaxparError(f"catalog entry {name!r} must be a mapping of figures")
        entry = dict(entry)
        base: dict[str, Any] = {}
        if "base" in entry:
            parent = resolve_kind(str(entry.pop("base")), chips)
            if parent not in chips:  # "cpu": its figures depend on the device count
                raise JaxparError(
                    f"catalog entry {name!r} in {p}: base {parent!r} has no fixed figures "
                    "(they depend on the device count); write them out, as jaxpar "
                    "calibrate does")
            base = {k: v for k, v in dataclasses.asdict(chips[parent]).items() if k != "name"}
        chips[str(name)] = chip_from_mapping(str(name), {**base, **entry}, where=str(p))
    return chips


def resolve_kind(kind: str, chips: Mapping[str, Chip] | None = None) -> str:
    """Canonical catalog key for ``kind`` (case-insensitive, aliases allowed)."""
    chips = BUILTIN if chips is None else chips
    key = kind.strip().lower()
    key = ALIASES.get(key, key)
    if key in chips or key == "cpu":
        return key
    known = sorted({*chips, "cpu"})
    raise JaxparError(f"unknown chip kind {kind!r}; known kinds: {', '.join(known)}")


@dataclasses.dataclass(frozen=True)
class Machine:
    """``count`` chips of one kind in ``slices`` ICI domains joined by the DCN."""

    chip: Chip
    count: int
    slices: int = 1

    @property
    def per_slice(self) -> int:
        """Chips in one slice."""
        return self.count // self.slices

    def describe(self) -> str:
        """E.g. ``256 x tpu-v5p (1 slice)``."""
        s = "slice" if self.slices == 1 else "slices"
        return f"{self.count} x {self.chip.name} ({self.slices} {s})"


def parse_chips(text: str, *, slices: int = 1, catalog: str | Path | Mapping[str, Chip]
                | None = None) -> Machine:
    """``"tpu-v5p:256"`` -> a :class:`Machine`.

    Raises:
      JaxparError: for a malformed spec, an unknown kind (the message lists the known
        ones), a count that does not split into ``slices``, or a slice larger than the
        chip's ICI domain.
    """
    chips = catalog if isinstance(catalog, Mapping) else load_catalog(catalog)
    kind, sep, count_text = text.partition(":")
    if not sep or not count_text.strip().isdigit() or int(count_text) < 1:
        raise JaxparError(f"--chips {text!r} must look like kind:count, e.g. tpu-v5p:256")
    count = int(count_text)
    key = resolve_kind(kind, chips)
    chip = cpu_chip(count) if key == "cpu" and key not in chips else chips[key]
    if slices == 1 and count > chip.domain:
        # More chips than one ICI domain holds (GPU nodes, TPU pods): one slice per domain.
        slices = -(-count // chip.domain)
    if slices < 1 or count % slices:
        raise JaxparError(f"{count} {chip.name} chips do not split into {slices} slices "
                          f"(at most {chip.domain} chips share one ICI domain)")
    if count // slices > chip.domain:
        raise JaxparError(
            f"{count // slices} chips per slice exceed one {chip.name} ICI domain of "
            f"{chip.domain}; pass --slices {-(-count // chip.domain)} or more")
    return Machine(chip, count, slices)
