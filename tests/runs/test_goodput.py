"""Goodput: a run's wall time cut into productive steps, startup, compile, checkpoints, data
wait, evaluation, steps trained again and the rest, per session of its run folder.

One run of two sessions serves the tests: ``jaxpar train`` to step 4 (a checkpoint every 2
steps) crashes once step 3 is logged, and ``--resume`` continues from checkpoint 2, so step
3 is trained twice. Figures are checked for consistency only (they add up, they cover the
session's time), never against a speed.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.runs import goodput
from jaxpar.runs.runlog import RunLog
from tests.storage.test_remote import BUCKET, s3  # noqa: F401 (a local S3 server)

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["train", "--config", str(ROOT / "configs/tiny.yaml"), "--devices", "8",
         "model.d_model=32", "model.n_layers=1", "model.d_ff=64", "train.seq_len=16",
         "train.global_batch=8", "data.max_bytes=100000", "train.steps=4",
         "checkpoint.every=2", "train.eval_every=0"]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run folder, each session's time measured around it, and the second session's
    stdout."""
    out = tmp_path_factory.mktemp("goodput") / "run"
    real = RunLog.write

    def crash(self, metrics):  # the machine is lost once step 3 is logged, before a save
        real(self, metrics)
        if metrics["step"] == 3:
            raise RuntimeError("machine lost")

    took = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunLog, "write", crash)
        began = time.time()
        with pytest.raises(RuntimeError, match="machine lost"):
            main([*TRAIN, "--out", str(out)])
        took.append(time.time() - began)
    printed = io.StringIO()
    began = time.time()
    with contextlib.redirect_stdout(printed):
        assert main([*TRAIN, "--out", str(out), "--resume"]) == 0
    took.append(time.time() - began)
    return out, took, printed.getvalue()


def test_the_parts_add_up_to_each_sessions_wall_time(run):
    out, took, _ = run
    records = goodput.read_records(out)
    assert [r["session"] for r in records] == [1, 2]
    for record, seconds in zip(records, took, strict=True):
        parts = [record[f"{p}_s"] for p in goodput.PARTS]
        assert min(parts) >= 0
        assert sum(parts) == pytest.approx(record["wall_s"], abs=2e-3)
        # the session is the train() call (not this test process): all of it, nothing else
        assert seconds - 1.0 < record["wall_s"] <= seconds
        assert record["end"] - record["start"] == pytest.approx(record["wall_s"], abs=2e-3)
        assert record["counted_from"] == "call"  # in-process: not from the process start
        assert record["startup_s"] > 0 and record["productive_s"] > 0
    assert records[0]["compile_s"] > 0  # the first session compiled the step
    assert records[1]["start"] >= records[0]["end"]


def test_a_resume_counts_the_steps_trained_again(run):
    out, _, _ = run
    first, second = goodput.read_records(out)
    assert (first["state"], first["first_step"], first["step"]) == (
        "failed (RuntimeError)", 0, 3)
    assert first["recomputed_steps"] == 0 and first["recomputed_s"] == 0
    assert (second["state"], second["first_step"], second["step"]) == ("ended", 2, 4)
    assert second["recomputed_steps"] == 1 and second["recomputed_s"] > 0
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]  # step 3 once, from the resume
    last = logged[-1]
    assert set(goodput.ROW_KEYS) <= set(last)
    assert 0 < last["goodput"] < 1
    assert last["badput_recomputed_s"] == pytest.approx(second["recomputed_s"], abs=2e-3)
    # the row is the run so far: both sessions, up to the last step's save
    total = goodput.run_figures([first, second])
    assert last["goodput_wall_s"] <= total["goodput_wall_s"] + 1e-3
    assert last["goodput_wall_s"] > first["wall_s"]


def test_goodput_reaches_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _ = run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"goodput/fraction", "goodput/wall_s", "goodput/productive_s",
            "badput/compile_s", "badput/recomputed_s", "badput/startup_s"} <= tags
    assert "train/goodput" not in tags
    steps = [e.step for e in events.Scalars("badput/recomputed_s")]
    assert 4 in steps


def test_the_summary_line_says_goodput_and_the_biggest_loss(run):
    out, _, printed = run
    done = [line for line in printed.splitlines() if line.startswith("done:")]
    total = goodput.run_figures(goodput.read_records(out))
    assert len(done) == 1 and f"goodput {total['goodput']:.0%} of " in done[0]
    biggest = max(goodput.LOST, key=lambda p: total[goodput.row_key(p)])
    assert f"most lost to {biggest.replace('_', ' ')} (" in done[0]


