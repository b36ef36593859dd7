"""What gradient accumulation moves: the data-parallel reduction once a step, or at every
microbatch.

    python benchmarks/accumulation.py [--target cpu|tpu-v5e:2x4|h100:8] [--json]

Compiles (never runs) the train step of an 8-layer, d=1024 model on 8 devices for a few
layouts and microbatch counts, twice: as jaxpar builds it (the loop over microbatches in
``shard_map`` over ``data``, one reduction after it: ``jaxpar.parallel.accumulation``)
and with that turned off (GSPMD's loop, which reduces each microbatch's gradients in it).
Prints, per run, the bytes a device receives a step over ``data`` and over the other
axes (each HLO instruction times its loop's trips), and the planner's figure for the
first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxpar  # noqa: E402
from jaxpar.analysis import targets  # noqa: E402
from jaxpar.analysis.inspection import compile_step, step_report  # noqa: E402
from jaxpar.analysis.report import table  # noqa: E402
from jaxpar.parallel import accumulation  # noqa: E402

MODEL = ["model.n_layers=8", "model.d_model=1024", "model.d_ff=4096", "model.n_heads=8",
         "model.n_kv_heads=4", "model.head_dim=128", "model.vocab_size=8192",
         "model.max_seq_len=256", "train.seq_len=256", "train.global_batch=64"]
LAYOUTS = {"data 8": ["mesh.data=8", "plan.rules=dp"],
           "data 2 x fsdp 4": ["mesh.data=2", "mesh.fsdp=4"],
           "data 4 x tensor 2, ZeRO-1": ["mesh.data=4", "mesh.tensor=2", "plan.zero_stage=1"]}
MICROBATCHES = (2, 4)


def received(overrides: list[str], target, by_hand: bool) -> dict[str, float]:
    """Bytes a device receives a step over ``data`` and over the rest, measured and (for
    jaxpar's own step) predicted."""
    config = jaxpar.load_config("configs/tiny.yaml", [*MODEL, *overrides])
    keep = accumulation.local_axes
    if not by_hand:
        accumulation.local_axes = lambda *args, **kwargs: ()
    try:
        report = step_report(compile_step(config, target))
    finally:
        accumulation.local_axes = keep
    out = {"data": 0.0, "other": 0.0, "predicted_data": 0.0}
    for row in report["comparison"]["collectives"]:
        where = "data" if "data" in row["axes"] else "other"
        out[where] += row.get("wire_bytes_per_step") or 0.0
        if where == "data":
            out["predicted_data"] += row.get("predicted_wire_bytes_per_step") or 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = None if args.target == "cpu" else targets.parse_target(args.target)
    rows = []
    for name, layout in LAYOUTS.items():
        for k in MICROBATCHES:
            knobs = [*layout, f"plan.microbatches={k}"]
            once, looped = received(knobs, target, True), received(knobs, target, False)
            rows.append({"layout": name, "microbatches": k, **{f"once_{a}": b for a, b in
                         once.items()}, **{f"looped_{a}": b for a, b in looped.items()}})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    print(f"gradient accumulation, {args.target}: MiB a device receives a step")
    print(table(["layout", "k", "data, once", "data, looped", "looped/once", "planner",
                 "other axes, once", "other, looped"],
                [[r["layout"], r["microbatches"], mib(r["once_data"]), mib(r["looped_data"]),
                  f"{r['looped_data'] / r['once_data']:.2f}", mib(r["once_predicted_data"]),
                  mib(r["once_other"]), mib(r["looped_other"])] for r in rows],
                right=(1, 2, 3, 4, 5, 6, 7)))


if __name__ == "__main__":
    main()
