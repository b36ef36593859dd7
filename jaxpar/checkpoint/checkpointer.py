"""Checkpoints that survive faults: asynchronous, atomic, sharded saves restored into any plan.

A run's checkpoints live under ``RUN/checkpoints``, one folder per step, written by an
``orbax.checkpoint.CheckpointManager`` with three items:

* ``state``: the :class:`~jaxpar.Trainer`'s state pytree (``params``, ``frozen``,
  ``opt_state``, ``step``, and ``master``/``loss_scale`` when the precision policy has
  them), each array written shard by shard by the processes that hold it;
* ``meta`` (JSON): the step, the seed (model init and data order derive from it; LoRA
  dropout state is part of ``frozen``), the data loader's position and the layout it was
  saved under;
* ``config`` (JSON): the resolved run config.

Saves are asynchronous: the step blocks only while arrays are copied off the devices, the
files are written by a background thread. They are atomic: orbax writes into
``<step>.orbax-checkpoint-tmp-*`` and renames the folder to ``<step>`` once every item of
every process is on disk, so a folder named by its step alone is complete.

The folder may be a ``gs://`` URL: TensorStore writes each process's shards straight to
the bucket (see :mod:`jaxpar.storage.run_mirror`).

Restoring reads every array straight into the shardings of the Trainer it restores into
(each device reads only its own slices), so a checkpoint saved under one plan loads under
another: another device count, mesh or ZeRO stage, or the pipeline's ``(repeat, stage)``
layout of stacked layers (a reshape on the devices after reading; see
:mod:`jaxpar.checkpoint.reshard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from jaxpar.checkpoint import structure
from jaxpar.checkpoint.reshard import flat_paths, flatten_dict, listing, match, nest
from jaxpar.errors import JaxparError, JaxparWarning
from jaxpar.storage.folders import free_bytes, human_bytes, write_fault
from jaxpar.storage.remote import configure_clients, is_remote, reported

STATE, META, CONFIG = "state", "meta", "config"
SAVE_DELAY_ENV = "JAXPAR_CHECKPOINT_TEST_DELAY"
"""Test hook: seconds each save sleeps in the background before its last file is written."""


class CorruptCheckpoint(JaxparError):
    """A checkpoint folder that exists but cannot be read back."""


class CheckpointSaveFailed(JaxparError):
    """A save the file system refused (full disk, read-only folder); the checkpoints saved
    before it are intact."""


class CheckpointWarning(JaxparWarning):
    """A checkpoint was skipped (corrupt) and an older one used instead."""


class _MetaHandler(ocp.handlers.JsonCheckpointHandler):
    """JSON item that honours :data:`SAVE_DELAY_ENV`, so tests can kill a process mid-save."""

    async def _save_fn(self, x, directory):
        delay = float(os.environ.get(SAVE_DELAY_ENV) or 0)
        if delay > 0:
            await asyncio.sleep(delay)
        await super()._save_fn(x, directory)


@ocp.args.register_with_handler(_MetaHandler, for_save=True)
class _MetaSave(ocp.args.JsonSave):
    """Save args of :class:`_MetaHandler`."""


@ocp.args.register_with_handler(_MetaHandler, for_restore=True)
class _MetaRestore(ocp.args.JsonRestore):
    """Restore args of :class:`_MetaHandler`."""


@contextlib.contextmanager
def _quiet_asyncio() -> Iterator[None]:
    """Silence asyncio's dump of every sibling read that failed with a corrupt file (the
    first failure is reported, once, as a CorruptCheckpoint)."""
    log = logging.getLogger("asyncio")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        gc.collect()  # the orphaned futures report when collected: do it while quiet
        log.setLevel(level)


def _is_late_wakeup(unraisable: Any) -> bool:
    """Whether an unraisable error is a TensorStore write finishing after the event loop
    that awaited it closed: when one write of a save fails, orbax's loop ends at once and
    its sibling writes call back into the closed loop."""
    err, tb = unraisable.exc_value, unraisable.exc_traceback
    return (isinstance(err, RuntimeError) and str(err) == "Event loop is closed"
            and tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe")


def _drop_late_wakeups() -> None:
    """Install (once) an unraisable hook that drops :func:`_is_late_wakeup` errors and
    passes every other one on: the failed save is reported as one line of its own."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxpar_late_wakeups", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_late_wakeup(unraisable):
            previous(unraisable)

    hook._jaxpar_late_wakeups = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class _ReportedWriteFaults(logging.Filter):
    """Drops orbax's logs of a save the file system refused (a full disk, a read-only
    folder): :class:`Checkpointer` reports that as one line of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not ((err is not None and write_fault(err))
                    or write_fault(Exception(record.getMessage())))


_WRITE_FAULT_FILTER = _ReportedWriteFaults()


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_as_data(flat: dict[str, Any]) -> dict[str, Any]:
    """Typed PRNG keys (an ``nnx.Rngs`` a model holds) as their ``uint32`` key data, which
    orbax can store; :meth:`Checkpointer.restore` wraps them back."""
    return {k: jax.random.key_data(v) if _is_key(v) else v for k, v in flat.items()}


def _brief(err: BaseException) -> str:
    text = " ".join(str(err).split()).split(" See full TensorStore details")[0]
    return f"{type(err).__name__}: {text[:300]}"


# --- the manager --------------------------------------------------------------------------
def _manager(directory: Path, *, keep: int | None = None, async_save: bool = True,
             read_only: bool = False, on_saved: Callable[[], None] | None = None
             ) -> ocp.CheckpointManager:
    """``on_saved``: called (in the writing thread) once an asynchronous save's files are
    all written."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=not read_only,
        read_only=read_only, cleanup_tmp_directories=not read_only,
        async_options=ocp.AsyncOptions(post_finalization_callback=on_saved)
        if async_save and on_saved is not None else None)
    handlers = {STATE: ocp.handlers.PyTreeCheckpointHandler(), META: _MetaHandler(),
                CONFIG: ocp.handlers.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, item_handlers=handlers, options=options)