def test_jaxpar_goodput_prints_every_session_and_the_total(run, capsys):
    out, _, _ = run
    assert main(["goodput", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"run {out}: 2 sessions, steps 1-4, 1 step trained again"
    header = lines[2].split()
    assert header[:4] == ["session", "steps", "wall", "productive"]
    assert header[-2:] == ["goodput", "end"]
    table = {line.split()[0]: line.split() for line in lines[4:8]}
    assert table["1"][1] == "1-3" and table["1"][-2:] == ["failed", "(RuntimeError)"]
    assert table["2"][1] == "3-4" and table["2"][-1] == "ended"
    total = goodput.run_figures(goodput.read_records(out))
    assert table["total"][-1] == f"{total['goodput']:.1%}"
    assert table["share"][1] == "100%"
    assert any(line.startswith("between the sessions (not counted above): ")
               for line in lines)
    assert any(line.startswith("most lost to ") for line in lines)
    assert main(["goodput", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["session"] for s in data["sessions"]] == [1, 2]
    assert data["total"] == total


def test_jaxpar_goodput_reads_a_run_folder_in_a_bucket(run, s3, capsys):  # noqa: F811
    out, _, _ = run
    s3.put_file(str(out / goodput.RECORDS), f"{BUCKET}/runs/gp/{goodput.RECORDS}")
    assert main(["goodput", f"s3://{BUCKET}/runs/gp"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"run s3://{BUCKET}/runs/gp: 2 sessions, steps 1-4, 1 step trained again"
    assert main(["goodput", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == printed[1:]  # the same table
    for url, message in [(f"s3://{BUCKET}/runs/none", "no such folder"),
                         (f"s3://{BUCKET}/runs", "holds no goodput.jsonl"),
                         ("s3://no-such-bucket-here/run", "bucket 'no-such-bucket-here' does "
                                                          "not exist")]:
        assert main(["goodput", url]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"jaxpar: error: RUN '{url}'")
        assert message in err[0]


@pytest.mark.parametrize("setup, message", [
    (None, "RUN '{run}': no such folder"),
    ("folder", "RUN '{run}' holds no goodput.jsonl: it is not the --out of jaxpar train"),
    ("empty", "{run}/goodput.jsonl holds no session record"),
])
def test_a_bad_run_is_one_line_and_exit_status_2(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    if setup:
        run.mkdir()
    if setup == "empty":
        (run / "goodput.jsonl").write_text('{"cut sh\n')
    assert main(["goodput", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxpar: error: " + message.format(run=run))


def test_nested_compile_events_count_once():
    """A trace inside another, a cache read inside a backend compile: the time they cover,
    once; a span still open at a mark is counted at the next one."""
    spans = goodput._CompileTime()
    spans._spans = [(1.0, 4.0), (2.0, 3.0), (3.5, 5.0), (9.0, 12.0)]
    assert spans.within(0.0, 10.0) == pytest.approx(5.0)  # 1-5, and 9-10
    assert spans.within(10.0, 20.0) == pytest.approx(2.0)  # the rest of 9-12
    assert spans.within(20.0, 30.0) == 0.0


def test_the_clock_charges_each_interval_to_its_part(tmp_path):
    """Marks in a made-up session: startup, a window of two steps (one an earlier session
    reached), a save, the closing; the record adds up and the rows get the run's figures."""
    out = tmp_path / "run"
    out.mkdir()
    (out / goodput.RECORDS).write_text(json.dumps(
        {"session": 1, "step": 3, "wall_s": 10.0, "productive_s": 10.0}) + "\n")
    with goodput.GoodputClock(out, (time.time() - 1.0, "call"), resume=True) as clock:
        assert clock.session == 2 and clock.reached == 3
        clock.loop_started(2)
        time.sleep(0.02)
        clock.steps([{"step": 3, "data_wait_s": 0.0}, {"step": 4, "data_wait_s": 0.01}])
        row = {"step": 4}
        clock.acted(row, saved=True)
        clock.closing()
    first, second = goodput.read_records(out)
    assert first == {"session": 1, "step": 3, "wall_s": 10.0, "productive_s": 10.0}
    assert second["state"] == "ended" and second["recomputed_steps"] == 1
    assert second["startup_s"] >= 1.0 and second["data_wait_s"] == pytest.approx(0.01)
    assert second["recomputed_s"] == pytest.approx(second["productive_s"], rel=1e-3)
    assert sum(second[f"{p}_s"] for p in goodput.PARTS) == pytest.approx(
        second["wall_s"], abs=1e-3)
    assert row["goodput_wall_s"] > 11.0 and row["goodput_productive_s"] > 10.0
