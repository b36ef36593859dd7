"""Checkpoint save and restore times, and how much an asynchronous save holds up training.

    python benchmarks/checkpoint.py [--config configs/small-100m.yaml] [--devices 8]
        [--dir /tmp/jaxpar-ckpt-bench] [--json] [key=value ...]

Builds the trainer of the config (default: the ~110M model, FSDP over 8 simulated CPU
devices, a small batch so a step is cheap), then measures:

* save, blocking part: what ``Checkpointer.save`` costs the training loop (arrays copied
  off the devices, the step folder created);
* save, total: until the checkpoint is complete on disk (the background write included);
* a training step while the background write runs, beside a step with nothing saving;
* a synchronous save (``async_save=False``) for comparison;
* restore into the same plan, and into another (tensor parallelism over half the devices).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small-100m.yaml")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dir", default="/tmp/jaxpar-ckpt-bench")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import jax

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    import jaxpar
    from jaxpar.checkpoint.checkpointer import Checkpointer
    from jaxpar.config.assembly import build_trainer
    from jaxpar.runs.loop import make_loader

    n = args.devices
    defaults = ["mesh.data=1", f"mesh.fsdp={n}", "mesh.tensor=1", "train.global_batch=8",
                "train.seq_len=64", "data.max_bytes=2000000"]
    config = jaxpar.load_config(args.config, [*defaults, *args.overrides])
    other = jaxpar.load_config(args.config, [*defaults, *args.overrides, "mesh.data=-1",
                                             "mesh.fsdp=1",
                                             f"mesh.tensor={max(n // 2, 1)}"])
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    loader = make_loader(config)
    trainer = build_trainer(config)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state))
    step = 0

    def train_step() -> float:
        nonlocal step
        start = time.perf_counter()
        trainer.step(loader.batch(step))
        step += 1
        return time.perf_counter() - start

    train_step()  # compile
    idle = [train_step() for _ in range(3)]

    rows: list[tuple[str, float]] = []
    with Checkpointer(root / "async", every=0, keep=2) as ckpt:
        start = time.perf_counter()
        blocked = ckpt.save(trainer, force=True)
        ckpt.wait()
        rows += [("save, blocking part (s)", blocked),
                 ("save, total until complete on disk (s)", time.perf_counter() - start)]
        busy = []
        for _ in range(2):  # a save, then a step while it writes in the background
            train_step()
            t0 = time.perf_counter()
            blocked = ckpt.save(trainer, force=True)
            busy.append(train_step())
            ckpt.wait()
            rows.append(("save + overlapped step: blocking part (s)", blocked))
            rows.append(("  background write finished after (s)", time.perf_counter() - t0))
        rows += [("train step, nothing saving (s)", statistics.mean(idle)),
                 ("train step, during a background write (s)", statistics.mean(busy))]
        size = _dir_bytes(ckpt.path(max(ckpt.steps())))
    with Checkpointer(root / "sync", every=0, async_save=False) as ckpt:
        start = time.perf_counter()
        ckpt.save(trainer, force=True)
        ckpt.wait()
        rows.append(("synchronous save (s)", time.perf_counter() - start))
    with Checkpointer(root / "async") as ckpt:
        start = time.perf_counter()
        ckpt.restore(trainer)
        jax.block_until_ready(trainer.state)
        rows.append(("restore, same plan (s)", time.perf_counter() - start))
        target = build_trainer(other)
        start = time.perf_counter()
        ckpt.restore(target)
        jax.block_until_ready(target.state)
        rows.append((f"restore into tensor={max(n // 2, 1)} (s)", time.perf_counter() - start))

    head = {"model_params_M": config.model.param_count() / 1e6,
            "state_MiB": state_bytes / 2**20, "checkpoint_MiB": size / 2**20,
            "devices": n, "platform": jax.devices()[0].platform}
    if args.json:
        print(json.dumps({**head, "rows": dict(rows)}, indent=1))
        return 0
    print(f"model {head['model_params_M']:.1f}M params, train state "
          f"{head['state_MiB']:.0f} MiB (params + Adam moments), checkpoint on disk "
          f"{head['checkpoint_MiB']:.0f} MiB, {n} {head['platform']} devices")
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}  seconds")
    for name, value in rows:
        print(f"{name:<{width}}  {value:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
