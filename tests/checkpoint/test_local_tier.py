"""The fast checkpoint tier (jaxpar.checkpoint.local_tier) and a run's two tiers
(jaxpar.runs.tiers): a bit-exact save and restore of a sharded state, pruning, a fresh
start, the newer tier restored, a change of layout or a lost folder falling back to the
persistent tier, the grace period of a preemption and the config keys. SIGTERM to one of
4 processes (all stop at one step, save, exit 0; --resume continues exactly from the fast
tier) is rehearsed in tests/runs/test_pod_rehearsal.py."""

import json
import re
import shutil
import signal
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.checkpoint.checkpointer import Checkpointer, CheckpointWarning, flat_paths
from jaxpar.checkpoint.local_tier import LocalTier, common_step, why_not
from jaxpar.config.validate import check_config
from jaxpar.runs.interrupts import StopOnSignal
from jaxpar.runs.tiers import fits, preempt, restore_newest, save_local
from tests.helpers import loader, make_trainer, small_config


@pytest.fixture(scope="module")
def trained():
    """A trainer on fsdp 4 x tensor 2 after one step, and its state on the host."""
    trainer = make_trainer({"fsdp": 4, "tensor": 2})
    trainer.step(loader().batch(0))
    return trainer, {k: np.asarray(v) for k, v in flat_paths(trainer.state).items()}


def at_step(trainer, step: int, state=None) -> SimpleNamespace:
    """What the tiers read of a trainer, its state (default ``trainer``'s) at ``step``."""
    state = dict(state if state is not None else trainer.state)
    state["step"] = jax.device_put(np.int32(step), state["step"].sharding)
    return SimpleNamespace(state=state, step_count=step, plan=trainer.plan,
                           pipeline_schedule=None)


def blank(trainer, sharding=None) -> SimpleNamespace:
    """A target of ``trainer``'s shapes, zeros in its shardings (or all in ``sharding``)."""
    state = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype),
                                                  sharding or x.sharding), trainer.state)
    return at_step(trainer, 0, state)


def test_bit_exact_restore_pruning_and_a_fresh_start(tmp_path, trained):
    trainer, want = trained
    local = LocalTier(tmp_path / "fast" / "{process}", run="A", every=2, keep=2)
    assert local.directory == tmp_path / "fast" / "0"
    assert [local.due(s) for s in range(5)] == [False, False, True, False, True]
    assert local.save(trainer, {"step": 1}, {"seed": 0}) < 5
    local.wait()
    # Each distinct slice once: this one process holds every array whole, once.
    data = local.path(1) / "process_0.bin"
    assert data.stat().st_size == sum(v.nbytes for v in want.values())
    target = blank(trainer)
    assert local.agree(target) == (1, None)
    index = local.restore(target, 1)
    assert index["meta"] == {"step": 1} and index["config"] == {"seed": 0}
    for key, value in flat_paths(target.state).items():
        np.testing.assert_array_equal(np.asarray(value), want[key], err_msg=key)
        assert value.sharding == flat_paths(trainer.state)[key].sharding, key

    for step in (2, 3, 4):  # keep=2: the two newest stay
        local.save(at_step(trainer, step), {"step": step}, {})
    local.wait()
    assert local.steps() == [3, 4] and not local.path(1).exists()
    # Another run's steps in the same folder are neither seen nor removed.
    other = LocalTier(tmp_path / "fast" / "{process}", run="B")
    assert other.steps() == []
    other.clear()
    # A write cut short left a temporary file: the next tier removes it.
    (local.path(4) / "process_0.bin.tmp").write_bytes(b"half")
    LocalTier(tmp_path / "fast" / "{process}", run="A")
    assert not (local.path(4) / "process_0.bin.tmp").exists()
    # A truncated file: the step is unreadable, the state is left as it was.
    (local.path(4) / "process_0.bin").write_bytes(b"x")
    with pytest.warns(CheckpointWarning, match="step 4 of process 0 is unreadable"):
        assert local.restore(target, 4) is None
    assert int(target.state["step"]) == 1
    local.clear()  # a fresh start
    assert local.steps() == []


