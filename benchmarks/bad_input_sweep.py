"""A sweep of careless and unlucky inputs over the newest surfaces (compile and --compiled,
tokenize and shards, buckets, W&B, checkpoint tiers, replicas' launcher, goodput), each run
as a user would: ``jaxpar ...`` in a fresh process, with a time limit.

Each case is classed by what the user sees: ``refused`` (exit 2, and stderr's last line is
one ``jaxpar: error:`` line), ``worked`` (exit 0), ``traceback`` (a Python traceback),
``hang`` (past the limit), ``other`` (any other exit). A local GCS server (fake-gcs-server)
serves the bucket cases. Prints one row per case and the counts.

    python benchmarks/bad_input_sweep.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LIMIT_S = 90
TINY = ["--config", str(ROOT / "configs/tiny.yaml"), "--devices", "8"]
COMPILE = ["compile", *TINY, "--target", "cpu"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(args: list[str], work: Path, env: dict[str, str]) -> tuple[str, float, str]:
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], cwd=work,
                              env=env, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        return "hang", time.monotonic() - start, ""
    took = time.monotonic() - start
    lines = [ln for ln in done.stderr.splitlines() if ln.strip() and not ln.startswith(
        ("I1", "W1", "E1", "jaxpar: warning:"))]
    last = lines[-1] if lines else ""
    if "Traceback (most recent call last)" in done.stderr:
        return "traceback", took, last
    if done.returncode == 2 and last.startswith("jaxpar: error:"):
        return "refused", took, last
    if done.returncode == 0:
        return "worked", took, (done.stdout.strip().splitlines() or [""])[-1]
    return "other", took, f"exit {done.returncode}: {last}"


def _cases(work: Path, bucket: str) -> list[tuple[str, list[str], dict[str, str]]]:
    (work / "my.yaml").write_text((ROOT / "configs/tiny.yaml").read_text())
    wide = work / "wide"  # what jaxpar tokenize writes for a large vocabulary: uint32 ids
    wide.mkdir()
    ids = (np.arange(20000) % 3000).astype(np.uint32)
    ids.tofile(wide / "00000-part.bin")
    (wide / "tokenize.json").write_text(json.dumps(
        {"token_dtype": "uint32", "eos_id": 1, "vocab_size": 3000, "complete": True,
         "shards": ["00000-part.bin"], "tokens": 20000}))
    raw = work / "raw"
    raw.mkdir()
    ids.tofile(raw / "a.bin")
    bad_aot = work / "aot"
    bad_aot.mkdir()
    (bad_aot / "manifest.json").write_text("{not json")
    (work / "afile").write_text("x")
    (work / "ids.npy").write_bytes(b"\x93NUMPY")
    from tests.data.test_tokenizer import make_tokenizer

    make_tokenizer(work / "tok.json")
    dead = f"http://127.0.0.1:{_closed_port()}"
    return [
        ("uint32 shards read as uint16", ["train", *TINY, f"data.source={wide}"], {}),
        ("raw uint32 shard read as uint16",
         ["train", *TINY, f"data.source={raw}/*.bin", "model.vocab_size=4000"], {}),
        ("--dump-hlo onto the config", [*COMPILE, "--dump-hlo", "my.yaml"], {}),
        ("--dump-hlo into a missing folder",
         [*COMPILE, "--dump-hlo", "no/such/x.hlo"], {}),
        ("--dump-hlo to gs://", [*COMPILE, "--dump-hlo", f"gs://{bucket}/x.hlo"], {}),
        ("--save to s3://", [*COMPILE, "--save", "s3://b/aot"], {}),
        ("compile_cache in s3://", ["train", *TINY, "train.compile_cache=s3://b/c"], {}),
        ("--compiled with a damaged manifest", ["train", *TINY, "--compiled", str(bad_aot)],
         {}),
        ("--compiled missing", ["train", *TINY, "--compiled", "nowhere"], {}),
        ("plan --verify -1", ["plan", "--model", str(ROOT / "configs/tiny.yaml"), "--chips",
                              "v5p:8", "--global-batch", "8", "--seq", "128", "--verify",
                              "-1"], {}),
        ("--out in a missing bucket", ["train", *TINY, "--out", "gs://no-such-bucket/r"], {}),
        ("--out onto an object", ["train", *TINY, "--out", f"gs://{bucket}/an-object"], {}),
        ("shards pattern matching nothing",
         ["train", *TINY, f"data.source=gs://{bucket}/none/*.bin"], {}),
        ("init_from a missing bucket folder",
         ["train", *TINY, f"init_from=gs://{bucket}/missing"], {}),
        ("GCS endpoint down", ["train", *TINY, "--out", f"gs://{bucket}/r"],
         {"STORAGE_EMULATOR_HOST": dead}),
        ("S3 endpoint down", ["train", *TINY, "--out", "s3://b/r"],
         {"AWS_ENDPOINT_URL": dead, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}),
        ("W&B mode misspelt", ["train", *TINY, "train.trackers=[wandb]", "--out", "wb1"],
         {"WANDB_MODE": "ofline"}),
        ("W&B without a key", ["train", *TINY, "train.trackers=[wandb]", "--out", "wb2"],
         {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(work)}),
        ("tokenize a .npy", ["tokenize", "ids.npy", "--tokenizer", "tok.json", "--out", "t"],
         {}),
        ("token_dtype on text", ["train", *TINY, "data.token_dtype=uint32"], {}),
        ("peak_flops of 1", ["train", *TINY, "train.peak_flops=1"], {}),
        ("local_every without local_dir", ["train", *TINY, "checkpoint.local_every=2"], {}),
        ("local_dir in a bucket", ["train", *TINY, "checkpoint.local_dir=gs://b/x"], {}),
        ("--resume without --out", ["train", *TINY, "--resume"], {}),
        ("--out is a file", ["train", *TINY, "--out", "afile"], {}),
        ("export a missing run", ["export", "--run", "nowhere", "--to-hf", "hf"], {}),
        ("sample a bucket folder without checkpoints",
         ["sample", "--run", f"gs://{bucket}/none", "--prompt", "x"], {}),
        ("goodput of a missing folder", ["goodput", "nowhere"], {}),
        ("launch flag given twice", ["launch", "--processes", "2", "--devices-per-process",
                                     "2", "--", "train", *TINY, "--out", "l"], {}),
        ("heartbeat timeout of 0", ["train", *TINY, "--coordinator", "127.0.0.1:1",
                                    "--num-processes", "2", "--process-id", "0"],
         {"JAXPAR_HEARTBEAT_TIMEOUT_S": "0"}),
    ]


def main() -> int:
    from tests.gcs_server import gcs_server

    bucket = "sweep"
    rows = []
    with tempfile.TemporaryDirectory() as tmp, gcs_server((bucket,)) as gcs:
        work = Path(tmp)
        gcs.pipe_file(f"{bucket}/an-object", b"x")
        base = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
        for name, args, env in _cases(work, bucket):
            rows.append((name, *_run(args, work, {**base, **env})))
    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'outcome':<9}  {'s':>5}  what the user sees")
    for name, outcome, took, said in rows:
        print(f"{name:<{width}}  {outcome:<9}  {took:5.1f}  {said[:150]}")
    counts: dict[str, int] = {}
    for _, outcome, _, _ in rows:
        counts[outcome] = counts.get(outcome, 0) + 1
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())),
          f"({len(rows)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
