"""What summing weight gradients in bf16 costs in precision: the tiny run's loss curve.

    python benchmarks/grad_dtype.py [--steps 200] [--json]

Three runs of ``configs/tiny.yaml`` on 8 simulated devices (data parallel, so every weight
gradient is summed over 8 devices), the same data and seed: float32 throughout, bf16
compute with weight gradients summed in bf16 (``plan.grad_dtype=compute``, the default),
and bf16 compute with the projection layers' weight gradients formed and summed in float32
(``plan.grad_dtype=float32``). Prints each bf16 run's largest and mean absolute difference
from the float32 run's loss over the steps, and over the last quarter of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.analysis.report import table  # noqa: E402
from jaxpar.config.assembly import build_trainer  # noqa: E402
from jaxpar.data.loader import TokenLoader, load_tokens  # noqa: E402

RUNS = {"float32": ["plan.precision=p=f32,c=f32,o=f32"],
        "bf16, gradients summed in bf16": ["plan.precision=p=f32,c=bf16,o=f32"],
        "bf16, gradients summed in f32": ["plan.precision=p=f32,c=bf16,o=f32",
                                          "plan.grad_dtype=float32"]}


def losses(overrides: list[str], steps: int) -> np.ndarray:
    """The loss at each step of the tiny run under ``overrides``."""
    config = jaxpar.load_config("configs/tiny.yaml", ["mesh.data=8", f"train.steps={steps}",
                                                      *overrides])
    trainer = build_trainer(config)
    loader = TokenLoader(load_tokens("stdlib", 2_000_000), config.train.global_batch,
                         config.train.seq_len, seed=0)
    return np.array([float(trainer.step(loader.batch(i))["loss"]) for i in range(steps)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    curves = {name: losses(o, args.steps) for name, o in RUNS.items()}
    ref = curves["float32"]
    tail = slice(3 * args.steps // 4, None)
    rows = [(name, f"{c[-1]:.4f}", f"{np.abs(c - ref).max():.4f}",
             f"{np.abs(c - ref).mean():.4f}", f"{np.abs(c - ref)[tail].mean():.4f}")
            for name, c in curves.items()]
    if args.json:
        print(json.dumps({k: v.tolist() for k, v in curves.items()}))
    else:
        print(f"the tiny run, {args.steps} steps, data parallel over 8 devices")
        print(table(("run", "final loss", "max |d| vs f32", "mean |d| vs f32",
                     "mean |d|, last quarter"), rows, right=(1, 2, 3, 4)))


if __name__ == "__main__":
    main()
