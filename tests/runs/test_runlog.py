"""What a run writes about itself (jaxpar.runs.runlog): which steps are logged, the figures
added to each step's metrics, ``metrics.jsonl`` rows (fresh, resumed, trimmed) and a write
that fails."""

import json
import math
from pathlib import Path

import pytest

from jaxpar.errors import JaxparError
from jaxpar.runs.runlog import RunLog, trim_metrics
from tests.helpers import BATCH, SEQ, small_config

STEPS, LR, WARMUP = 10, 0.01, 2


def config(*overrides: str):
    return small_config(f"train.steps={STEPS}", f"train.lr={LR}",
                        f"train.warmup_steps={WARMUP}", *overrides)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def logged(log: RunLog, steps: int) -> list[int]:
    return [s for s in range(1, steps + 1) if log.due(s, last=s == steps)]


def test_due_logs_the_first_every_nth_after_it_and_the_last():
    assert logged(RunLog(config("train.log_every=4"), None), STEPS) == [1, 5, 9, 10]
    assert logged(RunLog(config("train.log_every=3"), None), 7) == [1, 4, 7]
    assert logged(RunLog(config("train.log_every=1"), None), STEPS) == list(range(1, 11))
    assert logged(RunLog(config("train.log_every=100"), None), STEPS) == [1, 10]


def test_an_evaluated_step_is_always_logged():
    log = RunLog(config("train.log_every=4"), None)
    assert log.due(6, last=False, metrics={"step": 6, "eval_loss": 2.5})
    assert not log.due(6, last=False, metrics={"step": 6, "loss": 2.5})
    assert not log.due(6, last=False)


def _schedule(step: int) -> float:
    """The learning rate a step is taken with, by hand: linear warmup from 0 over WARMUP
    steps, then a cosine from LR down to LR / 10 at step STEPS (``step`` 1-based; a step
    uses the rate of the count of steps before it)."""
    k = step - 1
    if k < WARMUP:
        return LR * k / WARMUP
    end = LR / 10
    return end + (LR - end) * 0.5 * (1 + math.cos(math.pi * (k - WARMUP) / (STEPS - WARMUP)))


def test_enrich_adds_time_throughput_and_learning_rate():
    log = RunLog(config(), None)
    for step in (1, 2, 3, 7, 10):
        metrics = log.enrich({"step": step, "loss": 3.0}, step_time_s=0.5)
        assert metrics["loss"] == 3.0 and metrics["step_time_s"] == 0.5
        assert metrics["tokens_per_s"] == BATCH * SEQ / 0.5
        assert metrics["lr"] == pytest.approx(_schedule(step), rel=1e-5, abs=1e-9), step
    assert log.enrich({"step": 1}, 1.0)["lr"] == 0.0
    assert log.enrich({"step": 3}, 1.0)["lr"] == pytest.approx(LR)


def test_a_fresh_run_starts_metrics_anew_and_writes_what_is_given(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    log = RunLog(config(), tmp_path)
    assert path.read_text() == ""  # an earlier run's rows are gone
    log.write({"step": 1, "loss": 2.5, "grad_norm": float("nan"), "lr": float("inf"),
               "tokens": 7})
    log.write({"step": 2, "loss": 2.25})
    log.close()
    log.close()  # closing twice is harmless
    # Non-finite figures are stored as text: JSON has no NaN.
    assert path.read_text().splitlines() == [
        '{"step": 1, "loss": 2.5, "grad_norm": "nan", "lr": "inf", "tokens": 7}',
        '{"step": 2, "loss": 2.25}']
    assert (tmp_path / "tensorboard").is_dir()


def test_a_resumed_run_drops_the_rows_it_will_train_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n"
                            for s in range(1, 7)))
    log = RunLog(config(), tmp_path, resumed_at=3)
    log.write({"step": 4, "loss": 0.5})
    log.close()
    assert [(r["step"], r["loss"]) for r in rows(path)] == [(1, 9.0), (2, 8.0), (3, 7.0),
                                                            (4, 0.5)]


def test_only_the_writer_writes(tmp_path):
    log = RunLog(config(), tmp_path, writer=False)
    log.write({"step": 1, "loss": 1.0})
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_trim_metrics_keeps_rows_up_to_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2, "loss": 1.5}\n{"note": "no step"}\n'
                    '{"step": 3}\n{"step": 4}\n{"step": 5, "lo')  # the last cut short by a kill
    trim_metrics(path, 3)
    assert path.read_text() == ('{"step": 1}\n{"step": 2, "loss": 1.5}\n{"note": "no step"}\n'
                                '{"step": 3}\n')
    trim_metrics(path, 0)
    assert path.read_text() == '{"note": "no step"}\n'
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    trim_metrics(tmp_path / "absent.jsonl", 3)  # nothing to trim: nothing written
    assert not (tmp_path / "absent.jsonl").exists()


def test_a_failed_write_is_one_error_naming_the_file(tmp_path):
    full = Path("/dev/full")  # every write to it fails with ENOSPC
    if not full.exists():
        pytest.skip("no /dev/full here")
    (tmp_path / "metrics.jsonl").symlink_to(full)
    log = RunLog(config(), tmp_path)
    try:
        with pytest.raises(JaxparError, match=r"^writing .*metrics\.jsonl failed: no space "
                                              r"left on device \(.* free there\)$"):
            log.write({"step": 1, "loss": 1.0})
    finally:
        log.close()
