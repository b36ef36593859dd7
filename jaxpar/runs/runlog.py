"""What a run writes about itself: ``metrics.jsonl``, and TensorBoard events or a Weights &
Biases run (``train.trackers``) in the run folder.

Each logged step becomes one JSON row in ``OUT/metrics.jsonl`` and the same figures as
TensorBoard scalars under ``OUT/tensorboard/`` (see :mod:`jaxpar.runs.monitor` for the tags):
loss, eval loss, learning rate, gradient norm, tokens/s, step time, MFU (from the model's
FLOPs and the chip's peak, when both are known) and device memory in use (when the
devices report it). Everything is computed on the host from figures the step already
returned, so logging adds no device synchronisation. Rows that end a window of steps also
carry the run's goodput so far (:data:`jaxpar.runs.goodput.ROW_KEYS`), tagged
``goodput/fraction``, ``goodput/productive_s`` and ``badput/<part>_s``.

On resume, rows of steps after the checkpoint (steps that will be trained again) are
dropped first, so every step appears once.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar.config.schema import Config
from jaxpar.errors import JaxparError
from jaxpar.planner.catalog import Machine
from jaxpar.planner.prediction import predict
from jaxpar.runs import goodput, monitor
from jaxpar.runs.trackers import WandbTracker
from jaxpar.sharding.mesh import MESH_AXES, mesh_sizes
from jaxpar.storage.folders import free_bytes, human_bytes, write_fault
from jaxpar.training.optimizer import learning_rate


def trim_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after ``last_step`` (steps that will be trained again on resume)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if line.strip() and json.loads(line).get("step", 0) <= last_step:
                keep.append(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


class RunLog:
    """Adds host-side figures to each step's metrics and writes the logged ones.

    Args:
      config: the run config (learning-rate schedule, model FLOPs, ``train.log_every``).
      out: the run folder, or None to write nothing (metrics are still enriched).
      resumed_at: the step a resumed run continues from (rows after it are dropped), or
        None for a fresh run (``metrics.jsonl`` is started anew).
      writer: whether this process writes (process 0 of a multi-process run).
    """

    def __init__(self, config: Config, out: Path | None, *, resumed_at: int | None = None,
                 writer: bool = True):
        self.config = config
        # The learning rate of every step, computed once on the host CPU (the step just
        # taken used the rate of the step count before it).
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            self._lr = np.asarray(learning_rate(config.train)(np.arange(config.train.steps)))
        self._flops, self.flops_source = monitor.step_model_flops(config)
        self._chip = monitor.run_chip(config.train.catalog)
        precision = config.plan.precision if isinstance(config.plan.precision, str) else ""
        self._peak = config.train.peak_flops or (  # the peak of the dtype that runs
            monitor.compute_peak(self._chip, precision) if self._chip else None)
        self._devices = jax.device_count()
        self._fd: int | None = None
        self._tensorboard: monitor.TensorBoardLog | None = None
        self._wandb: WandbTracker | None = None
        self._out = out
        if out is not None and writer:
            path = out / "metrics.jsonl"
            if resumed_at is not None:
                trim_metrics(path, resumed_at)
            # One os.write per row on an O_APPEND descriptor: a row lands whole or not at
            # all (a kill never leaves half a line for the next row to run into).
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            self._fd = os.open(path, flags | (0 if resumed_at is not None else os.O_TRUNC),
                               0o644)
            trackers = config.train.trackers
            if "tensorboard" in trackers:
                self._tensorboard = monitor.TensorBoardLog(out / "tensorboard")
            if "wandb" in trackers:
                self._wandb = WandbTracker(out, self._wandb_config(), {
                    "model_flops_per_step": self._flops or 0.0,
                    "model_flops_source": self.flops_source,
                    "peak_flops_per_device": self._peak or 0.0, **self._prediction()},
                    resumed_at is not None)

    def _prediction(self) -> dict[str, float]:
        """The planner's figures for this run on these devices (``predicted/*``: step time,
        MFU, memory per device), from the chip the catalog or ``train.catalog`` gives.
        For a ``model.factory`` model the planner predicts memory (from its traced step)
        but no step time: ``predicted/step_time_s`` and ``predicted/mfu`` are left out and
        ``predicted/not_predicted`` says why."""
        platform = jax.devices()[0].platform
        if self._chip is None and platform != "cpu":
            return {}
        try:
            figures = predict(self.config, self._devices, backend=platform, machine=(
                Machine(self._chip, self._devices, 1) if self._chip else None))
        except (JaxparError, ValueError):  # a layout the cost model does not describe
            return {}
        memory = {"predicted/memory_bytes_per_device": figures["memory"]["total_bytes"]}
        if figures.get("step_time_s") is None:
            return {**memory, "predicted/not_predicted": figures["not_predicted"]}
        return {"predicted/step_time_s": figures["step_time_s"],
                "predicted/mfu": figures["mfu"], **memory}

    def _wandb_config(self) -> dict[str, Any]:
        """The run config, with what the run resolved: devices, processes, the mesh."""
        m = self.config.mesh
        ici, dcn = mesh_sizes(m.ici(), m.dcn(), self._devices)
        return {**self.config.to_dict(), "resolved": {
            "devices": self._devices, "processes": jax.process_count(),
            "platform": jax.devices()[0].platform,
            "mesh": {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn, strict=True)}}}

    def enrich(self, metrics: dict[str, Any], step_time_s: float) -> dict[str, Any]:
        """Add step time, tokens/s, learning rate, MFU and memory to a step's metrics."""
        train = self.config.train
        rate = train.global_batch * train.seq_len / step_time_s
        metrics.update(step_time_s=step_time_s, tokens_per_s=rate,
                       tokens_per_s_per_device=rate / self._devices)
        metrics["lr"] = float(self._lr[metrics["step"] - 1])
        if self._flops is not None:
            mfu = monitor.mfu(self._flops, step_time_s, self._devices, self._peak)
            if mfu is not None:
                metrics["mfu"] = mfu
        memory = monitor.memory_in_use()
        if memory is not None:
            metrics["memory_bytes"] = memory
        return metrics

    def due(self, step: int, *, last: bool, metrics: dict[str, Any] | None = None) -> bool:
        """Whether the metrics of ``step`` (1-based: steps done) are written: the first
        and every ``train.log_every``-th after it, the last, and any evaluated one."""
        return ((step - 1) % self.config.train.log_every == 0 or last
                or "eval_loss" in (metrics or {}))

    def write(self, metrics: dict[str, Any]) -> None:
        """Append one row to ``metrics.jsonl`` and its scalars to TensorBoard."""
        if self._fd is not None:
            row = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                   for k, v in metrics.items()}
            try:
                os.write(self._fd, (json.dumps(row) + "\n").encode())
            except OSError as err:
                path = self._out / "metrics.jsonl"
                raise JaxparError(f"writing {path} failed: {write_fault(err) or err} "
                                  f"({human_bytes(free_bytes(path))} free there)") from None
        tags = monitor.tensorboard_tags({k: v for k, v in metrics.items()
                                         if k not in goodput.TAGS})
        tags.update({tag: float(metrics[k]) for k, tag in goodput.TAGS.items() if k in metrics})
        if self._tensorboard is not None:
            self._tensorboard.scalars(metrics["step"], tags)
        if self._wandb is not None:
            self._wandb.scalars(metrics["step"], tags)

    def close(self) -> None:
        """Flush and close the files."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
