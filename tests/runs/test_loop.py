"""The run loop: what it writes (metrics.jsonl, TensorBoard events read back with
tensorboard's own reader, a profiler trace) and the non-finite-loss guard (a NaN injected
into the weights mid-run stops the run before that step is saved; the last good
checkpoint resumes to the same losses as a run that never diverged)."""

import json
import math

import jax
import jax.numpy as jnp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxpar
from jaxpar.checkpoint.checkpointer import Checkpointer
from jaxpar.runs.loop import NonFiniteLoss, check_run_folder, train
from jaxpar.training.trainer import Trainer
from tests.helpers import small_config

STEPS = 10


def config():
    return small_config(f"train.steps={STEPS}", "checkpoint.every=4", "train.eval_every=5",
                        "train.eval_batches=1", "data.max_bytes=200000",
                        "train.profile_steps=[2, 3]")


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its folder and metrics by step."""
    out = tmp_path_factory.mktemp("reference")
    _, history = train(config(), out, progress=False)
    return out, {m["step"]: m for m in history}


def test_tensorboard_scalars_match_metrics(reference):
    out, history = reference
    logged = rows(out)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s",
            "perf/step_time_s", "eval/loss"} <= tags
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert [e.value for e in loss] == pytest.approx([history[s]["loss"] for s in
                                                     range(1, STEPS + 1)], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/loss")] == [5, 10]
    lr = [e.value for e in events.Scalars("train/lr")]
    assert lr[0] == 0.0 and max(lr) == pytest.approx(3e-3, rel=1e-5)  # warmup, then decay
    # CPU devices report neither a peak FLOP/s nor memory: no made-up MFU or memory.
    assert "perf/mfu" not in tags and "memory/bytes_in_use" not in tags


def test_profile_steps_write_a_trace(reference):
    out, _ = reference
    assert list((out / "profile").rglob("*.xplane.pb")), "no jax.profiler trace written"


def test_profile_steps_need_a_run_folder():
    with pytest.raises(jaxpar.JaxparError, match=r"train.profile_steps=\[2, 3\] needs --out"):
        check_run_folder(None, config=config())


def test_nan_stops_the_run_and_the_last_good_checkpoint_resumes(tmp_path, monkeypatch,
                                                                reference):
    out = tmp_path / "run"
    real_step = Trainer.step_async

    def poisoned(self, batch):
        if self.step_count == 6:  # step 7 sees NaN weights: its loss is NaN for real
            self.state["params"] = jax.tree.map(lambda x: x * jnp.nan, self.state["params"])
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "step_async", poisoned)
    with pytest.raises(NonFiniteLoss) as err:
        train(config(), out, progress=False)
    message = str(err.value)
    assert "the loss is nan at step 7; stopped without saving that step" in message
    assert "the last good checkpoint is step 4" in message and "--resume" in message
    with Checkpointer(out / "checkpoints") as ckpt:
        assert ckpt.steps() == [4]  # nothing after the divergence was saved
    assert all(math.isfinite(r["loss"]) for r in rows(out))

    monkeypatch.setattr(Trainer, "step_async", real_step)
    _, history = train(config(), out, resume=True, progress=False)
    assert [m["step"] for m in history] == list(range(5, STEPS + 1))
    logged = rows(out)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))  # none lost or repeated
    expected = reference[1]
    assert {r["step"]: r["loss"] for r in logged} == {s: expected[s]["loss"]
                                                      for s in range(1, STEPS + 1)}


def test_metrics_are_fetched_only_when_the_loop_must_look(tmp_path, monkeypatch, reference):
    """log_every=4, a checkpoint every 6, no evaluation: the loop waits for the devices at
    steps 1, 5, 9 (logged), 6 (saved) and 10 (last) only, yet every step's row is in the
    history with the losses of the run that fetched every step."""
    from jaxpar.runs import loop as run

    fetched = []
    real_fetch = run._Window.fetch

    def spy(self, last_step):
        fetched.append((last_step, len(self.pending)))
        return real_fetch(self, last_step)

    monkeypatch.setattr(run._Window, "fetch", spy)
    cfg = small_config(f"train.steps={STEPS}", "train.log_every=4", "checkpoint.every=6",
                       "train.eval_every=0", "data.max_bytes=200000")
    _, history = train(cfg, tmp_path / "run", progress=False)
    assert fetched == [(1, 1), (5, 4), (6, 1), (9, 3), (10, 1)]
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    expected = reference[1]
    assert [m["loss"] for m in history] == [expected[s]["loss"] for s in range(1, STEPS + 1)]
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 5, 9, 10]
    window = [m["step_time_s"] for m in history[1:5]]
    assert len(set(window)) == 1  # one wall-clock interval shared by its steps
