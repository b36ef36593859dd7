"""Watching a training run: TensorBoard scalars, model FLOPs utilisation (MFU), device
memory, and a profiler trace of chosen steps.

All host work around :meth:`jaxpar.Trainer.step`: scalars are the Python floats the step
returned, memory statistics are read without waiting for the devices; only
:class:`ProfileWindow` synchronises, once, at the end of its window. The planner and
``tensorboard`` are imported lazily, so a run without TensorBoard installed loses only
its TensorBoard scalars.
"""

from __future__ import annotations

import math
import numbers
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from jaxpar.config.validate import check_profile_steps
from jaxpar.errors import JaxparError
from jaxpar.models.config import TransformerConfig
from jaxpar.planner.catalog import BUILTIN, Chip, load_catalog
from jaxpar.planner.cost import model_flops
from jaxpar.planner.model import from_transformer

TAGS: dict[str, str] = {
    "loss": "train/loss", "eval_loss": "eval/loss", "lr": "train/lr",
    "grad_norm": "train/grad_norm", "loss_scale": "train/loss_scale",
    "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
    "tokens_per_s_per_device": "perf/tokens_per_s_per_device",
    "checkpoint_block_s": "perf/checkpoint_block_s", "memory_bytes": "memory/bytes_in_use",
    "local_checkpoint_block_s": "perf/local_checkpoint_block_s",
}
"""Metric-row key -> TensorBoard tag; other keys become ``train/<key>``."""

_F32_MAX = 3.4028234663852886e38  # TensorBoard's simple_value is a float32


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (None, bools, non-numbers, NaN, +-inf)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    x = float(value)
    return x if math.isfinite(x) and abs(x) <= _F32_MAX else None


