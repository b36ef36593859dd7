"""The training run behind ``jaxpar train``: config in, a trained model and a run folder out.

The run folder holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` and
``tensorboard/`` (one row per logged step: step, loss, grad_norm, lr, step_time_s,
tokens_per_s, data_wait_s (how long the step waited for its batch), eval_loss on steps that
evaluated the held-out data (``train.eval_every``),
checkpoint_block_s on steps that started a save, local_checkpoint_block_s on steps that
saved to the local tier, mfu and memory_bytes where known; see
:mod:`jaxpar.runs.runlog`), ``checkpoints/`` (see :mod:`jaxpar.checkpoint`) and, with
``train.profile_steps``, ``profile/`` (a ``jax.profiler`` trace).

A run stops early, and cleanly, in two cases. A non-finite loss or gradient norm (without
fp16 loss scaling, which skips such steps itself) stops it before that step is saved: the
newest checkpoint holds finite weights. Ctrl-C or SIGTERM stops it after the step in
flight (see :mod:`jaxpar.runs.interrupts`): the checkpoint being written is finished, and on
SIGTERM (preemption) the current step is saved too when ``checkpoint.on_preempt``, to the
fastest tier that fits ``checkpoint.preempt_grace_s`` (see :mod:`jaxpar.runs.tiers`), and
the run exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxpar.analysis.executables import load_compiled, with_compiled_auto
from jaxpar.checkpoint.checkpointer import Checkpointer
from jaxpar.checkpoint.local_tier import LocalTier
from jaxpar.config.assembly import build_trainer
from jaxpar.config.schema import Config
from jaxpar.data.loader import TokenLoader
from jaxpar.data.streams import DocumentLoader
from jaxpar.errors import JaxparError, RunStopped
from jaxpar.planner.auto import resolve_auto
from jaxpar.runs import compile_cache, goodput, monitor, tiers, trackers
from jaxpar.runs.inputs import load_corpus, make_loader, reads_shards
from jaxpar.runs.interrupts import StopOnSignal
from jaxpar.runs.monitor import ProfileWindow
from jaxpar.runs.replicas import LauncherGone, ReplicaClient
from jaxpar.runs.run_folder import check_run_folder, mark_finished
from jaxpar.runs.runlog import RunLog
from jaxpar.storage.folders import LOCK_NAME, FolderLock
from jaxpar.storage.remote import is_remote
from jaxpar.storage.run_mirror import BucketLock, RunMirror
from jaxpar.training.prefetch import Prefetcher
from jaxpar.training.trainer import Trainer


class NonFiniteLoss(JaxparError):
    """The loss or gradient norm became NaN or infinite; the run stopped before saving it."""


def evaluate(trainer: Trainer, holdout: TokenLoader, batches: int) -> float:
    """Mean loss over the first ``batches`` held-out batches (the same ones every time)."""
    return sum(trainer.eval_loss(holdout.batch(i)) for i in range(batches)) / batches


def _changed_keys(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """Config keys that differ, ignoring layout-only sections a resume may change."""
    out = []
    for key in sorted(set(saved) | set(now)):
        if (not prefix and key in _LAYOUT_SECTIONS) or f"{prefix}{key}" in _FREE_KEYS:
            continue
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_keys(a, b, f"{prefix}{key}.")
        elif a != b and not (isinstance(a, list) and tuple(a) == b):
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


_LAYOUT_SECTIONS = ("mesh", "plan", "pipeline", "checkpoint")
_FREE_KEYS = ("train.compile_cache",)
"""Keys a resume may change outside the layout sections: they change no result."""


def _say(text: str) -> None:
    if jax.process_index() == 0:
        tqdm.write(f"jaxpar: {text}")


class _Window:
    """The metrics of the steps dispatched since the last fetch, still on the devices.

    The loop fetches them only when it has to look (a logged step, a checkpoint, an
    evaluation, a stop): one wait for the whole window rather than one per step. Each
    step's time is the window's wall time over its steps, so tokens/s is measured over the
    interval the devices actually worked, compilation included in the first window.
    """

    LIMIT = 1000
    """Steps kept unfetched at most (bounds host memory of a run with a huge log_every)."""

    def __init__(self, log: RunLog, guard: bool, ckpt: Checkpointer | None):
        self.log, self.guard, self.ckpt = log, guard, ckpt
        self.pending: list[Any] = []
        self.since = time.perf_counter()

    def add(self, metrics: dict[str, jax.Array]) -> None:
        self.pending.append(metrics)

    @property
    def full(self) -> bool:
        return len(self.pending) >= self.LIMIT

    def fetch(self, last_step: int) -> list[dict[str, Any]]:
        """The window's rows (steps ``last_step - len + 1 .. last_step``), host numbers.

        Raises:
          NonFiniteLoss: at the first step whose loss or gradient norm is not finite
            (without fp16 loss scaling), before anything after it is saved.
        """
        values = jax.device_get(self.pending)
        now = time.perf_counter()
        each = (now - self.since) / len(values)
        self.pending, self.since = [], now
        rows = []
        for offset, got in enumerate(values):
            row = {k: float(v) for k, v in got.items()}
            row["step"] = last_step - len(values) + 1 + offset
            row = self.log.enrich(row, each)
            if self.guard and not (math.isfinite(row["loss"])
                                   and math.isfinite(row.get("grad_norm", 0.0))):
                raise _non_finite(row, self.ckpt)
            rows.append(row)
        return rows


def _non_finite(metrics: dict[str, Any], ckpt: Checkpointer | None) -> NonFiniteLoss:
    step, loss = metrics["step"], metrics["loss"]
    what = (f"the loss is {loss}" if not math.isfinite(loss)
            else f"the gradient norm is {metrics.get('grad_norm')}")
    message = f"{what} at step {step}; stopped without saving that step"
    if ckpt is None:
        return NonFiniteLoss(message + " (run with --out to keep checkpoints)")
    ckpt.wait()
    steps = ckpt.steps()
    if not steps:
        return NonFiniteLoss(message + f"; no checkpoint was saved before it in "
                             f"{ckpt.directory}")
    return NonFiniteLoss(
        message + f"; the last good checkpoint is step {steps[-1]} ({ckpt.path(steps[-1])}): "
        "continue from it with --resume after changing what diverged (a lower train.lr, "
        "more train.warmup_steps, train.grad_clip)")


def _stopped(stop: StopOnSignal, trainer: Trainer, ckpt: Checkpointer | None,
             config: Config, local: LocalTier | None = None) -> RunStopped:
    """Finish (and, on SIGTERM with checkpoint.on_preempt, make: see
    :func:`jaxpar.runs.tiers.preempt`) the checkpoint; say so. A preempted run that saved
    the step it stopped at exits 0, as a scheduler expects of a job it asked to stop."""
    step = trainer.step_count
    if ckpt is None:
        return RunStopped(f"{stop.name}: stopped after step {step} (no --out: nothing saved)",
                          stop.status)
    held = None
    if stop.signal == signal.SIGTERM and config.checkpoint.on_preempt:
        held = tiers.preempt(stop, trainer, ckpt, local, config, _say)
    pending = ckpt.in_flight()
    if pending is not None:
        _say(f"{stop.name}: stopped after step {step}; finishing checkpoint {pending} "
             "before exiting")
    ckpt.wait(pending)
    steps = ckpt.steps()
    if held == "local tier":
        steps = [step]
    saved = (f"the newest checkpoint is step {steps[-1]}"
             f"{' (local tier)' if held == 'local tier' else ''}; continue with --resume"
             if steps else "no checkpoint was saved yet")
    return RunStopped(f"{stop.name}: stopped after step {step}; {saved}",
                      0 if held is not None else stop.status)


def _launcher_gone(gone: LauncherGone, trainer: Trainer, ckpt: Checkpointer | None,
                   config: Config) -> LauncherGone:
    """A replica whose launcher died: save the current step, then stop in one line."""
    step = trainer.step_count
    if ckpt is None:
        return LauncherGone(f"{gone}; nothing saved (no --out)", gone.status)
    ckpt.save(trainer, config=config, force=True)
    ckpt.wait()
    return LauncherGone(f"{gone} after saving checkpoint {step} in {ckpt.directory}",
                        gone.status)


def train(config: Config, out_dir: str | Path | None = None, *, progress: bool = True,
          resume: bool = False, max_steps: int | None = None,
          compiled: str | Path | None = None) -> tuple[Trainer, list[dict[str, Any]]]:
    """Train ``config`` up to ``config.train.steps`` steps; returns the trainer and the
    metrics of the steps this call trained.

    With ``out_dir``, checkpoints go to ``out_dir/checkpoints`` (see
    :mod:`jaxpar.checkpoint`) every ``checkpoint.every`` steps and at the end.

    Args:
      resume: continue from the newest complete checkpoint in ``out_dir/checkpoints``
        (the layout may differ from the one it was saved under); a fresh start when there
        is none. ``metrics.jsonl`` is continued without repeating steps.
      max_steps: stop after this many steps in this call (saving a checkpoint first), as a
        time-boxed session on preemptible machines would.
      compiled: a folder of ``jaxpar compile --save``: its executable runs the steps
        (refused when it was compiled for another config, devices or versions).

    Raises:
      JaxparError: for a bad run folder (see :func:`check_run_folder`) or config, or bad
        data. :class:`NonFiniteLoss` (a JaxparError) when the loss diverged.
      RunStopped: after Ctrl-C or SIGTERM, once the checkpoint in flight is on disk.
    """
    started = goodput.session_start()  # goodput: the session counts from here (or its process)
    check_run_folder(out_dir, resume=resume, config=config)
    monitor.run_chip(config.train.catalog)  # a bad train.catalog: one line, before any work
    if out_dir is not None and "wandb" in config.train.trackers:
        trackers.check_wandb()  # W&B that cannot log: one line, before anything is written
    mirror = None
    if is_remote(out_dir):  # see jaxpar.storage.run_mirror: what is written where
        mirror = RunMirror(str(out_dir), skip=(LOCK_NAME,))
        if resume:
            _say(f"reading {mirror.url}" if mirror.direct
                 else f"downloading {mirror.url} into {mirror.local}")
            mirror.pull()
        out_dir = mirror.local
    compile_cache.enable(config.train.compile_cache)
    if compiled:  # auto knobs take what the saved step was compiled with
        config, said = with_compiled_auto(compiled, config)
        [_say(line) for line in said]
    executable = load_compiled(compiled, config, jax.devices()) if compiled else None
    # One writer per run folder: process 0 of a run holds its lock until the run ends.
    lock: FolderLock | BucketLock | None = None
    if out_dir is not None and jax.process_index() == 0:
        lock = (BucketLock(f"{mirror.url}/{LOCK_NAME}", "jaxpar train", say=_say)
                if mirror is not None else
                FolderLock(Path(out_dir) / LOCK_NAME, "jaxpar train", say=_say))
    if lock is not None:
        lock.check()  # a second writer is refused before the data is read
    # Bad data is refused before the lock (and with it the run folder) is created.
    tokens = None if reads_shards(config) else load_corpus(config)
    loader = make_loader(config, tokens=tokens)
    holdout = (make_loader(config, holdout=True, tokens=tokens)
               if config.train.eval_every > 0 else None)
    if lock is not None:
        lock.acquire()
    clean = False
    try:
        result = _train(config, out_dir, loader, holdout, progress=progress, resume=resume,
                        max_steps=max_steps, executable=executable, mirror=mirror,
                        started=started)
        clean = True
        trainer = result[0]
        if (out_dir is not None and jax.process_index() == 0
                and trainer.step_count >= config.train.steps):
            mark_finished(Path(out_dir), trainer.step_count)
        return result
    except (RunStopped, LauncherGone):  # every process stopped at the same step
        clean = True
        raise
    finally:
        if mirror is not None and (clean or jax.process_count() == 1):
            _push(mirror)
        if lock is not None:
            lock.release()
        if mirror is not None:
            mirror.discard()


def _push(mirror: RunMirror) -> None:
    """Upload what changed in the run's local copy; every process sends its own shards,
    and a step is marked uploaded once all have (see :class:`RunMirror`)."""
    many = jax.process_count() > 1
    if many:
        from jax.experimental import multihost_utils

        barrier = lambda: multihost_utils.sync_global_devices("jaxpar upload")  # noqa: E731
    mirror.push(jax.process_index(), barrier if many else None)


def _checked_trainer(config: Config, loader: TokenLoader) -> Trainer:
    """The config's trainer; a ``model.factory`` model's logits checked against
    ``model.vocab_size`` (the corpus was checked against that when it was loaded)."""
    config, said = resolve_auto(config, jax.device_count())  # what each auto knob became
    [_say(line) for line in said]
    trainer = build_trainer(config)
    if config.model.factory:  # the banner could only describe the built-in model
        weights = trainer.state.get("anchor", trainer.state.get("params"))  # DiLoCo: anchor
        n = sum(x.size for x in jax.tree.leaves(weights))
        _say(f"model {config.model.factory}: {n / 1e6:.3g}M params")
        if trainer.pipeline_schedule is not None:  # the blocks decided the schedule
            _say(trainer.pipeline_schedule.describe())
        if trainer.check_ids:  # the default loss: ids index the model's logits
            vocab = trainer.vocabulary(trainer.global_batch(loader.batch(0)))
            if vocab < config.model.vocab_size:
                raise JaxparError(
                    f"model.vocab_size={config.model.vocab_size}, but the logits of "
                    f"model.factory={config.model.factory!r} have {vocab} entries: set "
                    f"model.vocab_size={vocab} (the data's ids are checked against it) or "
                    f"widen the model's output")
    trainer.check_ids = False
    return trainer


@dataclasses.dataclass(frozen=True)
class _Due:
    """What is due once ``step`` steps are done (every step here is that 1-based count,
    the ``step`` of ``metrics.jsonl``), besides dispatching the next step."""

    save: bool
    evaluate: bool
    stop: bool
    log: bool
    local: bool = False
    """A save to the local tier (:mod:`jaxpar.checkpoint.local_tier`)."""

    @property
    def any(self) -> bool:
        """Whether the loop must fetch the metrics in flight now."""
        return self.save or self.evaluate or self.stop or self.log or self.local


def _due(step: int, end: int, config: Config, ckpt: Checkpointer | None,
         stop: StopOnSignal, log: RunLog, local: LocalTier | None = None) -> _Due:
    every = config.train.eval_every
    return _Due(save=ckpt is not None and (ckpt.due(step) or step == end),
                evaluate=every > 0 and (step % every == 0 or step == end),
                # every process asks every step: the stop is agreed collectively
                stop=stop.agreed(jax.process_count()) and step < end,
                log=log.due(step, last=step == end),
                local=local is not None and local.due(step) and step < end)


def _train(config: Config, out_dir: str | Path | None, loader: TokenLoader,
           holdout: TokenLoader | None, *,
           progress: bool, resume: bool, max_steps: int | None,
           executable: tuple[Any, tuple] | None = None, mirror: RunMirror | None = None,
           started: tuple[float, str] | None = None) -> tuple[Trainer, list[dict[str, Any]]]:
    # goodput: the clock closes last, once the last save is written (see jaxpar.runs.goodput)
    clock = goodput.GoodputClock(out_dir, started, resume=resume,
                                 writer=jax.process_index() == 0)
    with compile_cache.CompileWatch() as compiling, clock:
        return _train_watched(config, out_dir, loader, holdout, progress=progress,
                              resume=resume, max_steps=max_steps, executable=executable,
                              compiling=compiling, mirror=mirror, clock=clock)


def _train_watched(config: Config, out_dir: str | Path | None, loader: TokenLoader,
                   holdout: TokenLoader | None, *, progress: bool, resume: bool,
                   max_steps: int | None, executable: tuple[Any, tuple] | None,
                   compiling: compile_cache.CompileWatch, mirror: RunMirror | None = None,
                   clock: goodput.GoodputClock | None = None
                   ) -> tuple[Trainer, list[dict[str, Any]]]:
    clock = clock or goodput.GoodputClock(None)
    out = Path(out_dir) if out_dir is not None else None
    is_writer = jax.process_index() == 0
    trainer = _checked_trainer(config, loader)
    if executable is not None:
        if not isinstance(trainer, Trainer):
            raise JaxparError("--compiled runs one compiled step: it does not combine with "
                              "diloco.sync_every")
        trainer.use_compiled(jax.ShapeDtypeStruct(executable[1], np.int32), executable[0])
        _say("running the step compiled ahead of time (--compiled)")
    ckpt = (Checkpointer.from_config(mirror.checkpoints if mirror is not None
                                     else out / "checkpoints", config.checkpoint)
            if out is not None else None)
    if ckpt is not None and isinstance(loader, DocumentLoader):
        ckpt.data_state = lambda step: {"streams": _all_streams(loader, step)}
    history: list[dict[str, Any]] = []
    pending = lambda: (f"checkpoint {ckpt.in_flight()}"
                       if ckpt is not None and ckpt.in_flight() is not None else None)
    with contextlib.ExitStack() as cleanup:  # closed in reverse: the bar first, signals last
        stop = cleanup.enter_context(StopOnSignal(_say, pending))
        if ckpt is not None:
            cleanup.callback(ckpt.close)
        local = tiers.local_tier(config, ckpt, resume)
        if local is not None:
            cleanup.callback(local.close)
        cleanup.callback(clock.closing)  # goodput: from here the session waits for saves
        profile = ProfileWindow(config.train.profile_steps or None,
                                out / "profile" if out is not None else "profile")
        cleanup.callback(profile.close)
        resumed_at = _restore(trainer, ckpt, config, loader, local) if resume else None
        replica = ReplicaClient.from_env()  # one of jaxpar launch --replicas
        if replica is not None:
            joined = replica.join(trainer)
            if joined:
                _say(f"replica {replica.replica}: joined the others at step {joined}")
            if resumed_at is not None:  # back to the last meeting: its steps are redone
                resumed_at = min(resumed_at, joined)
        if out is not None and is_writer:
            out.mkdir(parents=True, exist_ok=True)
            config.save(out / "config.yaml")
        log = RunLog(config, out, resumed_at=resumed_at, writer=is_writer)
        if config.model.factory and is_writer:
            _say(f"mfu: {log.flops_source}")
        cleanup.callback(log.close)
        begin = trainer.step_count
        end = config.train.steps if max_steps is None else min(config.train.steps,
                                                               begin + max_steps)
        bar = tqdm(total=end - begin, desc="train", dynamic_ncols=True,
                   disable=not (progress and is_writer))
        cleanup.callback(bar.close)
        batches = Prefetcher(lambda i: trainer.global_batch(loader.batch(i)), begin, end)
        cleanup.callback(batches.close)
        # fp16 loss scaling skips non-finite steps itself; otherwise they stop the run
        window = _Window(log, guard=trainer.loss_scale is None, ckpt=ckpt)
        clock.loop_started(begin)  # goodput: the time so far was startup
        for index, batch in batches:
            profile.before_step(index)
            metrics = trainer.step_async(batch)
            metrics["data_wait_s"] = batches.last_wait_s  # the step waited for its batch
            window.add(metrics)
            profile.after_step(index, trainer.state)
            bar.update(1)
            step = trainer.step_count
            if replica is not None and replica.due(step):
                try:
                    replica.meet(trainer, step)
                except LauncherGone as gone:
                    raise _launcher_gone(gone, trainer, ckpt, config) from None
            due = _due(step, end, config, ckpt, stop, log, local)
            if not (due.any or window.full):
                continue
            rows = window.fetch(step)  # waits for the steps in flight
            clock.steps(rows)  # goodput: the time since the last mark went to these steps
            if not history:  # the first step compiled the step (or found it in the cache)
                rows[0].update(compiling.metrics())
                _say(compiling.describe())
            _act(due, rows[-1], trainer, config, ckpt, holdout, end, local)
            clock.acted(rows[-1], due.save)  # goodput: saves, evaluation; run figures
            for row in rows:
                history.append(row)
                if log.due(row["step"], last=row["step"] == end, metrics=row):
                    log.write(row)
            # After a save to either tier, the bucket gets the rows of every step it holds
            # (a resume from the fast tier continues metrics.jsonl from there).
            if (due.save or due.local) and mirror is not None and rows[-1]["step"] < end:
                if due.save and not mirror.direct:
                    ckpt.wait()  # the step's files are on disk: send them to the bucket
                _push(mirror)
                clock.mark("checkpoint")  # goodput: the upload (with the rows' logging)
            last = rows[-1]
            bar.set_postfix(loss=f"{last['loss']:.4f}",
                            tok_s_dev=f"{last['tokens_per_s_per_device']:,.0f}",
                            step_s=f"{last['step_time_s']:.3f}",
                            **({"mfu": f"{last['mfu']:.1%}"} if "mfu" in last else {}))
            if due.stop:
                raise _stopped(stop, trainer, ckpt, config, local)
    return trainer, history


def _act(due: _Due, row: dict[str, Any], trainer: Trainer, config: Config,
         ckpt: Checkpointer | None, holdout: TokenLoader | None, end: int,
         local: LocalTier | None = None) -> None:
    """Save and evaluate as due after step ``row["step"]``; their figures join its row."""
    if due.save:
        blocked = ckpt.save(trainer, config=config, when_due=row["step"] != end)
        if blocked is not None:
            row["checkpoint_block_s"] = blocked
    if due.local:
        row["local_checkpoint_block_s"] = tiers.save_local(local, ckpt, trainer, config)
    if due.evaluate:
        began = time.perf_counter()
        row["eval_loss"] = evaluate(trainer, holdout, config.train.eval_batches)
        row["eval_s"] = time.perf_counter() - began


def _all_streams(loader: DocumentLoader, step: int) -> list[list[int]]:
    """The positions of every process's document streams before batch ``step``, in row
    order (gathered from all processes)."""
    mine = loader.local_state(step)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        mine = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    return mine.tolist()


def _restore(trainer: Trainer, ckpt: Checkpointer | None, config: Config,
             loader: Any = None, local: LocalTier | None = None) -> int | None:
    """Load the newest checkpoint of either tier into ``trainer`` (and a document
    loader's positions into ``loader``); returns its step (None when there is none, and
    the run starts from step 0)."""
    got = tiers.restore_newest(trainer, ckpt, local, _say) if ckpt is not None else None
    if got is None:
        _say(f"no checkpoint in {ckpt.directory if ckpt else '(no --out)'}; starting from "
             "step 0")
        return None
    step, meta = got.step, got.meta
    data_pos = (meta.get("data") or {}).get("position", step)
    if data_pos != step:
        raise JaxparError(f"checkpoint {got.where}: data position {data_pos} "
                          f"does not match step {step}")
    if isinstance(loader, DocumentLoader):
        streams = (meta.get("data") or {}).get("streams")
        if streams is None:
            raise JaxparError(f"checkpoint {got.where} holds no positions of document "
                              "streams (it was saved reading other data): resume it with "
                              "the data it was trained on, or start a new --out")
        loader.restore(streams, step)
    _say(f"resumed from {got.where} (step {step} of {config.train.steps})")
    changed = _changed_keys(got.config, config.to_dict())
    if changed:
        _say("config differs from the checkpoint's (the run will not match an "
             "uninterrupted one): " + "; ".join(changed))
    return step


def summarize(history: list[dict[str, Any]], skip_first: int = 1) -> dict[str, float]:
    """Final loss and mean throughput, excluding the first (compiling) steps."""
    steady = history[skip_first:] or history
    return {
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "mean_step_time_s": sum(m["step_time_s"] for m in steady) / max(len(steady), 1),
        "mean_tokens_per_s": sum(m["tokens_per_s"] for m in steady) / max(len(steady), 1),
    }
