"""Weights & Biases through its own library, offline: a run's config (with the layout it
resolved), metrics and MFU in W&B's transaction log, read back with W&B's own protobuf."""

from __future__ import annotations

import json
import re

import pytest

import jaxpar
from jaxpar.config.validate import check_config
from jaxpar.errors import JaxparError
from tests.helpers import small_config

pytest.importorskip("wandb")


def _records(path):
    """The records of a W&B transaction log (``run-*.wandb``), parsed by W&B's protobuf:
    a ``:W&B`` header, then 32 KiB blocks of records (checksum, length, type, bytes),
    records split across blocks as first/middle/last pieces."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        parts += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last piece
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)  # "train/loss" is stored nested


def _read_run(folder):
    config, history, summary = {}, [], {}
    for record in _records(next(folder.glob("*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            history.append({**row, "_step": record.history.step.num})
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
    return config, history, summary


def test_an_offline_wandb_run_holds_config_metrics_and_mfu(tmp_path, monkeypatch):
    from jaxpar.runs.loop import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    # What jaxpar calibrate writes for 8 CPU devices: MFU against its measured peak.
    catalog = tmp_path / "cpu.yaml"
    catalog.write_text("cpu8: {peak_flops: 1.0e9, f32_flops: 1.0e9, hbm_bytes: 3.0e9, "
                       "hbm_bw: 1.0e9, ici_bw: 1.0e9, dcn_bw: 1.0e9, domain: 8}\n")
    config = small_config("train.steps=3", "train.trackers=[jsonl, tensorboard, wandb]",
                          f"train.catalog={catalog}", "checkpoint.every=2")
    _, history = train(config, out, progress=False)
    assert "mfu" in history[-1] and history[-1]["mfu"] > 0  # against the calibrated peak
    assert history[0]["compile_s"] > 0 and "data_wait_s" in history[-1]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    logged, rows, summary = _read_run(runs[0])
    assert logged["train"]["steps"] == 3 and logged["plan"]["rules"] == "fsdp_tp"
    assert logged["resolved"]["devices"] == 8 and logged["resolved"]["mesh"]["data"] == 8
    assert [r["_step"] for r in rows] == [1, 2, 3]
    for row, want in zip(rows, history, strict=True):
        assert row["train/loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert row["perf/mfu"] == pytest.approx(want["mfu"], rel=1e-6)
    assert summary["model_flops_per_step"] > 0 and summary["peak_flops_per_device"] == 1e9
    # The planner's prediction for this run on the calibrated chip, beside what it measured.
    assert summary["predicted/step_time_s"] > 0 and 0 < summary["predicted/mfu"] <= 1
    assert summary["predicted/memory_bytes_per_device"] > 0
    run_id = (out / "wandb-id").read_text()
    assert run_id in runs[0].name


def test_trackers_and_peak_are_checked():
    for overrides, message in [(["train.trackers=[mlflow]"], "'mlflow' is not a tracker"),
                               (["train.peak_flops=-1"], "train.peak_flops=-1"),
                               (["train.peak_flops=1"], "train.peak_flops=1.0: must be 0 (the "
                                "catalog's) or the peak FLOP/s of one device, at least 1e9")]:
        with pytest.raises(JaxparError, match=re.escape(message)):
            check_config(jaxpar.load_config(None, overrides), devices=8, processes=1)


def test_a_catalog_gives_cpu_devices_their_calibrated_peak(tmp_path):
    import jax

    from jaxpar.runs.monitor import run_chip

    assert run_chip("") is None  # CPU devices: no peak unless calibrated
    both = tmp_path / "two.yaml"
    fields = "f32_flops: 1, hbm_bytes: 1, hbm_bw: 1, ici_bw: 1, dcn_bw: 1, domain: 8"
    both.write_text(f"cpu8: {{peak_flops: 8.0, {fields}}}\n"
                    f"cpu4: {{peak_flops: 4.0, {fields}}}\n")
    assert run_chip(str(both)).peak_flops == 8.0
    assert run_chip(str(both), jax.devices()[:4]).peak_flops == 4.0
    with pytest.raises(JaxparError, match=r"no entry 'cpu2' .* cpu4, cpu8\): run jaxpar calib"):
        run_chip(str(both), jax.devices()[:2])
    with pytest.raises(JaxparError, match="does not exist"):
        run_chip(str(tmp_path / "missing.yaml"))


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


@pytest.mark.parametrize("env, says", [
    ({"WANDB_MODE": "ofline"}, "WANDB_MODE='ofline' is not a W&B mode: use one of online, "
                               "offline, disabled"),
    ({}, "W&B has no API key for http://127.0.0.1:"),
    ({"WANDB_API_KEY": "x" * 40}, "the W&B server http://127.0.0.1:"),
    ({"WANDB_API_KEY": "short"}, "wandb refuses its credentials (WANDB_API_KEY invalid"),
])
def test_wandb_that_cannot_log_is_one_line_before_the_run(env, says, tmp_path, monkeypatch,
                                                         capsys):
    """A typo in WANDB_MODE, no key, no network (a closed port): one line, exit 2, before
    the run folder is made (it was left with an empty checkpoints/), within seconds."""
    import time

    from jaxpar import cli

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE",
                 "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    start = time.monotonic()
    assert cli.main(["train", "--config", "configs/tiny.yaml", "--out", str(out),
                     "train.trackers=[jsonl, wandb]", "model.d_model=32", "model.n_layers=1",
                     "model.d_ff=64", "train.seq_len=16", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar: error: ") and err.count("\n") == 1, err
    assert says in err, err
    assert time.monotonic() - start < 10 and not out.exists()
