"""A model of yours against jaxpar's own decoder of the same shapes.

    python benchmarks/own_model.py [--layers 8,32] [--rounds 5] [--steps 3] [--no-tpu]
        [--json benchmarks/results/own_model.json]

The user's side is ``tests.user_models:llama_like``: a Llama-like decoder written as users
write one (an ``nnx.List`` of layers called from a Python loop, ``nnx.Einsum`` and
``nnx.Linear`` projections, no jaxpar call inside), named by ``plan.annotations``. The
reference is jaxpar's ``Transformer`` with the same sizes (d 256, 8 heads, 2 KV heads, ff
1024, vocabulary 64). Both train on fsdp 8 (8 simulated CPU devices) at batch 8 x 256,
through ``jaxpar.load_config`` and ``jaxpar.build_trainer``, as ``jaxpar train`` builds
them, with every default (the user's blocks are scanned: ``plan.scan_blocks=auto``).

For 8 and 32 layers, under remat none and full, it prints:

- compiled temporaries a device (XLA:CPU) and the planner's prediction of them
  (``jaxpar.planner.prediction.predict``: the user's model from its traced step, the
  reference from its formula), and the same program's temporaries compiled for
  ``tpu-v5e:2x4`` (libtpu);
- the time to lower and compile the step (the persistent compile cache off);
- step time: ``--rounds`` alternated rounds of ``--steps`` steps of each side (the order
  flips each round), the median of the per-round ratios (user / reference).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

D, HEADS, KV, FF, VOCAB, BATCH, SEQ = 256, 8, 2, 1024, 64, 8, 256


def config(side: str, layers: int, remat: str):
    import jaxpar
    from tests import user_models as um

    common = ["mesh.data=1", "mesh.fsdp=8", f"plan.remat={remat}",
              f"train.global_batch={BATCH}", f"train.seq_len={SEQ}",
              "train.compile_cache=off", f"model.vocab_size={VOCAB}"]
    if side == "user":
        names = json.dumps([[p, list(n)] for p, n in um.LLAMA_ANNOTATIONS])
        model = ["model.factory=tests.user_models:llama_like", f"plan.annotations={names}",
                 f"model.kwargs={{d: {D}, heads: {HEADS}, kv_heads: {KV}, ff: {FF}, "
                 f"layers: {layers}}}"]
    else:
        model = [f"model.d_model={D}", f"model.n_heads={HEADS}", f"model.n_kv_heads={KV}",
                 f"model.d_ff={FF}", f"model.n_layers={layers}", "model.max_seq_len=256"]
    return jaxpar.load_config(None, common + model)


def measure(side: str, layers: int, remat: str, tpu: bool) -> dict:
    """Compiled and predicted temporaries, compile time, and a trainer to time."""
    import jax
    import numpy as np

    import jaxpar
    from jaxpar.analysis import targets
    from jaxpar.analysis.hlo import memory_stats
    from jaxpar.analysis.inspection import compile_step
    from jaxpar.planner.prediction import predict

    cfg = config(side, layers, remat)
    trainer = jaxpar.build_trainer(cfg)
    batch = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    start = time.perf_counter()
    compiled = trainer.lower(batch).compile()
    seconds = time.perf_counter() - start
    row = {"side": side, "layers": layers, "remat": remat, "compile_s": seconds,
           "temp": memory_stats(compiled)["temp_bytes"],
           "planner_temp": predict(cfg, 8)["memory"]["temp_bytes"]}
    if tpu and targets.tpu_compiler_missing() is None:
        step = compile_step(cfg, targets.tpu_target("tpu-v5e:2x4"))
        row["tpu_temp"] = memory_stats(step.compiled)["temp_bytes"]
    jax.block_until_ready(trainer.step(batch)["loss"])  # the cached program, warm
    return row, trainer, batch


def time_steps(trainer, batch, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-tpu", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        for remat in ("none", "full"):
            pair = {side: measure(side, layers, remat, not args.no_tpu)
                    for side in ("user", "reference")}
            ratios, ms = [], {"user": [], "reference": []}
            for r in range(args.rounds):
                order = ("user", "reference") if r % 2 == 0 else ("reference", "user")
                got = {side: time_steps(pair[side][1], pair[side][2], args.steps)
                       for side in order}
                ratios.append(got["user"] / got["reference"])
                for side in got:
                    ms[side].append(got[side])
            for side in ("user", "reference"):
                row = pair[side][0]
                row["step_s"] = statistics.median(ms[side])
                if side == "user":
                    row["step_ratio"] = statistics.median(ratios)
                    row["step_ratio_range"] = [min(ratios), max(ratios)]
                rows.append(row)
            print_rows(rows[-2:])
    print()
    print(markdown({"args": vars(args), "rows": rows}))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        print(f"{row['side']:9} L={row['layers']:2} remat={row['remat']:4} "
              f"temp {row['temp'] / 2**20:7.1f} MiB planner {row['planner_temp'] / 2**20:7.1f} "
              f"tpu {row.get('tpu_temp', 0) / 2**20:6.1f} compile {row['compile_s']:5.1f} s "
              f"step {1e3 * row['step_s']:7.1f} ms", flush=True)


# --- the site's table (docs/hooks/generated.py) ---------------------------------------------

COMMAND = "python benchmarks/own_model.py --json benchmarks/results/own_model.json"
"""The command that wrote ``benchmarks/results/own_model.json``."""


def markdown(results: dict) -> str:
    """One row a depth and remat policy: the user's model against the reference."""
    rows = {(r["side"], r["layers"], r["remat"]): r for r in results["rows"]}
    mib = lambda b: f"{b / 2**20:.1f}"
    lines = ["| layers | remat | temporaries, user / reference (MiB) | ratio | planner / "
             "compiled, user, reference | TPU v5e temporaries, user / reference (MiB) | "
             "compile, user / reference (s) | ratio | step, user / reference (ms) | ratio |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    depths = sorted({k[1] for k in rows})
    for layers in depths:
        for remat in ("none", "full"):
            u, r = rows.get(("user", layers, remat)), rows.get(("reference", layers, remat))
            if u is None or r is None:
                continue
            tpu = (f"{mib(u['tpu_temp'])} / {mib(r['tpu_temp'])}" if "tpu_temp" in u
                   and "tpu_temp" in r else "-")
            lines.append(
                f"| {layers} | {remat} | {mib(u['temp'])} / {mib(r['temp'])} | "
                f"{u['temp'] / r['temp']:.2f} | {u['planner_temp'] / u['temp']:.2f}, "
                f"{r['planner_temp'] / r['temp']:.2f} | {tpu} | {u['compile_s']:.1f} / "
                f"{r['compile_s']:.1f} | {u['compile_s'] / r['compile_s']:.2f} | "
                f"{1e3 * u['step_s']:.0f} / {1e3 * r['step_s']:.0f} | {u['step_ratio']:.2f} |")
    a = results["args"]
    if len(depths) >= 2:
        lo, hi = depths[0], depths[-1]
        growth = [rows["user", hi, m]["compile_s"] / rows["user", lo, m]["compile_s"]
                  for m in ("none", "full") if ("user", hi, m) in rows]
        lines += ["", f"The user's compile at {hi} layers takes "
                  + " and ".join(f"{g:.2f}x" for g in growth)
                  + f" its {lo}-layer compile (remat none, full)."]
    lines += ["", f"fsdp 8 on 8 simulated CPU devices, batch {BATCH} x {SEQ}, d {D}, {HEADS} "
              f"heads ({KV} KV), ff {FF}; step ratios are medians of {a['rounds']} alternated "
              f"rounds of {a['steps']} steps."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