def test_restore_takes_the_newer_tier_or_falls_back(tmp_path, trained, monkeypatch):
    trainer, _ = trained
    config = small_config()
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", every=0, async_save=False)
    local = LocalTier(tmp_path / "fast", run=str(ckpt.directory))
    # The background write is slow: a restore right after a save still sees its step.
    write = LocalTier._write
    monkeypatch.setattr(LocalTier, "_write", lambda *a: (time.sleep(0.2), write(*a)))
    said: list[str] = []
    ckpt.save(at_step(trainer, 2), config=config, force=True)
    save_local(local, ckpt, at_step(trainer, 3), config)
    got = restore_newest(blank(trainer), ckpt, local, said.append)
    assert (got.step, got.where) == (3, f"local tier step 3 ({tmp_path / 'fast' / '3'})")
    assert got.meta["data"]["position"] == 3
    assert got.config == json.loads(json.dumps(config.to_dict()))
    save_local(local, ckpt, at_step(trainer, 4), config)  # a tie goes to the local tier
    ckpt.save(at_step(trainer, 4), config=config, force=True)
    assert restore_newest(blank(trainer), ckpt, local, said.append).where.startswith("local")
    ckpt.save(at_step(trainer, 5), config=config, force=True)
    got = restore_newest(blank(trainer), ckpt, local, said.append)
    assert (got.step, got.where) == (5, str(ckpt.path(5))) and said == []

    # Another device count: the local tier's slices do not fit; the persistent tier
    # restores, resharded.
    save_local(local, ckpt, at_step(trainer, 6), config)
    four = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",)), P())
    target = blank(trainer, four)
    got = restore_newest(target, ckpt, local, said.append)
    assert got.step == 5 and target.state["params"]["embed"].sharding == four
    assert said == ["local tier step 6 is saved under another layout (process 0 lacks "
                    "slices this run's devices hold): not restoring it"]
    # A host whose local folder is gone restores from the persistent tier.
    shutil.rmtree(local.directory)
    assert restore_newest(blank(trainer), ckpt, local, said.append).step == 5
    ckpt.close()


def test_the_processes_agree_on_a_step_all_of_them_hold():
    rows = lambda *r: np.array([list(x) + [-1] * (4 - len(x)) for x in r])  # noqa: E731
    assert common_step(rows([4, 6], [4, 6])) == 6
    assert common_step(rows([4, 6], [4])) == 4  # process 1 lost step 6 (killed writing it)
    assert common_step(rows([4, 6], [])) is None  # process 1's folder is gone
    assert why_not(rows([4, 6], []), rows([4, 6], []), None) == (
        "local tier step 6 is missing on process 1")
    assert why_not(rows([6], [6], [6]), rows([6], [], []), None) == (
        "local tier step 6 is saved under another layout (processes 1, 2 lack slices "
        "this run's devices hold)")
    assert why_not(rows([4, 6], [4, 6]), rows([4, 6], [4, 6]), 6) is None
    assert why_not(rows(), rows(), None) is None


def test_a_preemption_saves_to_the_tiers_that_fit_the_grace_period(tmp_path, trained):
    trainer, _ = trained
    config = small_config("checkpoint.preempt_grace_s=30")
    assert fits(None, 29, 30) and fits(float("nan"), 29, 30) and fits(1.0, 28.5, 30)
    assert not fits(1.0, 29.5, 30)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", every=0, async_save=False)
    local = LocalTier(tmp_path / "fast", run=str(ckpt.directory))
    stop = StopOnSignal(print)
    stop.signal, stop.since = signal.SIGTERM, time.monotonic()
    said: list[str] = []
    # No persistent save timed yet: both tiers.
    assert preempt(stop, at_step(trainer, 3), ckpt, local, config, said.append) == str(
        ckpt.path(3))
    assert local.steps() == [3] and ckpt.steps() == [3] and ckpt.last_save_s > 0
    assert said[0].startswith("SIGTERM: saved step 3 to the local tier in ")
    # 29.9 s of the 30 gone: the persistent save (timed above) does not fit.
    stop.since, said[:] = time.monotonic() - 29.9, []
    assert preempt(stop, at_step(trainer, 4), ckpt, local, config, said.append) == (
        "local tier")
    assert local.steps() == [3, 4] and ckpt.steps() == [3]
    assert re.fullmatch(r"SIGTERM: not saving step 4 to \S+ too: its last save took \d+\.\d "
                        r"s, 0\.\d s of checkpoint\.preempt_grace_s=30 are left", said[-1])
    # Without a local tier the persistent tier is the only one: it is tried.
    assert preempt(stop, at_step(trainer, 5), ckpt, None, config, said.append) == str(
        ckpt.path(5))
    ckpt.close()


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.local_every=5"], r"^checkpoint.local_every=5: needs checkpoint.local_dir"),
    (["checkpoint.local_dir=gs://b/fast"], r"^checkpoint.local_dir 'gs://b/fast': gs://"),
    (["checkpoint.local_dir=/ssd/{host}"], r"^checkpoint.local_dir='/ssd/\{host\}': \{host\} "
                                           r"is no placeholder: \{process\}"),
    (["checkpoint.local_dir=/ssd", "checkpoint.local_every=-1"], r"local_every=-1: must be 0"),
    (["checkpoint.local_keep=0"], r"^checkpoint.local_keep=0: must be at least 1$"),
    (["checkpoint.preempt_grace_s=0"], r"^checkpoint.preempt_grace_s=0(\.0)?: must be a positive"),
])
def test_bad_tier_keys_are_one_line(overrides, message):
    with pytest.raises(jaxpar.JaxparError, match=message):
        check_config(small_config(*overrides))
    check_config(small_config("checkpoint.local_dir=/ssd/{process}", "checkpoint.local_every=2"))
