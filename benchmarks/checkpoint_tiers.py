"""What each checkpoint tier costs a step, and how many steps a crash loses with and without
the fast tier (``checkpoint.local_dir``), on a multi-process run.

    python benchmarks/checkpoint_tiers.py [--processes 4] [--devices-per-process 2]
        [--every 10] [--local-every 2] [--kill-after 17] [--dir /tmp/jaxpar-tiers]
        [key=value ...]

Runs ``jaxpar launch --processes P -- train`` twice, once with the persistent tier alone
(``checkpoint.every``) and once with the fast tier too (``checkpoint.local_every``). Once
``metrics.jsonl`` holds step ``--kill-after``, one process (index 1) is killed with
SIGKILL, as a crashed host would be; then ``--resume --max-steps 1`` says which step it
continues from. The table gives, from the killed run's rows, the mean
``checkpoint_block_s`` and ``local_checkpoint_block_s`` (what a save held up its step),
the mean step time of steps that saved nothing, and the steps lost: the steps trained
(the last logged) minus the step resumed from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

BASE = ["train.steps=60", "train.global_batch=16", "train.seq_len=64",
        "train.warmup_steps=2", "data.max_bytes=400000", "train.log_every=1"]


def _env(cache: Path) -> dict:
    """A launch's environment: a compilation cache of its own, empty. In a cache that holds
    the run's programs process 0 alone finds them (the others compile) and waits for the
    others at the first collective, past gloo's 30 s on a loaded machine."""
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}


def _children(pid: int) -> dict[int, int]:
    """``{process index: pid}`` of the processes ``jaxpar launch`` (``pid``) started."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with open(f"/proc/{child}/environ", "rb") as f:
                env = f.read().split(b"\0")
            index = [e for e in env if e.startswith(b"JAXPAR_PROCESS_ID=")]
            if index:
                found[int(index[0].split(b"=")[1])] = int(child)
    return found


def _rows(metrics: Path) -> list[dict]:
    rows = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by the kill
            rows.append(json.loads(line))
    return rows


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def one(args: argparse.Namespace, name: str, tier: list[str]) -> dict:
    """Run, kill a process after ``--kill-after`` steps, resume: this setup's figures."""
    root = Path(args.dir) / name
    for folder in (root, Path(args.dir) / "fast"):
        shutil.rmtree(folder, ignore_errors=True)
    out = root / "run"
    launch = [sys.executable, "-m", "jaxpar.cli", "launch", "--processes",
              str(args.processes), "--devices-per-process", str(args.devices_per_process),
              "--", "train", "--config", args.config, "--out", str(out)]
    run = [*BASE, f"checkpoint.every={args.every}", *tier, *args.overrides]
    proc = subprocess.Popen([*launch, *run], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(root / "xla-run"))
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while not any(r["step"] >= args.kill_after for r in _rows(metrics)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name}: the run ended before step {args.kill_after}:\n"
                             + proc.communicate()[0][-3000:])
        time.sleep(0.01)
    os.kill(_children(proc.pid)[1], signal.SIGKILL)
    proc.communicate(timeout=300)
    rows = _rows(metrics)
    trained = max(r["step"] for r in rows)
    done = subprocess.run([*launch, "--resume", "--max-steps", "1", *run], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900,
                          env=_env(root / "xla-resume"))
    found = re.search(r"\[0\] jaxpar: resumed from (.*) \(step (\d+) of", done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{name}: the resume failed:\n{done.stdout[-3000:]}")
    quiet = [r["step_time_s"] for r in rows[1:] if "checkpoint_block_s" not in r
             and "local_checkpoint_block_s" not in r]
    return {"setup": name, "trained": trained, "resumed_from": int(found[2]),
            "lost": trained - int(found[2]), "where": found[1],
            "checkpoint_block_s": _mean([r["checkpoint_block_s"] for r in rows
                                         if "checkpoint_block_s" in r]),
            "local_checkpoint_block_s": _mean([r["local_checkpoint_block_s"] for r in rows
                                               if "local_checkpoint_block_s" in r]),
            "step_s_no_save": _mean(quiet)}


def _retried(args: argparse.Namespace, name: str, tier: list[str], tries: int = 3) -> dict:
    """:func:`one`, again when a run failed to start: on a loaded machine one process can
    reach the first collective more than gloo's 30 s after another."""
    for attempt in range(tries):
        try:
            return one(args, name, tier)
        except SystemExit as failed:
            if attempt == tries - 1:
                raise
            lines = [x for x in str(failed).splitlines() if "failed first" in x]
            print(f"{name}: attempt {attempt + 1} failed {lines[-1:]}; again", file=sys.stderr)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every")
    parser.add_argument("--local-every", type=int, default=2, help="checkpoint.local_every")
    parser.add_argument("--kill-after", type=int, default=17)
    parser.add_argument("--dir", default="/tmp/jaxpar-tiers")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    fast = [f"checkpoint.local_dir={Path(args.dir).absolute()}/fast/{{process}}",
            f"checkpoint.local_every={args.local_every}"]
    results = [_retried(args, "persistent only", []),
               _retried(args, "persistent + fast tier", fast)]
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{args.processes} processes x {args.devices_per_process} CPU devices, "
          f"{' '.join([args.config, *args.overrides])}; checkpoint.every={args.every}, "
          f"local_every={args.local_every}; SIGKILL to process 1 after step {args.kill_after}")
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    head = (f"{'setup':<24} {'ckpt_block_s':>12} {'local_block_s':>13} {'step_s':>8} "
            f"{'trained':>7} {'resumed':>7} {'lost':>4}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['setup']:<24} {fmt(r['checkpoint_block_s']):>12} "
              f"{fmt(r['local_checkpoint_block_s']):>13} {fmt(r['step_s_no_save']):>8} "
              f"{r['trained']:>7} {r['resumed_from']:>7} {r['lost']:>4}")
    print("ckpt_block_s / local_block_s: mean seconds a save held up its step (persistent / "
          "fast tier); step_s: mean step time without a save; lost: steps trained minus "
          "the step resumed from")
    return 0


if __name__ == "__main__":
    sys.exit(main())
