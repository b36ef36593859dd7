"""DiLoCo replicas as separate processes that meet through a parameter server, so that
a replica that dies does not stop the others.

``jaxpar launch --replicas N -- train ... diloco.sync_every=H`` starts ``N`` independent
``jaxpar train`` processes (no ``jax.distributed`` job: nothing any process waits for
can hang on a dead peer). Each is one replica: it trains alone on its own data order
(``train.seed + replica``) and, every ``H`` steps, meets the others through a folder
(the launcher's ``meetings/``) in the parameter server's way:

* the replica writes its weights as ``round_K/replica_R.npz`` (written to a temporary
  name, then renamed: a reader never sees half a file) and waits for
  ``round_K/anchor.npz``;
* the server (:class:`ParameterServer`, run by the launcher, which also sees which
  processes have exited) completes round ``K`` as soon as every live member has written:
  the outer gradient is ``anchor - mean(weights)`` over the replicas that wrote, the
  outer optimizer (SGD with Nesterov momentum, as :mod:`jaxpar.training.diloco`) moves
  the anchor, and the new anchor is written for everyone to load;
* a replica that dies is dropped from the members at once, so the others' round
  completes without it. A replica started later (the launcher's ``--restart``) *joins*:
  it writes ``join_R_T.npz`` and gets a ``welcome_R_T.json`` naming the last completed
  round ``K``; it loads that anchor, continues from step ``K H`` (its data position; its
  inner optimizer starts afresh) and is a member from round ``K + 1`` on.

With ``diloco.staleness = tau`` (the parameter server's bounded delay) a round does not
wait for a member that has written round ``K - tau`` or later: it completes with those
present, and a late replica's weights, when they come, join the next round's average as
``the anchor it started from - its weights``, at most ``tau`` rounds late; a replica more
than ``tau`` rounds behind is waited for. ``tau = 0`` waits for every live member.

Round 0 is the start: the first replica to join sets the anchor. The server keeps its
anchor, momentum, round and ``H`` in ``server.npz`` from round 0 on; a resume with
another ``H`` is refused (round ``K`` of ``H`` steps would put the replicas at a step
they never trained to), as is a ``meetings/`` folder with something in it that is not
the server's (a ``round_old`` folder, a ``server.npz`` without the server's keys).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import JaxparError, RunStopped
from jaxpar.training.diloco import outer_sgd

ENV_FOLDER = "JAXPAR_MEETINGS"
ENV_REPLICA = "JAXPAR_REPLICA"
ENV_EVERY = "JAXPAR_MEET_EVERY"
ENV_LAUNCHER = "JAXPAR_LAUNCHER_PID"
"""The launcher's process id: a replica that sees it gone stops instead of waiting."""
SERVER_STATE = "server.npz"
"""The server's anchor, outer momentum and round, written after every completed round."""
START = "__start_round__"
"""The key of a meeting file's start round (the anchor its weights trained from)."""
WAIT_S = 600.0
"""How long a replica waits for the server before giving up."""
CHECK_S = 0.5
"""How often a waiting replica checks that its launcher is alive."""


class UnreadableMeetingFile(JaxparError):
    """A meeting file that is not a whole ``.npz`` (damaged after it was written: every
    write is atomic, and the zip's checksums catch a changed byte)."""


def _atomic(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``: a reader sees the whole file or
    none. A failed write (a full disk) leaves no temporary file and is one line."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise JaxparError(f"meetings: cannot write {path}: {err.strerror or err}; the "
                          "rounds before it are intact") from None


