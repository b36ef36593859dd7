"""The fast checkpoint tier: each process saves its own shards to its own disk.

A run's persistent checkpoints (:class:`~jaxpar.checkpoint.checkpointer.Checkpointer`, under
``RUN/checkpoints``, often a bucket) are slow to write and so infrequent. The local tier
(``checkpoint.local_dir``) is the fast one, as in MaxText's emergency checkpointing: every
``checkpoint.local_every`` steps (and when the run is preempted) each process writes the
data of the shards its own devices hold, each distinct slice of an array once, to

    <local_dir>/<step>/process_<i>.bin    the shards' bytes, one after the other
    <local_dir>/<step>/process_<i>.json   step, run, layout, data position, config, and
                                          each array's shape, dtype and slices (offsets)

``<local_dir>`` may hold ``{process}``, replaced by the process index (a folder per process
on a shared disk). The step blocks only while the shards are copied off the devices; a
background thread writes them into temporary files and renames them (the ``.json`` last),
so a step whose ``.json`` is there is complete. Each process keeps its newest
``checkpoint.local_keep`` steps.

Restoring needs no other process and no collective read: each process reads the slices its
devices hold in the restoring run, so it works when every process finds every slice it
needs in its own file (the same layout; another device count or mesh does not fit). The
processes agree (:meth:`LocalTier.agree`) on the newest step all of them can restore;
:func:`jaxpar.runs.tiers` restores from whichever of that step and the persistent tier's
newest is newer. A process whose folder is gone (a replaced host) has no step: the run
restores from the persistent tier (restoring its slices from peers is not done).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.checkpoint.checkpointer import (
    CheckpointWarning,
    CorruptCheckpoint,
    _is_key,
    flat_paths,
)
from jaxpar.errors import JaxparError

GATHERED = 16
"""Steps per process compared when the processes agree on a step (the newest ones)."""

Span = tuple[tuple[int, int], ...]
"""The slice of an array one shard holds: ``(start, stop)`` per dimension."""


def _span(index: tuple[slice, ...], shape: tuple[int, ...]) -> Span:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _as_data(leaf: Any) -> jax.Array:
    """A typed PRNG key as its ``uint32`` key data (kept as such), any other array as is."""
    return jax.random.key_data(leaf) if _is_key(leaf) else leaf


def local_folder(template: str | Path, process: int) -> Path:
    """``checkpoint.local_dir`` for process ``process``: ``{process}`` replaced by it."""
    return Path(str(template).replace("{process}", str(process))).expanduser().absolute()


def common_step(usable: np.ndarray) -> int | None:
    """The newest step in every row of ``usable`` (one row per process, its usable steps,
    -1 padding), or None."""
    rows = [{int(s) for s in row if s >= 0} for row in usable]
    common = set.intersection(*rows) if rows else set()
    return max(common) if common else None


def why_not(present: np.ndarray, usable: np.ndarray, chosen: int | None) -> str | None:
    """Why the processes agreed on no step newer than ``chosen`` (None when none is newer):
    the processes missing the newest step any holds, or holding it in another layout."""
    newest = max((int(s) for row in present for s in row if s >= 0), default=None)
    if newest is None or (chosen is not None and newest <= chosen):
        return None
    missing = [p for p, row in enumerate(present) if newest not in row]
    layout = [p for p, row in enumerate(usable) if newest not in row and p not in missing]
    parts = ([f"missing on process{'es' if len(missing) > 1 else ''} "
              f"{', '.join(map(str, missing))}"] if missing else []) + (
        [f"saved under another layout (process{'es' if len(layout) > 1 else ''} "
         f"{', '.join(map(str, layout))} lack{'' if len(layout) > 1 else 's'} slices this "
         "run's devices hold)"]
        if layout else [])
    return f"local tier step {newest} is {' and '.join(parts)}"


def _gather(rows: np.ndarray) -> np.ndarray:
    """``rows`` of every process, stacked (collective in a multi-process run)."""
    if jax.process_count() == 1:
        return rows[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(rows))


def _padded(steps: list[int]) -> np.ndarray:
    newest = sorted(steps)[-GATHERED:]
    return np.array(newest + [-1] * (GATHERED - len(newest)), np.int64)


class LocalTier:
    """One process's fast checkpoint tier (see the module's docstring).

    Every process of a run creates one (with its own folder) and calls :meth:`save`,
    :meth:`agree` and :meth:`restore` at the same steps: saving writes only this
    process's files, agreeing is collective.

    Args:
      directory: ``checkpoint.local_dir``; ``{process}`` is replaced by the process index.
      run: what names the run (its persistent checkpoint folder): steps another run left
        in the folder are neither restored nor pruned.
      every: save when the step is a multiple of this (0: only when asked, on preemption).
      keep: how many of this process's newest steps to keep.
    """

    def __init__(self, directory: str | Path, *, run: str, every: int = 0, keep: int = 2):
        if keep < 1:
            raise JaxparError(f"checkpoint.local_keep must be at least 1, got {keep}")
        if every < 0:
            raise JaxparError(f"checkpoint.local_every must be 0 or more, got {every}")
        self.process = jax.process_index()
        self.directory = local_folder(directory, self.process)
        self.run, self.every, self.keep = run, every, keep
        self.name = f"process_{self.process}"
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self.last_write_s: float | None = None
        """Seconds the newest finished write took in the background."""
        if self.directory.is_dir():  # a write cut short by a kill left these
            for tmp in self.directory.glob(f"*/{self.name}.*.tmp"):
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def due(self, step: int) -> bool:
        """Whether a periodic save falls on ``step``."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def path(self, step: int) -> Path:
        """The folder of step ``step``."""
        return self.directory / str(step)

    # --- what is on disk ----------------------------------------------------------------
    def _index(self, step: int) -> dict[str, Any] | None:
        """This process's ``.json`` of ``step`` when it belongs to this run, else None."""
        try:
            index = json.loads((self.path(step) / f"{self.name}.json").read_text())
        except (OSError, ValueError):
            return None
        return index if index.get("run") == self.run and index.get("step") == step else None

    def steps(self) -> list[int]:
        """This process's complete steps of this run, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()]
        return sorted(s for s in found if self._index(s) is not None)

    def _misfit(self, index: dict[str, Any], targets: dict[str, Any]) -> str | None:
        """What in ``index`` does not fit the arrays of ``targets`` (None: it fits)."""
        leaves = index.get("leaves", {})
        if set(leaves) != set(targets):
            return "it holds other arrays"
        for path, target in targets.items():
            info = leaves[path]
            if tuple(info["shape"]) != target.shape or info["dtype"] != str(target.dtype):
                return f"{path} is {info['dtype']}{info['shape']}"
            have = {tuple(map(tuple, s[0])) for s in info["shards"]}
            need = target.sharding.addressable_devices_indices_map(target.shape).values()
            if any(_span(i, target.shape) not in have for i in need):
                return (f"{path} lacks slices this process needs (saved by "
                        f"{index['processes']} process(es) on mesh {index['mesh']})")
        return None

    # --- saving -------------------------------------------------------------------------
    def save(self, trainer: Any, meta: dict[str, Any], config: dict[str, Any]) -> float:
        """Start saving ``trainer.state`` at its current step; ``meta`` is the
        persistent tier's meta of this step (the data position), ``config`` the run's.

        Returns the seconds the caller was blocked: the copy off the devices (and the
        previous write, if still going on). The files are written in the background.
        """
        start = time.perf_counter()
        self.wait()
        step = trainer.step_count
        leaves, shards = {}, []
        for path, leaf in flat_paths(trainer.state).items():
            data = _as_data(leaf)
            if not isinstance(data, jax.Array):
                raise JaxparError(f"the local checkpoint tier saves arrays; {path} is a "
                                  f"{type(leaf).__name__}")
            leaves[path] = {"shape": list(data.shape), "dtype": str(data.dtype),
                            "key": _is_key(leaf), "shards": []}
            seen: set[Span] = set()
            for shard in data.addressable_shards:
                span = _span(shard.index, data.shape)
                if span not in seen:
                    seen.add(span)
                    shards.append((path, span, shard.data))
        for _, _, data in shards:
            data.copy_to_host_async()
        # Copies, not views: the next step may reuse (donate) the devices' buffers.
        host = [(path, span, np.array(data)) for path, span, data in shards]
        mesh = trainer.plan.mesh
        index = {"run": self.run, "step": step, "process": self.process,
                 "processes": jax.process_count(), "mesh": dict(mesh.shape),
                 "devices": [d.id for d in mesh.devices.flat], "meta": meta,
                 "config": config, "leaves": leaves}
        self._thread = threading.Thread(target=self._write, args=(step, host, index),
                                        name=f"jaxpar-local-checkpoint-{step}", daemon=True)
        self._thread.start()
        return time.perf_counter() - start

    def _write(self, step: int, host: list[tuple[str, Span, np.ndarray]],
               index: dict[str, Any]) -> None:
        start = time.perf_counter()
        folder = self.path(step)
        data, meta = folder / f"{self.name}.bin", folder / f"{self.name}.json"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            offset = 0
            with open(f"{data}.tmp", "wb") as f:
                for path, span, array in host:
                    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                    f.write(raw)
                    index["leaves"][path]["shards"].append([span, offset, raw.size])
                    offset += raw.size
                f.flush()
                os.fsync(f.fileno())
            index["bytes"] = offset
            os.replace(f"{data}.tmp", data)
            Path(f"{meta}.tmp").write_text(json.dumps(index))
            os.replace(f"{meta}.tmp", meta)  # last: the step is complete
            self.last_write_s = time.perf_counter() - start
            self._prune()
        except Exception as err:  # reported by wait(); the persistent tier goes on
            self._error = (step, err)
            for tmp in (f"{data}.tmp", f"{meta}.tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def wait(self) -> None:
        """Block until the write in flight is on disk; a write that failed is a
        :class:`CheckpointWarning` (the run goes on: the persistent tier is unaffected)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            (step, err), self._error = self._error, None
            warnings.warn(f"local checkpoint tier: saving step {step} into {self.path(step)} "
                          f"failed ({type(err).__name__}: {err}); the persistent "
                          "checkpoints are unaffected", CheckpointWarning, stacklevel=2)

    def close(self) -> None:
        """Finish the write in flight."""
        self.wait()

    def _remove(self, step: int) -> None:
        folder = self.path(step)
        for suffix in (".json", ".bin", ".json.tmp", ".bin.tmp"):  # .json first: incomplete
            with contextlib.suppress(OSError):
                os.unlink(folder / f"{self.name}{suffix}")
        with contextlib.suppress(OSError):  # other processes' files may remain
            folder.rmdir()

    def _prune(self) -> None:
        for step in self.steps()[:-self.keep]:
            self._remove(step)

    def clear(self) -> None:
        """Remove this process's steps of this run (a fresh start: they are stale)."""
        self.wait()
        for step in self.steps():
            self._remove(step)

    # --- restoring ----------------------------------------------------------------------
    def agree(self, trainer: Any) -> tuple[int | None, str | None]:
        """The newest step every process can restore into ``trainer`` (None: none), and
        why a newer step some process holds is not it (None when there is none).
        Collective."""
        self.wait()  # a save of this process still being written counts once it is on disk
        targets = {k: _as_data(v) for k, v in flat_paths(trainer.state).items()}
        present = self.steps()
        usable = [s for s in present if self._misfit(self._index(s) or {}, targets) is None]
        rows = _gather(np.stack([_padded(present), _padded(usable)]))
        chosen = common_step(rows[:, 1])
        return chosen, why_not(rows[:, 0], rows[:, 1], chosen)

    def restore(self, trainer: Any, step: int) -> dict[str, Any] | None:
        """Load step ``step`` (agreed by :meth:`agree`) into ``trainer.state``; returns the
        step's index (``meta``: the persistent tier's meta, ``config``), or None when some
        process could not read its files (each says why; the state is left as it was).
        Collective."""
        try:
            state, index = self._read(trainer, step), self._index(step)
            failed = None
        except (OSError, ValueError, KeyError, CorruptCheckpoint) as err:
            state, index, failed = None, None, f"{type(err).__name__}: {err}"
        if failed is not None:
            warnings.warn(f"local checkpoint tier: step {step} of process {self.process} is "
                          f"unreadable ({failed})", CheckpointWarning, stacklevel=2)
        if not np.all(_gather(np.array([failed is None], np.int32))):
            return None
        trainer.state = state
        return index

    def _read(self, trainer: Any, step: int) -> Any:
        index = self._index(step)
        if index is None:
            raise CorruptCheckpoint(f"{self.path(step) / self.name}.json is missing")
        data_path = self.path(step) / f"{self.name}.bin"
        if data_path.stat().st_size != index["bytes"]:
            raise CorruptCheckpoint(f"{data_path} holds {data_path.stat().st_size} bytes, "
                                    f"not {index['bytes']}")
        raw = np.memmap(data_path, dtype=np.uint8, mode="r") if index["bytes"] else None
        flat = flat_paths(trainer.state)
        values = {}
        for path, leaf in flat.items():
            target, info = _as_data(leaf), index["leaves"][path]
            where = {tuple(map(tuple, s[0])): (s[1], s[2]) for s in info["shards"]}
            dtype = np.dtype(jnp.dtype(info["dtype"]))
            arrays = []
            for device, i in target.sharding.addressable_devices_indices_map(
                    target.shape).items():
                span = _span(i, target.shape)
                offset, size = where[span]
                shape = tuple(b - a for a, b in span)
                host = np.array(raw[offset:offset + size]).view(dtype).reshape(shape)
                if path == "step" and int(host) != step:
                    raise CorruptCheckpoint(f"{data_path} holds step {int(host)}, not {step}")
                arrays.append(jax.device_put(host, device))
            value = jax.make_array_from_single_device_arrays(target.shape, target.sharding,
                                                             arrays)
            values[path] = (jax.random.wrap_key_data(value, impl=jax.random.key_impl(leaf))
                            if _is_key(leaf) else value)
        treedef = jax.tree_util.tree_structure(trainer.state)
        return jax.tree_util.tree_unflatten(treedef, [values[k] for k in flat])


__all__ = ["LocalTier", "common_step", "local_folder", "why_not"]