Location = Path | epath.Path
"""A checkpoint folder: a local path, or a ``gs://`` URL as an ``etils.epath`` path."""


def location(directory: str | Path) -> Location:
    """``directory`` as a path orbax reads and writes: a URL stays one."""
    if is_remote(directory):
        configure_clients()
        return epath.Path(str(directory).rstrip("/"))
    return Path(directory).expanduser().absolute()


def resolve_dir(source: str | Path, what: str = "checkpoint folder") -> Location:
    """The checkpoint folder for ``source``: ``RUN/checkpoints`` itself or a ``RUN`` folder
    (local, or in a bucket)."""
    path = location(source)
    with reported(str(source), what) if is_remote(source) else contextlib.nullcontext():
        if (path / "checkpoints").is_dir() and not any(p.name.isdigit()
                                                       for p in path.iterdir()):
            path = path / "checkpoints"
        if not path.is_dir():
            raise JaxparError(f"{what} {str(path)!r} does not exist")
    return path


class Checkpointer:
    """Saves and restores a :class:`~jaxpar.Trainer`'s state under one folder.

    Every process of a multi-process run must create it and call :meth:`save` and
    :meth:`restore` at the same steps: the arrays are written and read collectively.

    Args:
      directory: the checkpoint folder (``RUN/checkpoints``); created if missing.
      every: :meth:`due` when the step is a multiple of this (0: never): the training
        loop's periodic saves; a direct :meth:`save` saves whatever ``every`` is.
      keep: how many of the newest checkpoints to keep.
      async_save: write in the background while training continues.
    """

    def __init__(self, directory: str | Path, *, every: int = 100, keep: int = 3,
                 async_save: bool = True):
        if keep < 1:
            raise JaxparError(f"checkpoint.keep must be at least 1, got {keep}")
        if every < 0:
            raise JaxparError(f"checkpoint.every must be 0 or positive, got {every}")
        self.directory = location(directory)
        self.every = every
        self._manager = _manager(self.directory, keep=keep, async_save=async_save,
                                 on_saved=self._saved)
        self._saving: int | None = None  # the step of the last save started
        self._finishing: int | None = None  # the save wait() is blocked on
        self._started = 0.0  # when it started (time.perf_counter)
        self.last_save_s: float | None = None
        """Seconds the newest finished save took, start to files on disk (None: none yet)."""
        self._failed = False
        self.data_state: Callable[[int], dict[str, Any]] | None = None
        """Called with the step being saved: what the data loader needs to continue there
        (kept in ``meta["data"]``; the positions of streamed documents)."""
        logging.getLogger("absl").addFilter(_WRITE_FAULT_FILTER)  # once: filters are a set
        _drop_late_wakeups()

    @classmethod
    def from_config(cls, directory: str | Path, config: Any) -> Checkpointer:
        """From a :class:`~jaxpar.config.schema.CheckpointConfig`."""
        return cls(directory, every=config.every, keep=config.keep,
                   async_save=config.async_save)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first (waits for a save in
        flight)."""
        with self._write_faults(None):
            self._manager.wait_until_finished()
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def due(self, step: int) -> bool:
        """Whether a periodic save falls on ``step``."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(self, trainer: Any, *, config: Any = None, when_due: bool = False,
             force: bool = False) -> float | None:
        """Start saving ``trainer.state`` at its current step, now.

        ``every`` does not hold a direct call back: it only governs :meth:`due`, which the
        training loop asks with ``when_due=True`` (save only if :meth:`due` says so; its
        last step passes ``when_due=False``). ``force=True`` saves whatever ``when_due``
        says (kept for callers that pass it). A step already on disk is not saved again.

        Returns the seconds the caller was blocked (the copy off the devices, plus waiting
        for the previous save if it is still writing), or None when nothing was saved.
        """
        step = trainer.step_count
        if (when_due and not (force or self.due(step))) or step in self._manager.all_steps():
            return None
        start = time.perf_counter()
        config = config if config is not None else getattr(trainer, "config", None)
        meta = self.meta_of(trainer, config)
        state = nest(_keys_as_data(flat_paths(trainer.state)))
        args = ocp.args.Composite(**{
            STATE: ocp.args.PyTreeSave(state), META: _MetaSave(meta),
            CONFIG: ocp.args.JsonSave(config.to_dict() if config is not None else {})})
        with self._write_faults(None):
            self._manager.wait_until_finished()  # the save before writes its last bytes
        if self.local:  # a bucket has no free space to check
            need, free = self._bytes_needed(trainer.state), free_bytes(self.directory)
        else:
            need = free = 0
        if free < need:
            raise self._fault(step, f"it needs about {human_bytes(need)} but only "
                                    f"{human_bytes(free)} are free there")
        self._saving, self._started = step, start
        with self._write_faults(step):
            self._manager.save(step, args=args, force=True)
        if not self._manager.is_saving_in_progress():  # a synchronous save: written now
            self._saved()
        return time.perf_counter() - start

    def _saved(self) -> None:
        self.last_save_s = time.perf_counter() - self._started

    def meta_of(self, trainer: Any, config: Any) -> dict[str, Any]:
        """The ``meta`` item of a save of ``trainer``'s current step: the step, the seed,
        the data loader's position (:attr:`data_state`: collective) and the layout."""
        step, seed = trainer.step_count, config.train.seed if config is not None else None
        mesh = trainer.plan.mesh
        data = {"position": step, "seed": seed,
                "global_batch": config.train.global_batch if config else None}
        if self.data_state is not None:  # every process saves: gathering is collective
            data.update(self.data_state(step))
        return {"step": step, "seed": seed, "data": data,
                "processes": jax.process_count(), "devices": mesh.size,
                "mesh": dict(mesh.shape), "zero_stage": trainer.plan.zero_stage,
                "layers_per_stage": _layers_per_stage(trainer.pipeline_schedule),
                "stacks": [st.to_dict() for st in _stacks(trainer)]}

    @property
    def local(self) -> bool:
        """Whether the checkpoints are on a local file system (not in a bucket)."""
        return isinstance(self.directory, Path)

    def _bytes_needed(self, state: Any) -> int:
        """Disk space the next save takes: the newest checkpoint's size when there is one
        (saves of one run have one size), else the arrays' bytes plus block slack."""
        saved = self._manager.all_steps()
        if saved:
            folder = self.path(max(saved))
            return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())
        leaves = jax.tree.leaves(state)
        return int(sum(x.nbytes for x in leaves) * 1.25) + 8192 * len(leaves) + (1 << 16)

    def _fault(self, step: int | None, what: str) -> CheckpointSaveFailed:
        self._failed = True
        self._manager.reload()
        done = sorted(s for s in self._manager.all_steps() if s != step)
        kept = (f"checkpoints {done} are intact; free space (or lower checkpoint.keep) and "
                f"continue with --resume" if done else "no checkpoint was saved before it")
        which = f"checkpoint {step}" if step is not None else "a checkpoint"
        return CheckpointSaveFailed(f"saving {which} into {self.directory} failed: {what}; "
                                    f"{kept}")

    @contextlib.contextmanager
    def _write_faults(self, step: int | None) -> Iterator[None]:
        """Turn a write the file system refused (now, or in the background save that this
        call waits for) into one :class:`CheckpointSaveFailed` line."""
        try:
            yield
        except CheckpointSaveFailed:
            raise
        except Exception as err:
            fault = write_fault(err)
            if fault is None:
                raise
            step = step if step is not None else self._saving
            free = (f" ({human_bytes(free_bytes(self.directory))} free there)"
                    if self.local else "")
            raise self._fault(step, f"{fault}{free}") from None

    def wait(self, step: int | None = None) -> None:
        """Block until the save in flight (if any) is complete on disk; ``step``: the
        save's step when the caller has read it already (:meth:`in_flight` reports it
        until the wait ends)."""
        self._finishing = step if step is not None else self.in_flight()
        try:
            with self._write_faults(None):
                self._manager.wait_until_finished()
        finally:
            self._finishing = None

    def in_flight(self) -> int | None:
        """The step of the save still being written in the background, or None. While
        :meth:`wait` blocks on a save, that save's step: orbax can report no save in
        progress before its finalization ends (a signal handler asking mid-wait, as the
        second Ctrl-C does, was told nothing was pending)."""
        if self._finishing is not None:
            return self._finishing
        if not self._manager.is_saving_in_progress():
            return None
        return self._manager.latest_step()

    def close(self) -> None:
        """Finish the save in flight and release the manager (after a failed save, quietly:
        the failure was reported already)."""
        if self._failed:
            with contextlib.suppress(Exception):
                self._manager.close()
            return
        with self._write_faults(None):
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def path(self, step: int) -> Location:
        """The folder of checkpoint ``step``."""
        return self.directory / str(step)

    def saved_shapes(self, step: int) -> dict[str, tuple]:
        """``{path: shape}`` of the arrays in checkpoint ``step``.

        Raises:
          CorruptCheckpoint: when its metadata cannot be read.
        """
        try:
            tree = self._manager.item_metadata(step)[STATE]
            tree = getattr(tree, "tree", tree)
            shapes = {k: tuple(v.shape) for k, v in flatten_dict(tree).items()}
        except AttributeError as e:
            raise CorruptCheckpoint(
                f"checkpoint {self.path(step)} is unreadable: its array metadata is missing "
                "or damaged") from e
        except Exception as e:  # orbax and tensorstore raise many types
            raise CorruptCheckpoint(
                f"checkpoint {self.path(step)} is unreadable ({_brief(e)})") from e
        if not shapes:
            raise CorruptCheckpoint(f"checkpoint {self.path(step)} holds no arrays")
        return shapes

    def meta(self, step: int) -> dict[str, Any]:
        """The ``meta`` item of checkpoint ``step`` (step, seed, data position, layout).

        Raises:
          CorruptCheckpoint: when it cannot be read.
        """
        return self._json_item(step, META, _MetaRestore())

    def config(self, step: int) -> dict[str, Any]:
        """The resolved run config saved with checkpoint ``step`` (a nested dict)."""
        return self._json_item(step, CONFIG, ocp.args.JsonRestore())

    def _json_item(self, step: int, name: str, args: ocp.args.JsonRestore) -> dict[str, Any]:
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**{name: args}))
        except Exception as e:
            raise CorruptCheckpoint(
                f"checkpoint {self.path(step)} is unreadable ({_brief(e)})") from e
        return dict(out[name] or {})

    def read(self, step: int, target: Mapping[str, Any], what: str = "",
             partial: bool = False, stages: int = 1, layers_per_stage: int = 1,
             stacks: list[structure.Stack] | None = None
             ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """Read the arrays at ``target``'s paths from checkpoint ``step`` into ``target``'s
        shapes, dtypes and shardings; returns them and the checkpoint's ``meta``.

        Raises:
          CorruptCheckpoint: when the files cannot be read.
          JaxparError: when shapes or paths do not match (``partial``: extra paths in the
            checkpoint are fine).

        ``stages``, ``layers_per_stage``: how ``target``'s stacked layers are laid out
        (:class:`jaxpar.parallel.pipeline.Schedule`). ``stacks``: the blocks ``target``
        holds stacked (:func:`jaxpar.checkpoint.structure.stacks_of`); a checkpoint whose
        blocks ran in another layout (scanned, staged, as a list) is read across
        (:func:`jaxpar.checkpoint.structure.relayout`).
        """
        saved = self.saved_shapes(step)
        meta = self.meta(step)
        saved_stacks = structure.from_meta(meta)
        if structure.differ(saved_stacks, stacks or []):
            return self._read_across(step, saved, target, meta, saved_stacks, stacks or [],
                                     what, partial)
        saved_stages = int((meta.get("mesh") or {}).get("stage", 1))
        if partial:
            saved = {k: v for k, v in saved.items() if k in target}
        abstract, fixes = match(saved, target, what or f"checkpoint {self.path(step)}",
                                (saved_stages, stages),
                                (int(meta.get("layers_per_stage", 1)), layers_per_stage))
        values = self._restore_arrays(step, abstract, partial)
        values = {k: fixes[k](values[k]) if k in fixes else values[k] for k in target}
        return values, meta

    def _restore_arrays(self, step: int, abstract: Mapping[str, jax.ShapeDtypeStruct],
                        partial: bool) -> dict[str, jax.Array]:
        """The arrays at ``abstract``'s paths of checkpoint ``step``, in its shardings."""
        item = nest(abstract)
        args = ocp.args.PyTreeRestore(item=item, partial_restore=partial,
                                      restore_args=ocp.checkpoint_utils.construct_restore_args(item))
        try:
            with _quiet_asyncio():
                out = self._manager.restore(step, args=ocp.args.Composite(**{STATE: args}))
        except Exception as e:
            raise CorruptCheckpoint(
                f"checkpoint {self.path(step)} is corrupt or truncated ({_brief(e)})") from e
        return flatten_dict(out[STATE])

    def _read_across(self, step: int, saved: Mapping[str, tuple], target: Mapping[str, Any],
                     meta: dict[str, Any], saved_stacks: list, stacks: list, what: str,
                     partial: bool) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """:meth:`read` of a checkpoint whose blocks are laid out otherwise than ``target``'s."""
        abstract, builders, missing, extra = structure.relayout(saved, target, saved_stacks,
                                                                stacks)
        problems = ([f"missing from the checkpoint: {listing(missing)}"] if missing else []) + (
            [f"in the checkpoint but not in this model: {listing(extra)}"]
            if extra and not partial else [])
        if problems:
            raise JaxparError(f"{what or f'checkpoint {self.path(step)}'} does not match the "
                              f"config (its blocks laid out as it ran, read across): "
                              + "; ".join(problems))
        values = self._restore_arrays(step, abstract, partial=True)
        return {k: builders[k](values) for k in target}, meta

    def restore(self, trainer: Any, step: int | None = None) -> dict[str, Any]:
        """Load checkpoint ``step`` into ``trainer.state``, resharded to its plan.

        With ``step`` None, the newest complete checkpoint; a corrupt one is skipped with a
        :class:`CheckpointWarning` and renamed ``corrupt-<step>`` (kept, not deleted) so
        the run can save that step again. Returns the checkpoint's ``meta``.

        Raises:
          JaxparError: when no checkpoint exists or none can be read, or when the
            checkpoint's shapes do not match the trainer's (listing the paths).
        """
        if step is not None:
            return self._restore_step(trainer, step)
        steps = self.steps()
        if not steps:
            raise JaxparError(f"no complete checkpoint in {self.directory}")
        bad: list[int] = []
        for s in reversed(steps):
            try:
                meta = self._restore_step(trainer, s)
            except CorruptCheckpoint as e:
                warnings.warn(f"{e}; trying an older checkpoint", CheckpointWarning,
                              stacklevel=2)
                bad.append(s)
                continue
            if bad:
                self._set_aside(bad)
            return meta
        raise JaxparError(f"no readable checkpoint in {self.directory}: steps {steps} "
                          "are all corrupt")

    def _restore_step(self, trainer: Any, step: int) -> dict[str, Any]:
        target = flat_paths(trainer.state)
        source = _weights_as_saved(target, self.saved_shapes(step))
        read = {source[k]: v for k, v in target.items() if k in source}
        values, meta = self.read(step, _keys_as_data(read),
                                 stages=trainer.plan.mesh.shape["stage"],
                                 layers_per_stage=_layers_per_stage(trainer.pipeline_schedule),
                                 stacks=_stacks(trainer), partial=len(read) < len(target)
                                 or any(k != v for k, v in source.items()))
        values = {k: values[source[k]] if k in source else jax.device_put(
            values[source[f"master/{k[7:]}"]].astype(target[k].dtype), target[k].sharding)
            for k in target}  # (a copy the checkpoint lacks: cast from its master weights)
        for k, leaf in target.items():  # typed PRNG keys were stored as their key data
            if _is_key(leaf):
                values[k] = jax.random.wrap_key_data(values[k], impl=jax.random.key_impl(leaf))
        treedef = jax.tree_util.tree_structure(trainer.state)
        state = jax.tree_util.tree_unflatten(treedef, [values[k] for k in target])
        if int(state["step"]) != step:
            raise CorruptCheckpoint(f"checkpoint {self.path(step)} holds step "
                                    f"{int(state['step'])}, not {step}")
        trainer.state = state
        return meta

    def _set_aside(self, steps: list[int]) -> None:
        if jax.process_index() == 0:
            for s in steps:
                dest = self.directory / f"corrupt-{s}"
                n = 1
                while dest.exists():
                    dest, n = self.directory / f"corrupt-{s}.{n}", n + 1
                self.path(s).rename(dest)
                warnings.warn(f"kept corrupt checkpoint {self.path(s)} as {dest}",
                              CheckpointWarning, stacklevel=3)
        ocp.multihost.sync_global_processes("jaxpar_checkpoint_set_aside")
        self._manager.reload()


# --- weights only (init_from) -------------------------------------------------------------
def _weights_as_saved(target: dict[str, Any], saved: Mapping[str, tuple]) -> dict[str, str]:
    """The checkpoint path each of ``target``'s paths is read from. The same path, unless
    the state and the checkpoint differ in keeping a compute-dtype copy of the weights
    beside the master weights (``Plan.weight_copy``): a state without one reads its
    ``params`` from the checkpoint's ``master``; a state with one reads its ``master``
    from the checkpoint's ``params`` (its master weights), and its copy is left out (cast
    from them)."""
    has = lambda keys, group: any(k.startswith(f"{group}/") for k in keys)  # noqa: E731
    source = {k: k for k in target}
    if has(target, "master") == has(saved, "master") or not has(target, "params"):
        return source
    if has(saved, "master"):
        return {k: f"master/{k[7:]}" if k.startswith("params/") else k for k in target}
    return {k: f"params/{k[7:]}" if k.startswith("master/") else k for k in target
            if not k.startswith("params/")}


def read_only(source: str | Path, what: str = "checkpoint folder") -> Checkpointer:
    """A :class:`Checkpointer` that only reads the checkpoints of ``source`` (a
    ``RUN/checkpoints`` or ``RUN`` folder, local or ``gs://``): it creates and cleans up
    nothing there, so it is safe beside a run still writing; close it when done."""
    directory = resolve_dir(source, what)
    reader = Checkpointer.__new__(Checkpointer)
    reader.directory, reader.every = directory, 0
    reader._saving, reader._failed, reader._started, reader.last_save_s = None, False, 0.0, None
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that a read-only manager will not save
    try:
        reader._manager = _manager(directory, read_only=True)
    finally:
        absl.setLevel(level)
    return reader


def _stacks(trainer: Any) -> list[structure.Stack]:
    """The stacked blocks of a trainer's model (none for a trainer without one)."""
    model = getattr(trainer, "structure", None)
    return structure.stacks_of(model) if model is not None else []


def _layers_per_stage(schedule: Any) -> int:
    return schedule.layers_per_stage if schedule is not None else 1


def load_weights(model: nnx.Module, source: str | Path, *, stages: int = 1,
                 variables: Any = nnx.Param, what: str = "init_from") -> int:
    """Overwrite ``model``'s ``nnx.Param`` s with those of the newest readable checkpoint in
    ``source`` (a ``RUN/checkpoints`` or ``RUN`` folder), each read into the sharding of the
    variable it replaces; returns the checkpoint's step.

    Float32 master weights are preferred to a half-precision working copy when the
    checkpoint has both. Use it before wrapping the model with LoRA (or, to load a LoRA
    run's adapters too, after wrapping it the same way). ``stages``: pipeline stages
    ``model``'s stacked layers are laid out for (a model with a ``pipeline_schedule`` says
    itself). ``variables``: an ``nnx`` filter of the
    variables to overwrite (default the ``nnx.Param`` s). ``what``: what the user named the
    source with, for messages (``init_from``, ``--run``).

    Raises:
      JaxparError: when no checkpoint can be read, or the checkpoint's model does not match
        ``model`` (listing the mismatched paths).
    """
    reader = read_only(source, what)
    directory = reader.directory
    try:
        steps = reader.steps()
        if not steps:
            raise JaxparError(f"{what}: no complete checkpoint in {directory}")
        state = nnx.state(model, variables)
        wanted = flat_paths(state)
        schedule = getattr(model, "pipeline_schedule", None)
        stages = schedule.stages if schedule is not None else stages
        for step in reversed(steps):
            try:
                saved = reader.saved_shapes(step)
                names = {k: next((f"{g}/{k}" for g in ("master", "params", "frozen")
                                  if f"{g}/{k}" in saved), f"params/{k}") for k in wanted}
                target = {names[k]: v for k, v in wanted.items()}
                values, _ = reader.read(step, target, partial=True, stages=stages,
                                        layers_per_stage=_layers_per_stage(schedule),
                                        what=f"{what} checkpoint {reader.path(step)}",
                                        stacks=structure.stacks_of(model))
            except CorruptCheckpoint as e:
                warnings.warn(f"{e}; trying an older checkpoint", CheckpointWarning,
                              stacklevel=2)
                continue
            leaves = [values[names[k]] for k in wanted]
            new = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state), leaves)
            nnx.update(model, new)
            return step
        raise JaxparError(f"{what}: no readable checkpoint in {directory}")
    finally:
        reader.close()


__all__ = [
    "CheckpointWarning",
    "Checkpointer",
    "CorruptCheckpoint",
    "SAVE_DELAY_ENV",
    "flat_paths",
    "load_weights",
    "match",
    "read_only",
    "resolve_dir",
]