class TensorBoardLog:
    """Scalars into one TensorBoard event file under ``directory`` (created if missing),
    as float32 ``simple_value`` summaries (what ``EventAccumulator.Scalars`` reads). Use as
    a context manager or call :meth:`close`."""

    def __init__(self, directory: str | Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.directory), flush_secs=10)
        self._closed = False

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Write each finite number in ``values`` at ``step``, its key used as the tag.

        None, non-numeric values (strings, arrays), bools and NaN/inf are skipped.
        """
        from tensorboard.compat.proto import event_pb2, summary_pb2

        if self._closed:
            raise JaxparError(f"TensorBoard log {self.directory} is closed")
        entries = [summary_pb2.Summary.Value(tag=str(tag), simple_value=x)
                   for tag, value in values.items() if (x := _number(value)) is not None]
        if entries:
            self._writer.add_event(event_pb2.Event(
                wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=entries)))

    def flush(self) -> None:
        """Write pending events to disk."""
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (a second call does nothing)."""
        if not self._closed:
            self._writer.close()
            self._closed = True

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensorboard_tags(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a run-loop metric row, keyed by TensorBoard tag (see
    :data:`TAGS`; unknown keys go under ``train/``). ``step`` and non-finite or
    non-numeric values are dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        x = _number(value)
        if key != "step" and x is not None:
            out[TAGS.get(key, f"train/{key}")] = x
    return out


# --- MFU ----------------------------------------------------------------------------------
_KINDS: tuple[tuple[str, str], ...] = (
    # ``device_kind`` (lower case, fullmatch) -> catalog key. v5e/v6e report "lite"; every
    # A100 has the same peak; TPU v4i ("v4 lite"), H100 PCIe and the NVL cards are unknown.
    (r"tpu v4", "tpu-v4"),
    (r"tpu v5 ?(lite|e|litepod)", "tpu-v5e"),
    (r"tpu v5p?", "tpu-v5p"),
    (r"tpu v6 ?(lite|e)", "tpu-v6e"),
    (r"nvidia a100\b.*", "a100-80gb"),
    (r"nvidia h100( sxm\d?)?( \d+gb)?( hbm3e?)?", "h100"),
    (r"nvidia h200( sxm\d?)?( \d+gb)?( hbm3e?)?", "h200"),
)


def chip_for_kind(device_kind: str, chips: Mapping[str, Any] | None = None) -> str | None:
    """The catalog key (see :mod:`jaxpar.planner.catalog`) of a ``device.device_kind``,
    e.g. ``"TPU v5 lite"`` -> ``"tpu-v5e"``, ``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``;
    None when unknown. A ``chips`` entry named exactly like the kind wins."""
    chips = BUILTIN if chips is None else chips
    kind = " ".join(device_kind.lower().split())
    if kind in chips:
        return kind
    for pattern, key in _KINDS:
        if re.fullmatch(pattern, kind) and key in chips:
            return key
    return None


def catalog_chip(device: Any, chips: Mapping[str, Any] | None = None) -> Chip | None:
    """The entry of ``chips`` (default: the planner's built-in catalog) for an accelerator
    ``device``, found by its ``device_kind``; None on CPU and for kinds it does not hold."""
    chips = BUILTIN if chips is None else chips
    if getattr(device, "platform", "") == "cpu":
        return None
    key = chip_for_kind(str(getattr(device, "device_kind", "")), chips)
    return None if key is None else chips[key]


def peak_flops_per_device(device: Any = None, chips: Mapping[str, Any] | None = None
                          ) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` (default ``jax.devices()[0]``) from the planner's
    chip catalog (or ``chips``, e.g. :func:`jaxpar.planner.load_catalog`'s result); None on
    CPU and for kinds the catalog does not hold."""
    chip = catalog_chip(jax.devices()[0] if device is None else device, chips)
    return None if chip is None else float(chip.peak_flops)


def compute_peak(chip: Chip, precision: str = "") -> float:
    """The peak FLOP/s per device of ``chip`` in the dtype a run computes in: its
    float32 matmul rate (:attr:`Chip.matmul_flops_f32`) for float32 compute (the default
    policy, ``plan.precision`` empty), its 16-bit peak otherwise."""
    from jaxpar.sharding.precision import Policy

    compute = Policy.parse(precision).compute if precision else Policy().compute
    return float(chip.matmul_flops_f32 if jax.numpy.dtype(compute).itemsize >= 4
                 else chip.peak_flops)


def run_chip(catalog: str = "", devices: Sequence[Any] | None = None) -> Chip | None:
    """The catalog entry for a run's devices (default ``jax.devices()``): from the
    ``catalog`` file (``train.catalog``, what ``jaxpar calibrate --out`` writes) when given
    (CPU devices: its ``cpuN`` entry for N devices, or its only entry), else the built-in
    catalog (GPUs and TPUs it knows); None when neither has one. A file without an entry
    for these CPU devices is a :class:`JaxparError` naming it and its entries."""
    devices = jax.devices() if devices is None else devices
    device = devices[0]
    chips: Mapping[str, Chip] = BUILTIN
    if catalog:
        chips = load_catalog(catalog)
        own = {k: c for k, c in chips.items() if BUILTIN.get(k) != c}
        if device.platform == "cpu":
            name = f"cpu{len(devices)}"
            if name in own or len(own) == 1:
                return own.get(name) or next(iter(own.values()))
            raise JaxparError(f"train.catalog {catalog!r} has no entry {name!r} for these "
                              f"{len(devices)} CPU devices (it holds "
                              f"{', '.join(sorted(own)) or 'none'}): run jaxpar calibrate "
                              f"--devices {len(devices)} --out FILE")
    return catalog_chip(device, chips)


def mfu(model_flops_per_step: float, step_time_s: float, n_devices: int,
        peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``model_flops_per_step / (step_time_s * n_devices * peak)``;
    None when the peak is unknown or the time or device count is not positive."""
    if peak is None or peak <= 0 or step_time_s <= 0 or n_devices < 1:
        return None
    return model_flops_per_step / (step_time_s * n_devices * peak)


def model_flops_per_step(model_config: Any, global_batch: int, seq_len: int) -> float | None:
    """Training FLOPs of one step of jaxpar's built-in decoder, as the planner counts them
    (:func:`jaxpar.planner.cost.model_flops`): per token ``6 N + 12 L H Q s`` (PaLM,
    appendix B) with ``N`` the matmul parameters (decoder projections and the output head;
    not the embedding lookup nor norm scales), ``L`` layers, ``H`` query heads of size
    ``Q`` and sequence length ``s``; no remat recomputation. None for a user's model
    (``model.factory`` set) or anything but a :class:`TransformerConfig`."""
    if getattr(model_config, "factory", "") or not isinstance(model_config, TransformerConfig):
        return None
    return float(model_flops(from_transformer(model_config), global_batch, seq_len))


def step_model_flops(config: Any) -> tuple[float | None, str]:
    """``(model FLOPs of one training step, where the figure comes from)`` for a run
    config: the reference decoder's formula (:func:`model_flops_per_step`), or for a
    ``model.factory`` model the ``dot_general`` FLOPs of its traced step (the loss's
    forward and backward without remat, see :class:`jaxpar.planner.traced.StepTracer`);
    ``(None, why)`` when neither can be had."""
    train = config.train
    flops = model_flops_per_step(config.model, train.global_batch, train.seq_len)
    if flops is not None:
        return flops, "model FLOPs from the reference decoder's formula (6 N + 12 L H Q s a token)"
    if not getattr(config.model, "factory", ""):
        return None, "model FLOPs not known for this model"
    from jaxpar.planner.traced import StepTracer

    try:
        flops = StepTracer(config).model_flops(train.global_batch, train.seq_len)
    except JaxparError as err:
        return None, f"model FLOPs not known (no MFU): {err}"
    return flops, ("model FLOPs counted in the traced step of model.factory "
                   f"{config.model.factory!r} (the dot_general FLOPs of its loss's forward "
                   "and backward, no remat)")


def model_flops_per_token(model_config: Any, seq_len: int) -> float:
    """:func:`model_flops_per_step` for one token of a ``seq_len``-long sequence; raises
    :class:`JaxparError` for a model the formula does not cover (a user's factory)."""
    flops = model_flops_per_step(model_config, 1, seq_len)
    if flops is None:
        raise JaxparError("model FLOPs are known only for the built-in decoder, not for "
                          f"model.factory {getattr(model_config, 'factory', '')!r}")
    return flops / seq_len


# --- memory -------------------------------------------------------------------------------
def memory_in_use() -> int | None:
    """Bytes in use summed over this process's devices (``memory_stats()["bytes_in_use"]``,
    read without a device sync); None when no device reports it (the CPU backend)."""
    total, seen = 0, False
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except (RuntimeError, NotImplementedError):
            stats = None
        if stats and "bytes_in_use" in stats:
            total += int(stats["bytes_in_use"])
            seen = True
    return total if seen else None


# --- profiling ----------------------------------------------------------------------------
class ProfileWindow:
    """A ``jax.profiler`` trace of optimisation steps ``a..b`` (1-based, inclusive: step
    ``n`` is the one after which ``trainer.step_count == n``) into ``directory`` (TensorBoard's
    layout: ``plugins/profile/<time>/<host>.xplane.pb``).

    The run loop passes its 0-based index (``for step in range(start, end)``) to
    :meth:`before_step` and :meth:`after_step`. A run resumed inside the window traces from
    its first step there; :meth:`close` stops a trace the run left open.
    """

    def __init__(self, steps: Sequence[int] | None, directory: str | Path) -> None:
        check_profile_steps(steps)
        self.window = (int(steps[0]), int(steps[1])) if steps else None
        self.directory = Path(directory)
        self.active = False
        self.done = False

    def before_step(self, step_index: int) -> None:
        """Start the trace if the step about to run (``step_index + 1``) is in the window."""
        if self.window is None or self.active or self.done:
            return
        if self.window[0] <= step_index + 1 <= self.window[1]:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after_step(self, step_index: int, result: Any) -> None:
        """After the window's last step: wait for ``result`` and stop the trace."""
        if self.active and self.window is not None and step_index + 1 >= self.window[1]:
            jax.block_until_ready(result)
            self.close()

    def close(self) -> None:
        """Stop the trace if one is running (a second call does nothing)."""
        if self.active:
            self.active = False
            self.done = True
            jax.profiler.stop_trace()
