"""Object storage against a real S3 server: moto's, started here over HTTP on localhost.

Token shards are read from a bucket by byte ranges; a run trains from a bucket, keeps its
checkpoints in one, and resumes from it on a machine that has none of its files."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jaxpar
from jaxpar.config.validate import check_config
from jaxpar.data.shards import Windows, open_shard, shard_paths
from jaxpar.errors import JaxparError
from jaxpar.storage import remote, run_mirror

pytest.importorskip("moto")
pytest.importorskip("s3fs")

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "jaxpar-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A local S3 server with one bucket; the environment points fsspec at it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           remote.CACHE_ENV: str(tmp_path_factory.mktemp("cache"))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # clients made for another server (an earlier
    fsspec.filesystem("s3").invalidate_cache()  # module's) keep its endpoint
    deadline = time.time() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            assert time.time() < deadline and server.poll() is None, "moto did not start"
            time.sleep(0.1)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(BUCKET)
    yield fs
    server.terminate()
    server.wait()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _put_shards(fs, folder: str, sizes: list[int], dtype: str = "uint16",
                local: Path | None = None) -> None:
    start = 0
    for i, n in enumerate(sizes):
        ids = (np.arange(start, start + n) % 4000).astype(dtype)
        fs.pipe_file(f"{BUCKET}/{folder}/part-{i:05d}.bin", ids.tobytes())
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
            ids.tofile(local / f"part-{i:05d}.bin")
        start += n


def test_shards_in_a_bucket_read_as_the_same_shards_on_disk(s3, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "BLOCK_BYTES", 64)  # windows straddle blocks
    _put_shards(s3, "corpus", [333, 170, 91], local=tmp_path / "corpus")
    there = shard_paths(f"s3://{BUCKET}/corpus/*.bin")
    assert there == [f"s3://{BUCKET}/corpus/part-{i:05d}.bin" for i in range(3)]
    assert shard_paths(f"s3://{BUCKET}/corpus") == there  # a folder lists its shards
    here = Windows([open_shard(p) for p in shard_paths(str(tmp_path / "corpus"))], 16)
    away = Windows([open_shard(p) for p in there], 16)
    assert len(away) == len(here) == 20 + 10 + 5
    for i in range(len(here)):
        np.testing.assert_array_equal(away[i], here[i])
    # a .npy shard: its header read, then ids by ranges
    ids = np.arange(50, 150, dtype=np.uint32)
    with s3.open(f"{BUCKET}/npy/a.npy", "wb") as f:
        np.save(f, ids)
    shard = open_shard(f"s3://{BUCKET}/npy/a.npy")
    assert len(shard) == 100 and shard.dtype == np.uint32
    np.testing.assert_array_equal(shard[7:93], ids[7:93])
    # ids past the vocabulary are named as they are read (the bucket is not scanned first)
    away.check_ids(vocab_size=300)
    with pytest.raises(JaxparError, match=r"part-00000.bin'.*token id 300 at position 300"):
        [away[i] for i in range(len(away))]


def test_documents_in_a_bucket_stream_as_the_same_files_on_disk(s3, tmp_path):
    """Parquet (by ranges), zstd jsonl and Arrow read from the bucket give the documents of
    the same files on disk, and a document loader over them the same packed batches;
    ArrayRecord must be local (one line)."""
    from jaxpar.data.documents import open_documents
    from jaxpar.data.streams import DocumentLoader
    from tests.data.test_streams import _docs, _write_every_kind
    from tests.data.test_tokenizer import make_tokenizer

    kinds = _write_every_kind(tmp_path / "d", _docs(40))
    arrow = sorted((tmp_path / "d" / "hf").glob("*.arrow"))[0]
    local = {"parquet": kinds["parquet"], "zst": kinds["zst"], "gz": kinds["gz"],
             "arrow": str(arrow)}
    for name, path in {**local, "array_record": kinds["array_record"]}.items():
        s3.put_file(path, f"{BUCKET}/docs/{name}/{Path(path).name}")
    for name, path in local.items():
        here, away = open_documents(path), open_documents(f"s3://{BUCKET}/docs/{name}/")
        assert [away[i] for i in range(len(away))] == [here[i] for i in range(len(here))]
    tok = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    loaders = [DocumentLoader([(open_documents(spec), 1.0)], tok, tok.token_to_id("</s>"),
                              4, 16, seed=1)
               for spec in (kinds["parquet"], f"s3://{BUCKET}/docs/parquet/*.parquet")]
    for step in range(3):
        np.testing.assert_array_equal(*(ld.batch(step)["tokens"] for ld in loaders))
    with pytest.raises(JaxparError, match="ArrayRecord files are read from local"):
        open_documents(f"s3://{BUCKET}/docs/array_record/")


def test_bad_urls_and_buckets_fail_in_one_line(s3):
    cases = [
        ([f"data.source=hdfs://{BUCKET}/x.bin"], "hdfs:// is not supported"),
        ([f"data.source=s3://{BUCKET}/none/*.bin"], "the pattern matches no object"),
        (["data.source=s3://no-such-bucket-here/x.bin"], "does not exist"),
    ]
    for overrides, message in cases:
        with pytest.raises(JaxparError, match=re.escape(message)):
            check_config(jaxpar.load_config(None, overrides), devices=8, processes=1)
    from jaxpar.runs.loop import check_run_folder

    with pytest.raises(JaxparError, match="bucket 'no-such-bucket-here' does not exist"):
        check_run_folder("s3://no-such-bucket-here/run")
    with pytest.raises(JaxparError, match=r"ftp:// is not supported"):
        check_run_folder("ftp://host/run")


def test_no_credentials_and_a_silent_endpoint_are_named_within_a_bound(s3, monkeypatch):
    """Without credentials the line says so (not "no such bucket"); an endpoint that accepts
    connections and never answers is one line after the bounded tries, not minutes."""
    import socket

    from jaxpar.runs.run_folder import check_run_folder

    s3.mkdir("creds")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    type(s3).clear_instance_cache()  # clients read the environment when made
    with pytest.raises(JaxparError, match=r"--out 's3://creds/run': no credentials"):
        check_run_folder("s3://creds/run")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are accepted by the kernel, never answered
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setattr(remote, "REQUEST_TIMEOUT_S", 1.0)
    type(s3).clear_instance_cache()
    start = time.monotonic()
    with pytest.raises(JaxparError, match=r"did not answer within 1 s, 2 tries"):
        check_config(jaxpar.load_config(None, ["data.source=s3://creds/x/*.bin"]),
                     devices=8, processes=1)
    assert time.monotonic() - start < 20
    silent.close()
    type(s3).clear_instance_cache()


def _config(steps: int) -> list[str]:
    return [f"data.source=s3://{BUCKET}/train/*.bin", "model.vocab_size=4096",
            "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
            "model.d_ff=32", "model.max_seq_len=16", "train.seq_len=16",
            "train.global_batch=8", f"train.steps={steps}", "train.eval_every=0",
            "train.log_every=1", "checkpoint.every=2", "mesh.data=-1"]


def test_a_run_trains_from_a_bucket_checkpoints_there_and_resumes_elsewhere(s3, tmp_path):
    """Steps 1-2 into s3://, the local copy thrown away (another machine), then `jaxpar
    train --resume` from the bucket alone: its losses are those of one uninterrupted run."""
    from jaxpar.runs.loop import train

    _put_shards(s3, "train", [3000, 2000])
    config = jaxpar.load_config(None, _config(4))
    _, whole = train(config, tmp_path / "whole", progress=False)
    out = f"s3://{BUCKET}/runs/a"
    train(config, out, progress=False, max_steps=2)
    assert s3.exists(f"{BUCKET}/runs/a/checkpoints/2/{run_mirror.UPLOADED}")
    assert not s3.exists(f"{BUCKET}/runs/a/.jaxpar-lock")
    shutil.rmtree(os.environ[remote.CACHE_ENV])  # a new machine: nothing local
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "--devices", "8",
                           "--out", out, "--resume"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout + done.stderr
    rows = [json.loads(line) for line in
            s3.cat_file(f"{BUCKET}/runs/a/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in whole],
                               rtol=1e-6)
    assert s3.exists(f"{BUCKET}/runs/a/checkpoints/4/{run_mirror.UPLOADED}")
    again = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "--devices", "8",
                            "--out", out, *_config(4)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"jaxpar: error: {out} already holds checkpoints (steps [2, 4]); pass --resume to "
        "continue that run, or choose another --out"], again.stderr