def _write(path: Path, arrays: dict[str, np.ndarray]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    _atomic(path, write)


def _write_json(path: Path, value: Any) -> None:
    _atomic(path, lambda tmp: tmp.write_text(json.dumps(value)))


def _read(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise UnreadableMeetingFile(f"{path} is unreadable ({type(err).__name__}: "
                                    f"{' '.join(str(err).split())})") from None


_ROUND = re.compile(r"round_(\d+)")


def round_of(path: Path) -> int | None:
    """The round of a meeting folder ``round_K``; None for any other name (a stray the
    server leaves alone)."""
    found = _ROUND.fullmatch(path.name)
    return int(found.group(1)) if found else None


def _replica_of(path: Path) -> int | None:
    found = re.fullmatch(r"replica_(\d+)", path.stem)
    return int(found.group(1)) if found else None


def _meeting_files(folder: Path) -> list[Path]:
    """The replicas' meeting files ``round_K/replica_R.npz`` (strays left out)."""
    return sorted(f for f in folder.glob("round_*/replica_*.npz")
                  if round_of(f.parent) is not None and _replica_of(f) is not None)


def read_state(folder: str | Path) -> dict[str, Any]:
    """The server's saved state (:data:`SERVER_STATE` in ``folder``): ``round``,
    ``sync_every`` (None in files from before it was kept), ``anchor`` and ``momentum``.

    Raises:
      JaxparError: in one line naming the file and what to do, when it is unreadable or
        not the server's (a key missing).
    """
    path = Path(folder) / SERVER_STATE
    fresh = ("start a new replica run with another --out (this one is kept)")
    try:
        saved = _read(path)
    except UnreadableMeetingFile as err:
        raise JaxparError(f"launch --resume: {err}: {fresh}") from None
    anchor = {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith("anchor/")}
    momentum = {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith("momentum/")}
    if "round" not in saved or not anchor or set(anchor) != set(momentum):
        missing = "'round'" if "round" not in saved else "matching anchor/ and momentum/"
        raise JaxparError(f"launch --resume: {path} is not the parameter server's state "
                          f"(no {missing} in it): put back the launcher's {SERVER_STATE}, "
                          f"or {fresh}")
    every = saved.get("sync_every")
    return {"round": int(saved["round"]), "anchor": anchor, "momentum": momentum,
            "sync_every": int(every) if every is not None else None}


def check_resumable(folder: str | Path, sync_every: int) -> dict[str, Any]:
    """The server state a replica run in ``folder`` resumes from (:func:`read_state`),
    refused in one line when ``folder`` holds a stray ``round_*`` (its round could not
    be told) or the run met every other number of steps than ``sync_every``."""
    folder = Path(folder)
    for path in sorted(folder.glob("round_*")):
        if round_of(path) is None or not path.is_dir():
            raise JaxparError(f"launch --resume: {path} is not a meeting's folder "
                              f"(round_<number>): move it out of {folder} and resume again")
    state = read_state(folder)
    saved = state["sync_every"]
    if saved is not None and saved != sync_every:
        raise JaxparError(
            f"launch --resume: the replica run met every {saved} steps (round "
            f"{state['round']} is step {state['round'] * saved}), diloco.sync_every="
            f"{sync_every} would put the replicas at step {state['round'] * sync_every}: "
            f"resume with diloco.sync_every={saved}")
    return state


def _names(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


LAUNCHER_GONE_STATUS = 3
"""Exit status of a replica that stopped because its launcher died."""


class LauncherGone(RunStopped):
    """The launcher (and with it the parameter server) died while a replica waited."""


class _Tolerant:
    """A text stream that drops what it cannot write once its reader (the launcher's
    pipe) is gone, so a replica whose launcher died still reaches its next meeting, sees
    the launcher gone and saves, instead of dying on its next log line."""

    def __init__(self, stream: Any):
        self._stream, self._broken = stream, False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ValueError):
                self._broken = True
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except (BrokenPipeError, ValueError):
                self._broken = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class ReplicaClient:
    """The replica's side: :meth:`join` at the start, :meth:`meet` every ``H`` steps.

    ``launcher``: the launcher's process id; while waiting, a replica checks it every
    :data:`CHECK_S` seconds and stops (:class:`LauncherGone`) when it is gone, instead of
    waiting :data:`WAIT_S` for a server that will never answer."""

    def __init__(self, folder: str | Path, replica: int, sync_every: int,
                 launcher: int | None = None):
        self.folder, self.replica, self.sync_every = Path(folder), replica, sync_every
        self.launcher = launcher
        self.start = 0  # the round whose anchor this replica's weights started from

    @classmethod
    def from_env(cls) -> ReplicaClient | None:
        """The client the launcher asked for through the environment, or None."""
        folder = os.environ.get(ENV_FOLDER)
        if not folder:
            return None
        launcher = os.environ.get(ENV_LAUNCHER)
        if launcher and not isinstance(sys.stdout, _Tolerant):
            sys.stdout, sys.stderr = _Tolerant(sys.stdout), _Tolerant(sys.stderr)
        return cls(folder, int(os.environ[ENV_REPLICA]), int(os.environ[ENV_EVERY]),
                   int(launcher) if launcher else None)

    # --- weights in and out of the trainer ----------------------------------------------------
    @staticmethod
    def _key(trainer: Any) -> str:
        return trainer.master_key

    def weights(self, trainer: Any) -> dict[str, np.ndarray]:
        """The trainer's (master) weights as float32 arrays by path."""
        tree = trainer.state[self._key(trainer)]
        return {n: np.asarray(jax.device_get(x), np.float32)
                for n, x in zip(_names(tree), jax.tree.leaves(tree), strict=True)}

    def load(self, trainer: Any, arrays: dict[str, np.ndarray], step: int | None = None
             ) -> None:
        """Set the trainer's weights (and, with ``step``, its step count) to these."""
        key = self._key(trainer)
        tree = trainer.state[key]
        leaves = [jnp.asarray(arrays[n], x.dtype)
                  for n, x in zip(_names(tree), jax.tree.leaves(tree), strict=True)]
        state = dict(trainer.state)
        state[key] = jax.device_put(jax.tree.unflatten(jax.tree.structure(tree), leaves),
                                    trainer.state_shardings[key])
        if key == "master":
            state["params"] = jax.device_put(trainer.policy.cast_to_compute(state["master"]),
                                             trainer.state_shardings["params"])
        if step is not None:
            state["step"] = jax.device_put(jnp.asarray(step, state["step"].dtype),
                                           trainer.state_shardings["step"])
        trainer.state = state

    def _wait(self, path: Path, what: str) -> None:
        now = time.monotonic()
        deadline, check = now + WAIT_S, now + CHECK_S
        while not path.exists():
            now = time.monotonic()
            if now > deadline:
                raise JaxparError(f"replica {self.replica}: no {what} from the parameter "
                                  f"server in {WAIT_S:.0f} s ({path} missing)")
            if self.launcher is not None and now > check:
                check = now + CHECK_S
                if not _alive(self.launcher):
                    raise LauncherGone(
                        f"replica {self.replica}: the launcher (pid {self.launcher}) is gone, "
                        f"so no {what} will come; stopping", LAUNCHER_GONE_STATUS)
            time.sleep(0.02)

    # --- the protocol -------------------------------------------------------------------------
    def join(self, trainer: Any) -> int:
        """Send this replica's weights, load the anchor of the last completed round and
        set the step count to where that round left the run; returns that step."""
        token = uuid.uuid4().hex[:8]
        self.folder.mkdir(parents=True, exist_ok=True)
        _write(self.folder / f"join_{self.replica}_{token}.npz", self.weights(trainer))
        welcome = self.folder / f"welcome_{self.replica}_{token}.json"
        self._wait(welcome, "welcome")
        k = json.loads(welcome.read_text())["round"]
        step = k * self.sync_every
        self.load(trainer, _read(self.folder / f"round_{k}" / "anchor.npz"), step)
        self.start = k
        return step

    def due(self, step: int) -> bool:
        """Whether a meeting follows step ``step``."""
        return step > 0 and step % self.sync_every == 0

    def meet(self, trainer: Any, step: int) -> None:
        """Send the weights after ``step``, wait for the new anchor, load it."""
        k = step // self.sync_every
        folder = self.folder / f"round_{k}"
        folder.mkdir(parents=True, exist_ok=True)
        _write(folder / f"replica_{self.replica}.npz",
               {**self.weights(trainer), START: np.asarray(self.start)})
        anchor = folder / "anchor.npz"
        self._wait(anchor, f"anchor of round {k}")
        self.load(trainer, _read(anchor))
        self.start = k


class ParameterServer:
    """The launcher's side: answers joins and completes rounds (see the module
    docstring). :meth:`poll` does what is due and returns lines to print."""

    def __init__(self, folder: str | Path, *, outer_lr: float, outer_momentum: float,
                 nesterov: bool, staleness: int = 0, sync_every: int | None = None):
        self.folder = Path(folder)
        self.sync_every = sync_every  # kept in server.npz: a resume must meet as often
        self.tau = staleness
        self.written: dict[int, int] = {}  # replica -> the last round it wrote (or joined)
        self._used: set[Path] = set()  # meeting files already averaged
        self.folder.mkdir(parents=True, exist_ok=True)
        self.lr, self.mu, self.nesterov = outer_lr, outer_momentum, nesterov
        self.anchor: dict[str, np.ndarray] | None = None
        self.momentum: dict[str, np.ndarray] = {}
        self.round = 0  # the last completed round
        self.members: set[int] = set()
        self.joined: set[int] = set()
        self.joining: dict[int, int] = {}  # replica -> round it becomes a member after
        self._answered: set[str] = set()

    def restore(self) -> int:
        """Continue from :data:`SERVER_STATE` (the anchor, momentum and round saved after
        every completed round): files of rounds after it (a round cut short) are removed,
        earlier joins and meeting files count as answered and averaged. Returns the round.

        Raises:
          JaxparError: in one line (:func:`check_resumable`), when the saved state cannot
            be read, is not the server's, was saved with another ``sync_every``, or a
            stray ``round_*`` is in the folder.
        """
        saved = check_resumable(self.folder, self.sync_every) if (
            self.sync_every is not None) else read_state(self.folder)
        self.round, self.anchor, self.momentum = (saved["round"], saved["anchor"],
                                                  saved["momentum"])
        for folder in self.folder.glob("round_*"):
            if (round_of(folder) or 0) > self.round:
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
        for path in [*self.folder.glob("join_*.npz"), *self.folder.glob("welcome_*.json")]:
            path.unlink()
        self._used = set(_meeting_files(self.folder))
        return self.round

    def drop(self, replica: int) -> list[str]:
        """Replica ``replica``'s process died: the round in progress goes on without it
        (a process started in its place joins afresh)."""
        if replica not in self.members and replica not in self.joining:
            return []
        self.members.discard(replica)
        self.joining.pop(replica, None)
        return [f"replica {replica} is gone; round {self.round + 1} goes on with "
                f"{sorted(self.members) or 'none'}"]

    def poll(self, alive: set[int], finished: set[int] = frozenset()) -> list[str]:
        """Drop members not ``alive`` (quietly those ``finished``), answer joins, complete
        the next round if every live member has written to it; returns what happened,
        one line each."""
        said = []
        for r in sorted(self.members - alive - set(finished)):
            said.append(f"replica {r} is gone; round {self.round + 1} goes on with "
                        f"{sorted(self.members & alive) or 'none'}")
        self.members &= alive
        self.joining = {r: k for r, k in self.joining.items() if r in alive}
        for path in sorted(self.folder.glob("join_*.npz")):
            if path.name in self._answered:
                continue
            parts = path.stem.split("_")
            if len(parts) != 3 or not parts[1].isdigit():
                continue  # not a replica's (a stray): left alone
            _, r, token = parts
            try:
                weights = _read(path)
            except UnreadableMeetingFile as err:
                self._answered.add(path.name)
                if self.anchor is None:  # nothing to start it from: it times out
                    said.append(f"replica {r} cannot join: {err}")
                    continue
                said.append(f"replica {r}'s join file: {err}; it joins from the anchor")
                weights = self.anchor
            if self.anchor is None:
                self.anchor = weights
                self.momentum = {k: np.zeros_like(v) for k, v in weights.items()}
                (self.folder / "round_0").mkdir(exist_ok=True)
                _write(self.folder / "round_0" / "anchor.npz", self.anchor)
                self._save()
            self.joining[int(r)] = self.round
            self.joined.add(int(r))
            self.written[int(r)] = self.round
            _write_json(self.folder / f"welcome_{r}_{token}.json", {"round": self.round})
            self._answered.add(path.name)
            if self.round:
                said.append(f"replica {r} rejoined: it loads round {self.round}'s anchor "
                            f"and meets from round {self.round + 1}")
        for r, k in list(self.joining.items()):
            if k <= self.round:
                self.members.add(r)
                del self.joining[r]
        said += self._complete(alive)
        return said

    def _complete(self, alive: set[int]) -> list[str]:
        """Complete round ``K = round + 1`` once every live member has written to it, or,
        with staleness ``tau``, once one has and every other has written round ``K - tau``
        or later; contributions that arrive after their round completed join the next
        one (each as ``its start anchor - weights``)."""
        k = self.round + 1
        folder = self.folder / f"round_{k}"
        expected = sorted(self.members & alive)
        if not expected or self.anchor is None or (k == 1 and alive - self.joined):
            return []  # (the first round waits for every replica started to join)
        files = _meeting_files(self.folder)
        for f in files:
            r, j = _replica_of(f), round_of(f.parent)
            self.written[r] = max(self.written.get(r, 0), j)
        fresh = [r for r in expected if (folder / f"replica_{r}.npz").exists()]
        if not fresh or any(self.written.get(r, 0) < k - self.tau
                            for r in expected if r not in fresh):
            return []
        late = [f for f in files if f not in self._used
                and round_of(f.parent) < k]
        used = [folder / f"replica_{r}.npz" for r in fresh] + late
        deltas, said = [], []
        for f in used:
            try:
                deltas.append(self._delta(f))
            except UnreadableMeetingFile as err:  # left out of the mean, in one line
                said.append(f"round {k}: {err}; left out")
        self._used.update(used)
        if deltas:  # (with none readable the anchor stays as it was)
            for name, a in self.anchor.items():
                g = np.mean([d[name] for d in deltas], axis=0)
                self.anchor[name], self.momentum[name] = outer_sgd(
                    a, self.momentum[name], g, self.lr, self.mu, self.nesterov)
        _write(folder / "anchor.npz", self.anchor)
        self.round = k
        self._save()
        stale = sorted(_replica_of(f) for f in late)
        return said + [f"round {k}: replicas {fresh} met"
                       + (f" (late from earlier rounds: {stale})" if stale else "")]

    def _save(self) -> None:
        """Keep the round, H, anchor and momentum in :data:`SERVER_STATE` (from round 0,
        so that replicas stopped before their first meeting can resume too)."""
        every = {} if self.sync_every is None else {"sync_every": np.asarray(self.sync_every)}
        _write(self.folder / SERVER_STATE, {
            "round": np.asarray(self.round), **every,
            **{f"anchor/{n}": v for n, v in self.anchor.items()},
            **{f"momentum/{n}": v for n, v in self.momentum.items()}})

    def _delta(self, path: Path) -> dict[str, np.ndarray]:
        """A meeting file's outer gradient: its start anchor minus its weights."""
        weights = _read(path)
        start = int(weights.pop(START, round_of(path.parent) - 1))
        anchor = (self.anchor if start == self.round
                  else _read(self.folder / f"round_{start}" / "anchor.npz"))
        return {n: anchor[n] - weights[n] for n in self.anchor}
