"""A run's two checkpoint tiers together: what ``jaxpar train`` saves where, restores from,
and saves when preempted.

* The persistent tier, :class:`~jaxpar.checkpoint.checkpointer.Checkpointer` under
  ``RUN/checkpoints`` (every ``checkpoint.every`` steps and at the end).
* The fast tier, :class:`~jaxpar.checkpoint.local_tier.LocalTier` under
  ``checkpoint.local_dir`` on each host's own disk (every ``checkpoint.local_every``
  steps, and on SIGTERM), when that key is set.

``--resume`` restores the newest step of either (the local tier's on a tie: it is faster
to read), saying which. On SIGTERM (``checkpoint.on_preempt``) the run saves the step it
stopped at to the local tier first, then to the persistent tier too when its last save
took less than what is left of ``checkpoint.preempt_grace_s`` (counted from the signal;
without a local tier, or before any persistent save was timed, it always tries).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxpar.checkpoint.checkpointer import Checkpointer
from jaxpar.checkpoint.local_tier import LocalTier
from jaxpar.config.schema import Config
from jaxpar.runs.interrupts import StopOnSignal


def local_tier(config: Config, ckpt: Checkpointer | None, resume: bool) -> LocalTier | None:
    """The run's local tier (None without ``checkpoint.local_dir`` or without ``--out``).
    A fresh start (no ``resume``) removes this run's steps found there: they are stale."""
    c = config.checkpoint
    if ckpt is None or not c.local_dir:
        return None
    local = LocalTier(c.local_dir, run=str(ckpt.directory), every=c.local_every,
                      keep=c.local_keep)
    if not resume:
        local.clear()
    return local


def save_local(local: LocalTier, ckpt: Checkpointer, trainer: Any, config: Config) -> float:
    """Start a local save of the current step; returns the seconds the step was blocked."""
    return local.save(trainer, ckpt.meta_of(trainer, config), config.to_dict())


def _gather_max(values: list[float]) -> np.ndarray:
    """Each of ``values``, the largest over the processes (collective)."""
    row = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return row
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(row)).max(axis=0)


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``--resume`` loaded: its step, the checkpoint's meta and config, and where from
    (a folder, for messages)."""

    step: int
    meta: dict[str, Any]
    config: dict[str, Any]
    where: str


def restore_newest(trainer: Any, ckpt: Checkpointer, local: LocalTier | None,
                   say: Callable[[str], None]) -> Restored | None:
    """Load the newest step of either tier into ``trainer`` (None: neither has one).
    Collective."""
    saved = ckpt.steps()
    if local is not None:
        step, why = local.agree(trainer)
        if why is not None:
            say(f"{why}: not restoring it")
        if step is not None and (not saved or step >= saved[-1]):
            index = local.restore(trainer, step)
            if index is not None:
                return Restored(step, index["meta"], index["config"],
                                f"local tier step {step} ({local.path(step)})")
            say(f"local tier step {step} is unreadable on some process: restoring from "
                f"{ckpt.directory}")
    if not saved:
        return None
    meta = ckpt.restore(trainer)
    step = int(meta["step"])
    return Restored(step, meta, ckpt.config(step), str(ckpt.path(step)))


def fits(last_save_s: float | None, elapsed_s: float, grace_s: float) -> bool:
    """Whether a persistent save that takes ``last_save_s`` (None or NaN: not timed yet)
    ends within ``grace_s`` of the signal, ``elapsed_s`` after it."""
    return last_save_s is None or math.isnan(last_save_s) or elapsed_s + last_save_s <= grace_s


def preempt(stop: StopOnSignal, trainer: Any, ckpt: Checkpointer, local: LocalTier | None,
            config: Config, say: Callable[[str], None]) -> str | None:
    """Save the step a preempted run stopped at: to the local tier, then to the persistent
    tier when it fits in the grace period (see the module's docstring). Returns the tier
    that holds it ("local tier", or the persistent folder), None when neither could.
    Collective: every process decides alike."""
    step, grace = trainer.step_count, config.checkpoint.preempt_grace_s
    local_ok = 1.0
    if local is not None:
        local.wait()  # a periodic save of this step may be in flight
        if step in local.steps():
            say(f"{stop.name}: local tier step {step} already holds the current step")
        else:
            blocked = save_local(local, ckpt, trainer, config)
            local.wait()
            write = local.last_write_s or 0.0
            say(f"{stop.name}: saved step {step} to the local tier in {blocked + write:.2f} s "
                f"({local.path(step)})")
        local_ok = float(step in local.steps())
    last = ckpt.last_save_s if ckpt.last_save_s is not None else math.nan
    worst_missing, elapsed, last = _gather_max([1.0 - local_ok, stop.elapsed(), last])
    local_ok = local is not None and worst_missing == 0.0
    if not local_ok or fits(last, elapsed, grace):
        if ckpt.save(trainer, config=config, force=True) is not None:
            say(f"{stop.name}: saving checkpoint {step} (checkpoint.on_preempt)")
        else:
            say(f"{stop.name}: checkpoint {step} already holds the current step")
        ckpt.wait()
        return str(ckpt.path(step))
    say(f"{stop.name}: not saving step {step} to {ckpt.directory} too: its last save took "
        f"{last:.1f} s, {max(grace - elapsed, 0):.1f} s of checkpoint.preempt_grace_s="
        f"{grace:g} are left")
    return "local tier"
