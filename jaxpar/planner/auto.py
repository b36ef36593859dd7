"""``auto`` plan knobs resolved to what the planner picks for a run config.

A knob in :data:`jaxpar.sharding.plan.AUTO_KNOBS` defaults to ``auto`` in a run config.
:func:`resolve_auto` prices its values with the cost model for the config's model, mesh
and batch on this machine's devices and returns the config with the planner's choice,
and one line per knob saying what ``auto`` became and why. A user's explicit value is
kept. The rule is the search's own (:func:`jaxpar.planner.search.search`): the
vocabulary goes over ``fsdp`` too when that is faster and fits (or nothing fits).

:func:`assemble` and :func:`build_trainer` (``jaxpar.assemble``, ``jaxpar.build_trainer``)
resolve them before assembling, so a run built in Python gets what ``jaxpar train``,
``jaxpar compile`` and ``jaxpar inspect`` get from the same config; the lines are logged
(logger ``jaxpar``) and kept on the :class:`~jaxpar.config.assembly.Assembly`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax

from jaxpar.config import assembly
from jaxpar.config.schema import Config
from jaxpar.errors import JaxparError
from jaxpar.planner.catalog import Machine, cpu_chip, parse_chips
from jaxpar.planner.cost import Estimate, estimate
from jaxpar.planner.prediction import candidate_from_config, spec_from_config


def machine_here(n_devices: int) -> Machine:
    """This process's devices as the planner's :class:`Machine`: the catalog's chip of
    the devices' kind, the host CPU split into ``n_devices`` when it is not known."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        for word in (device.device_kind, device.device_kind.split()[-1]):
            try:
                return parse_chips(f"{word.lower()}:{n_devices}")
            except JaxparError:
                continue
    return Machine(cpu_chip(n_devices), n_devices, 1)


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _pick(plain: Estimate, split: Estimate) -> bool:
    """Whether the search keeps the vocabulary-over-fsdp twin over the plain candidate."""
    return split.step_time_s < plain.step_time_s and (split.fits or not plain.fits)


def choose_vocab_over_fsdp(config: Config, n_devices: int,
                           machine: Machine | None = None) -> tuple[bool, str]:
    """The planner's ``plan.vocab_over_fsdp`` for ``config`` on ``n_devices`` devices
    (``machine``: default :func:`machine_here`), with why (one line)."""
    machine = machine or machine_here(n_devices)
    off = dataclasses.replace(config, plan=dataclasses.replace(config.plan,
                                                               vocab_over_fsdp=False))
    cand = candidate_from_config(off, n_devices)
    if cand.sizes["fsdp"] <= 1:
        return False, "no fsdp axis to split the vocabulary over"
    spec = spec_from_config(off, cand.sizes["stage"])
    batch, seq = config.train.global_batch, config.train.seq_len
    plain = estimate(spec, machine, cand, batch, seq)
    split = estimate(spec, machine, dataclasses.replace(cand, vocab_over_fsdp=True),
                     batch, seq)
    choice = _pick(plain, split)
    ms = f"{_seconds(split.step_time_s)} vs {_seconds(plain.step_time_s)} a step"
    gib = (f"{split.memory_per_device_bytes / 2**30:.3g} vs "
           f"{plain.memory_per_device_bytes / 2**30:.3g} GiB a device")
    why = ("split" if choice else "not split") + f" over fsdp={cand.sizes['fsdp']}: {ms}, {gib}"
    if not choice and split.step_time_s < plain.step_time_s:
        why += " (the split does not fit)"
    return choice, f"the planner on {machine.chip.name}: {why}"


def resolve_auto(config: Config, n_devices: int,
                 machine: Machine | None = None) -> tuple[Config, list[str]]:
    """``config`` with each ``auto`` plan knob resolved to the planner's choice, and one
    line per knob resolved (``plan.KNOB=auto -> VALUE (why)``); explicit values kept."""
    if config.plan.vocab_over_fsdp != "auto":
        return config, []
    try:
        value, why = choose_vocab_over_fsdp(config, n_devices, machine)
    except (JaxparError, ValueError) as err:  # a model or layout the cost model cannot price
        value, why = False, f"the planner cannot price this run ({err}): the default"
    plan = dataclasses.replace(config.plan, vocab_over_fsdp=value)
    return (dataclasses.replace(config, plan=plan),
            [f"plan.vocab_over_fsdp=auto -> {str(value).lower()} ({why})"])


def assemble(config: Config, devices: Any = None, *, abstract: bool = False,
             machine: Machine | None = None) -> assembly.Assembly:
    """:func:`jaxpar.config.assembly.assemble` after :func:`resolve_auto` (on ``machine``,
    default the devices' own): the run ``jaxpar train`` builds from ``config``. What each
    ``auto`` knob became is logged and kept in ``Assembly.auto``."""
    n_devices = len(devices) if devices is not None else jax.device_count()
    config, said = resolve_auto(config, n_devices, machine)
    for line in said:
        logging.getLogger("jaxpar").info(line)
    run = assembly.assemble(config, devices, abstract=abstract)
    run.auto = said
    return run


def build_trainer(config: Config, devices: Any = None) -> Any:
    """The :class:`~jaxpar.Trainer` of :func:`assemble` (a :class:`~jaxpar.DiLoCo` when
    ``diloco.sync_every`` is set): ``auto`` knobs resolved as ``jaxpar train`` does."""
    return assemble(config, devices).trainer
