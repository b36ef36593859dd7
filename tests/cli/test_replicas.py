"""``jaxpar launch --replicas``: three real replica processes, one killed with SIGKILL
mid-run; the others finish without waiting for it and a restarted one rejoins."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from jaxpar.cli import main

TRAIN = ["train", "--config", "configs/tiny.yaml", "model.d_model=32", "model.n_layers=1",
         "model.d_ff=64", "train.seq_len=16", "train.global_batch=8", "train.steps=1200",
         "data.max_bytes=200000", "diloco.sync_every=40", "checkpoint.every=0"]


def _rows(folder) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_killed_replica_is_dropped_then_rejoins(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxpar.cli", "launch", "--replicas", "3",
         "--devices-per-process", "1", "--restart", "1", "--", *TRAIN, "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "meetings" / "round_2" / "anchor.npz").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.05)
        pid = json.loads((out / "replicas.json").read_text())["2"]["pid"]
        os.kill(pid, signal.SIGKILL)
        text, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text
    assert "jaxpar launch: replica 2 exited with status 137; restarting it" in text
    gone = [line for line in text.splitlines() if "replica 2 is gone; round" in line]
    assert len(gone) == 1 and gone[0].endswith("goes on with [0, 1]")
    k = int(gone[0].split("round ")[1].split()[0])
    assert f"round {k}: replicas [0, 1] met" in text
    assert "jaxpar launch: replica 2 rejoined: it loads round" in text
    assert "3 of 3 replicas trained to the end after 30 meetings" in text
    for r in (0, 1):
        assert [row["step"] for row in _rows(out / f"replica_{r}")] == list(range(1, 1201))
    again = _rows(out / "replica_2.1")
    assert again[-1]["step"] == 1200 and again[0]["step"] > 80  # it joined later, from an anchor
    final = [float(line.split("final loss ")[1].split(",")[0]) for line in text.splitlines()
             if "done: " in line and "final loss" in line]
    assert len(final) == 3 and max(final) < 5.0  # ln(256) = 5.5 at the start
    assert (out / "meetings" / "round_30" / "anchor.npz").exists()


def test_replica_runs_it_cannot_start_get_one_line(tmp_path, capsys):
    base = ["launch", "--replicas", "2", "--", "train", "--config", "configs/tiny.yaml",
            "--out", str(tmp_path / "r")]
    for extra, message in (
            ([], "jaxpar launch --replicas needs diloco.sync_every >= 1"),
            (["diloco.sync_every=5", "--resume"], "replicas rejoin from the parameter "
                                                   "server's anchor; drop --resume"),
            (["diloco.sync_every=5", "diloco.overlap=true", "diloco.fragments=5"],
             "diloco.fragments=5, diloco.overlap=True: jaxpar launch --replicas meets whole")):
        assert main([*base, *extra]) == 2  # refused before any replica starts
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "r").exists()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_replicas_stop_and_save_when_their_launcher_dies(tmp_path):
    """kill -9 of the launcher: each replica sees it gone at its next meeting (checked
    every 0.5 s while it waits), saves its step and exits, well within a bound; no
    orphan is left waiting for an anchor that will never come."""
    out = tmp_path / "run"
    train = [*TRAIN, "train.steps=100000", "diloco.sync_every=20"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxpar.cli", "launch", "--replicas", "2",
         "--devices-per-process", "1", "--", *train, "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not (out / "meetings" / "round_1" / "anchor.npz").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.05)
        pids = [v["pid"] for v in json.loads((out / "replicas.json").read_text()).values()]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while any(_running(p) for p in pids):
            assert time.monotonic() < deadline, "replicas outlived their launcher by 60 s"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in pids:
            if _running(p):
                os.kill(p, signal.SIGKILL)
    for r in (0, 1):
        saved = sorted(int(p.name) for p in (out / f"replica_{r}" / "checkpoints").iterdir()
                       if p.name.isdigit())
        assert saved and saved[-1] % 20 == 0 and saved[-1] >= 40, saved
    # Relaunched on the same --out without --resume: refused, nothing touched.
    again = [sys.executable, "-m", "jaxpar.cli", "launch", "--replicas", "2",
             "--devices-per-process", "1", "--", *TRAIN, "train.steps=80",
             "diloco.sync_every=20", "--out", str(out)]
    refused = subprocess.run(again, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "continue it with jaxpar launch --replicas N --resume" \
        in refused.stderr, refused.stderr
    # --resume: the server continues from its last completed round, each replica from its
    # checkpoint, rejoining at that round's anchor; both finish.
    done = subprocess.run([*again[:4], "--resume", *again[4:]], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "resuming the replica run" in done.stdout
    assert "2 of 2 replicas trained to the end after 4 meetings" in done.stdout, done.stdout
    for r in (0, 1):
        steps = [row["step"] for row in _rows(out / f"replica_{r}")]
        assert steps[-1] == 80 and len(steps) == len(set(steps)), steps  # no step twice


def _launch(capsys, out, *extra, resume=False) -> tuple[int, str]:
    """``jaxpar launch --replicas 2`` in this process, refused before any replica starts."""
    from jaxpar.cli import main

    code = main(["launch", "--replicas", "2", *(["--resume"] if resume else []), "--",
                 "train", "--config", "configs/tiny.yaml", "diloco.sync_every=3",
                 "--out", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) <= 1, err
    return code, err


def test_replica_folders_it_cannot_continue_get_advice_that_works(tmp_path, capsys):
    """meetings/ deleted after the replicas saved checkpoints: --resume and a fresh start
    over it are both refused, each advising another --out, which then passes the checks;
    a stray round_old and a server.npz without its keys are named with what to do; a
    resume with another diloco.sync_every (round 2 of H=2 is step 4, not 6) is refused."""
    from jaxpar.cli.parser import parse_args
    from jaxpar.cli.replicas import _checked
    from jaxpar.runs.replicas import SERVER_STATE, _write

    out = tmp_path / "run"
    (out / "replica_0" / "checkpoints" / "4").mkdir(parents=True)
    (out / "meetings").mkdir()
    code, err = _launch(capsys, out, resume=True)
    assert code == 2 and "holds no completed meeting (no server.npz)" in err and err.endswith(
        "replica_0 cannot rejoin without it: start a new replica run with another --out "
        "(this one is kept)"), err
    code, err = _launch(capsys, out)
    assert code == 2 and "choose another --out (this one is kept)" in err, err
    args = parse_args(["launch", "--replicas", "2", "--", "train", "--config",
                       "configs/tiny.yaml", "diloco.sync_every=3", "--out",
                       str(tmp_path / "another")])
    _checked(args, list(args.command_args[1:]))  # the advice: the run proceeds
    assert (out / "replica_0" / "checkpoints" / "4").is_dir()  # nothing removed
    meetings = out / "meetings"
    _write(meetings / SERVER_STATE, {"w": np.zeros(1)})
    code, err = _launch(capsys, out, resume=True)
    assert code == 2 and err.endswith(
        f"{meetings / SERVER_STATE} is not the parameter server's state (no 'round' in "
        "it): put back the launcher's server.npz, or start a new replica run with another "
        "--out (this one is kept)"), err
    _write(meetings / SERVER_STATE, {"round": np.asarray(2), "sync_every": np.asarray(2),
                                     "anchor/w": np.zeros(1), "momentum/w": np.zeros(1)})
    (meetings / "round_old").mkdir()
    code, err = _launch(capsys, out, resume=True)
    assert code == 2 and err.endswith(
        f"{meetings / 'round_old'} is not a meeting's folder (round_<number>): move it out "
        f"of {meetings} and resume again"), err
    (meetings / "round_old").rmdir()
    code, err = _launch(capsys, out, resume=True)
    assert code == 2 and err.endswith(
        "the replica run met every 2 steps (round 2 is step 4), diloco.sync_every=3 would "
        "put the replicas at step 6: resume with diloco.sync_every=2"), err


def test_the_launchers_summary_says_where_replicas_stopped():
    from jaxpar.cli.replicas import summary

    assert summary(2, {0: 4, 1: 4}, {}, 4, None, 1) == (
        "2 of 2 replicas trained to the end after 1 meetings")
    assert summary(2, {0: 1, 1: 1}, {}, 4, 1, 0) == (
        "0 of 2 replicas trained to the end after 0 meetings; replica 0 stopped at step 1 "
        "of 4, replica 1 stopped at step 1 of 4 (--max-steps 1); continue with jaxpar "
        "launch --replicas 2 --resume")
    assert summary(2, {0: 4}, {1: 137}, 4, None, 1).endswith(
        "1 of 2 replicas trained to the end after 1 meetings; replica 1 failed (exit "
        "status 137)")
