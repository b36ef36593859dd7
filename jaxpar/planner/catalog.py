"""Device catalog: what one chip of each kind can compute, hold and send.

Every figure is per chip. Bandwidths are one-directional bytes per second that one chip
can push into a collective: ``ici_bw`` over the fast in-slice fabric (TPU ICI, NVLink),
``dcn_bw`` over the data-centre network between slices (or InfiniBand between GPU
nodes). ``domain`` is how many chips one ICI domain holds (a TPU slice or pod, an NVLink
node); axes that span more chips than that must cross the DCN.

Sources (each entry below repeats its own):

* TPU v4: cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2, 4096-chip pod);
  ICI: six links of 50 GB/s per chip (Jouppi et al., "TPU v4", ISCA 2023).
* TPU v5e: cloud.google.com/tpu/docs/v5e and the v5e column of .../tpu/docs/v6e
  (197 TFLOP/s, 16 GB, ICI 1600 Gbps, 256-chip pod, DCN 6.4 Tbps per pod).
* TPU v5p: cloud.google.com/tpu/docs/v5p (459 TFLOP/s, 95 GiB, ICI 4800 Gbps,
  DCN 50 Gbps per chip, 8960-chip pod, largest slice 6144 chips).
* TPU v6e: cloud.google.com/tpu/docs/v6e (918 TFLOP/s, 32 GB, ICI 3584 Gbps, 256-chip
  pod, DCN 25.6 Tbps per pod).
* A100-80GB: NVIDIA A100 datasheet (312 TFLOP/s dense bf16, 80 GB, NVLink 600 GB/s);
  DGX A100: 8 GPUs per NVLink domain, one 200 Gb/s HDR InfiniBand port per GPU.
* H100: NVIDIA H100 datasheet, SXM (989 TFLOP/s dense bf16, 80 GB, NVLink 900 GB/s);
  DGX H100: 8 GPUs, one 400 Gb/s NDR InfiniBand port per GPU.
* H200: NVIDIA H200 datasheet, SXM (989 TFLOP/s dense bf16, 141 GB, NVLink 900 GB/s);
  HGX H200: 8 GPUs, 400 Gb/s per GPU.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from jaxpar.errors import JaxparError

GB = 1e9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator kind.

    Attributes:
      name: catalog key, e.g. ``tpu-v5p``.
      peak_flops: dense bf16 FLOP/s of one chip.
      hbm_bytes: device memory of one chip.
      ici_bw: bytes/s one chip sends into collectives inside an ICI domain.
      dcn_bw: bytes/s one chip sends across domains (slices, nodes).
      domain: chips per ICI domain (slice / NVLink node).
      efficiency: fraction of peak a well-tuned dense transformer step sustains on
        matmuls; the cost model divides FLOPs by ``peak_flops * efficiency``.
      source: where the figures come from.
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    ici_bw: float
    dcn_bw: float
    domain: int
    efficiency: float = 0.6
    source: str = ""


_GBPS = GB / 8  # one gigabit per second, in bytes per second

BUILTIN: dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2, pod of 4096 chips.
    # ICI: 6 links x 50 GB/s (Jouppi et al., ISCA 2023); DCN per chip is not published,
    # 25 Gbps assumed (the v5e per-chip share of its 6.4 Tbps pod DCN).
    "tpu-v4": Chip("tpu-v4", 275e12, 32 * GiB, 300 * GB, 25 * _GBPS, 4096,
                   source="cloud.google.com/tpu/docs/v4; ISCA 2023 TPU v4 paper"),
    # cloud.google.com/tpu/docs/v5e (and v6e page's comparison table): 197 TFLOP/s bf16,
    # 16 GB HBM, ICI 1600 Gbps, pod of 256, DCN 6.4 Tbps per pod = 25 Gbps per chip.
    "tpu-v5e": Chip("tpu-v5e", 197e12, 16 * GB, 1600 * _GBPS, 25 * _GBPS, 256,
                    source="cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e, ICI 4800 Gbps
    # (1200 GB/s bidirectional), DCN 50 Gbps per chip, slices up to 6144 chips.
    "tpu-v5p": Chip("tpu-v5p", 459e12, 95 * GiB, 4800 * _GBPS, 50 * _GBPS, 6144,
                    source="cloud.google.com/tpu/docs/v5p"),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM, ICI 3584 Gbps, pod of
    # 256, DCN 25.6 Tbps per pod = 100 Gbps per chip.
    "tpu-v6e": Chip("tpu-v6e", 918e12, 32 * GB, 3584 * _GBPS, 100 * _GBPS, 256,
                    source="cloud.google.com/tpu/docs/v6e"),
    # NVIDIA A100 datasheet: 312 TFLOP/s dense bf16, 80 GB HBM2e, NVLink 600 GB/s
    # (bidirectional; 300 GB/s each way); DGX A100: 8 GPUs per NVLink domain and one
    # 200 Gb/s HDR InfiniBand adapter per GPU.
    "a100-80gb": Chip("a100-80gb", 312e12, 80 * GB, 300 * GB, 200 * _GBPS, 8,
                      source="NVIDIA A100 datasheet; DGX A100 user guide"),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense bf16 (1979 with sparsity), 80 GB
    # HBM3, NVLink 900 GB/s (450 GB/s each way); DGX H100: 8 GPUs, 400 Gb/s NDR per GPU.
    "h100": Chip("h100", 989e12, 80 * GB, 450 * GB, 400 * _GBPS, 8,
                 source="NVIDIA H100 datasheet; DGX H100 user guide"),
    # NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense bf16, 141 GB HBM3e, NVLink 900 GB/s;
    # HGX H200: 8 GPUs, 400 Gb/s InfiniBand per GPU.
    "h200": Chip("h200", 989e12, 141 * GB, 450 * GB, 400 * _GBPS, 8,
                 source="NVIDIA H200 datasheet"),
}

ALIASES = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e",
           "a100": "a100-80gb", "h100-80gb": "h100", "trillium": "tpu-v6e"}


def cpu_chip(n_devices: int) -> Chip:
    """The host CPU split into ``n_devices`` simulated devices.

    Peak FLOP/s is a rough figure (cores x 2 GHz x 32 f32 FLOP/cycle for AVX2 FMA, shared
    by the simulated devices); memory is host RAM over the devices; "collectives" are
    memory copies, so the ICI bandwidth is a few GB/s.
    """
    cores = os.cpu_count() or 1
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GiB
    n = max(n_devices, 1)
    return Chip("cpu", cores * 2e9 * 32 / n, ram / n, 5 * GB, 5 * GB, 1 << 30,
                efficiency=0.3, source="host estimate")


def load_catalog(path: str | Path | None) -> dict[str, Chip]:
    """The built-in chips plus those in a YAML file.

    The file maps names to fields of :class:`Chip` (``peak_flops``, ``hbm_bytes``,
    ``ici_bw``, ``dcn_bw``, ``domain``, optional ``efficiency`` and ``source``); an
    entry may also ``base: <known kind>`` and override only some fields.
    """
    chips = dict(BUILTIN)
    if path is None:
        return chips
    p = Path(path)
    if not p.is_file():
        raise JaxparError(f"catalog file {str(p)!r} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, Mapping):
        raise JaxparError(f"catalog file {str(p)!r} must map chip names to their figures")
    fields = {f.name for f in dataclasses.fields(Chip)} - {"name"}
    for name, entry in data.items():
        if not isinstance(entry, Mapping):
            raise JaxparError(f"catalog entry {name!r} must be a mapping of figures")
        entry = dict(entry)
        base: dict[str, Any] = {}
        if "base" in entry:
            parent = resolve_kind(str(entry.pop("base")), chips)
            base = {k: v for k, v in dataclasses.asdict(chips[parent]).items() if k != "name"}
        unknown = set(entry) - fields
        if unknown:
            raise JaxparError(f"catalog entry {name!r} has unknown field {sorted(unknown)[0]!r}"
                              f"; fields are {sorted(fields)}")
        merged = {**base, **entry}
        missing = {"peak_flops", "hbm_bytes", "ici_bw", "dcn_bw", "domain"} - set(merged)
        if missing:
            raise JaxparError(f"catalog entry {name!r} lacks {sorted(missing)}")
        try:
            chips[str(name)] = Chip(
                name=str(name), peak_flops=float(merged["peak_flops"]),
                hbm_bytes=float(merged["hbm_bytes"]), ici_bw=float(merged["ici_bw"]),
                dcn_bw=float(merged["dcn_bw"]), domain=int(merged["domain"]),
                efficiency=float(merged.get("efficiency", 0.6)),
                source=str(merged.get("source", str(p))))
        except (TypeError, ValueError) as err:
            raise JaxparError(f"catalog entry {name!r}: {err}") from None
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
