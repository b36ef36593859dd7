"""The planner's step-time model against measured steps, on 8 simulated CPU devices.

    python benchmarks/planner_cpu.py [--catalog FILE [--name NAME]] [--rounds 3] [--steps 3]
        [--layouts a,b,...] [--save benchmarks/results/planner_cpu.json]

(a) Calibrates this machine (``jaxpar.planner.calibrate``, as ``jaxpar calibrate``
does) or reads the chip ``NAME`` from ``--catalog``; (b) for each layout of
:data:`LAYOUTS` (a small decoder: d_model 256, 4 layers, 8 heads, d_ff 1024, vocab
4096, seq 128, global batch 16, float32; the ``moe`` layout swaps the MLP for 4 experts,
2 per token) predicts the step time with ``jaxpar.planner.prediction`` on the calibrated
chip, then builds the trainer (``jaxpar.build_trainer``) and measures it: a warm-up (the
first step compiles), then ``--rounds`` rounds over all layouts in turn (the order
reversed every other round), each the median of ``--steps`` blocking steps; a layout's
time is the median over rounds. ``jaxpar.planner.plan``'s own winner for ``cpu:8`` at
float32 (on the first calibration) is measured too, as the layout ``plan``. When the
script calibrates, it calibrates again at the start of every round and predicts with each
figure's median over all calibrations: this shared host's speed drifts by a third over
minutes, and a calibration taken once, before the rounds, prices steps run at another
speed. It prints
predicted and measured seconds, their ratio, both ranks, and whether the planner's first
choice (the lowest prediction, the winner when the search found the best) is among the
two fastest measured. (c) ``--save`` writes the chip, the layouts and the measured times
as JSON; ``tests/planner/test_planner_cpu_ranking.py`` re-predicts them with the current cost
model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

N_DEVICES = 8
MODEL = ["model.vocab_size=4096", "model.d_model=256", "model.n_layers=4",
         "model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=1024", "model.max_seq_len=128",
         "train.global_batch=16", "train.seq_len=128", "train.optimizer=adamw",
         "plan.precision=params=float32,compute=float32,output=float32"]
MOE = ["model.n_experts=4", "model.experts_per_token=2", "model.expert_d_ff=512"]

# name -> config overrides (each replaces the whole mesh: axes left out are 1).
LAYOUTS: dict[str, list[str]] = {
    "data8": ["mesh.data=8"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8"],
    "tensor8": ["mesh.data=1", "mesh.tensor=8"],
    "fsdp4xtensor2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
    "data2xtensor4": ["mesh.data=2", "mesh.tensor=4"],
    "data4xtensor2": ["mesh.data=4", "mesh.tensor=2"],
    "stage2xdata4": ["mesh.data=4", "mesh.stage=2"],
    "context2xdata4": ["mesh.data=4", "mesh.context=2"],
    "moe:expert4xfsdp2": ["mesh.data=1", "mesh.expert=4", "mesh.fsdp=2", *MOE],
    "data8-zero1": ["mesh.data=8", "plan.zero_stage=1"],
    "data8-zero3": ["mesh.data=8", "plan.zero_stage=3"],
    "fsdp8-remat": ["mesh.data=1", "mesh.fsdp=8", "plan.remat=full"],
    "fsdp4xtensor2-remat": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "plan.remat=full"],
}


def layout_config(overrides: list[str]):
    """The run config of one layout (the base model, then the layout's overrides)."""
    import jaxpar

    return jaxpar.load_config("configs/tiny.yaml", [*MODEL, *overrides])


def predict_layout(overrides: list[str], chip) -> dict:
    """Predicted step seconds and the estimate's breakdown on ``N_DEVICES`` x ``chip``."""
    from jaxpar.planner.catalog import Machine
    from jaxpar.planner.cost import estimate
    from jaxpar.planner.prediction import candidate_from_config, spec_from_config

    config = layout_config(overrides)
    cand = candidate_from_config(config, N_DEVICES)
    spec = spec_from_config(config, cand.sizes["stage"])
    est = estimate(spec, Machine(chip, N_DEVICES, 1), cand, config.train.global_batch,
                   config.train.seq_len, backend="cpu")
    return {"step_s": est.step_time_s, "breakdown": dict(est.breakdown)}


def planner_choice(chip) -> tuple[list[str], str]:
    """``jaxpar.planner.plan``'s winner for the dense model on ``cpu:8`` at float32: its
    config overrides (measured as the layout ``plan``) and a description."""
    from jaxpar.planner import plan
    from jaxpar.planner.catalog import Machine
    from jaxpar.sharding.mesh import MESH_AXES

    config = layout_config([])
    best = plan(config, chips=Machine(chip, N_DEVICES, 1), global_batch=16, seq=128,
                precision="float32", top=1)[0]
    c = best.candidate
    sizes = c.sizes
    overrides = [f"mesh.{a}={sizes[a]}" for a in MESH_AXES] + [
        f"plan.zero_stage={c.zero_stage}", f"plan.remat={c.remat}",
        f"plan.microbatches={c.microbatches}",
        f"plan.sequence_parallel={str(c.sequence_parallel and sizes['tensor'] > 1).lower()}",
        f"plan.context_attention={c.context_attention}",
        f"plan.vocab_over_fsdp={str(c.vocab_over_fsdp and sizes['fsdp'] > 1).lower()}",
        f"pipeline.microbatches={c.pipeline_microbatches}"]
    return overrides, (f"{c.describe()} zero{c.zero_stage} remat={c.remat} "
                       f"mb={c.microbatches} ({best.step_time_s:.3f} s predicted)")


def measure(names: list[str], rounds: int, steps: int, layouts: dict[str, list[str]],
            between: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Median step seconds of each layout per round (layouts alternated); ``between``
    runs at the start of every round (a calibration, so that its figures sample the
    same machine as the steps)."""
    import jax
    import numpy as np

    import jaxpar

    runs = {}
    for name in names:
        config = layout_config(layouts[name])
        t0 = time.perf_counter()
        trainer = jaxpar.build_trainer(config)
        t = config.train
        tokens = np.random.default_rng(0).integers(0, config.model.vocab_size,
                                                   (t.global_batch, t.seq_len + 1),
                                                   dtype=np.int32)
        batch = trainer.global_batch(tokens)
        jax.block_until_ready(trainer.step(batch))  # compiles
        jax.block_until_ready(trainer.step(batch))
        runs[name] = (trainer, batch)
        print(f"  built {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        if between is not None:
            between()
        for name in (names if r % 2 == 0 else names[::-1]):
            trainer, batch = runs[name]
            got = []
            for _ in range(steps):
                t0 = time.perf_counter()
                jax.block_until_ready(trainer.step(batch))
                got.append(time.perf_counter() - t0)
            times[name].append(statistics.median(got))
        print(f"  round {r}: " + ", ".join(f"{n} {times[n][-1]:.3f}" for n in names),
              flush=True)
    return times


def median_figures(entries: list[dict]) -> dict:
    """Each numeric figure's median over ``entries`` (the lower median for whole numbers,
    such as the matmul tile); anything else as the first entry has it."""
    out = dict(entries[0])
    for key, value in out.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        values = [e[key] for e in entries]
        out[key] = (statistics.median_low(values) if isinstance(value, int)
                    else statistics.median(values))
    return out


def describe_calibrations(entries: list[dict]) -> str:
    """The figures that drift, each as its values over ``entries`` (in giga units)."""
    shown = (("f32 GFLOP/s", "f32_flops", ".1f"), ("memory GB/s", "hbm_bw", ".2f"),
             ("saved GB/s", "saved_bw", ".3f"), ("collective GB/s", "ici_bw", ".2f"))
    return "; ".join(f"{label} " + ", ".join(f"{e[key] / 1e9:{fmt}}" for e in entries)
                     for label, key, fmt in shown)


def ranks(values: dict[str, float]) -> dict[str, int]:
    """1 for the smallest value."""
    return {n: i + 1 for i, n in enumerate(sorted(values, key=values.get))}


def simulate_devices() -> None:
    """8 simulated CPU devices for the jax this process imports next."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={N_DEVICES}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def table_rows(pred: dict[str, float], measured: dict[str, float]) -> list[tuple]:
    """``(layout, predicted s, measured s, ratio, rank predicted, rank measured)`` a row."""
    rp, rm = ranks(pred), ranks(measured)
    return [(n, pred[n], measured[n], pred[n] / measured[n], rp[n], rm[n]) for n in pred]


def verdict(pred: dict[str, float], measured: dict[str, float]) -> tuple[str, str]:
    """The planner's first choice against the two fastest measured, and the errors."""
    first = min(pred, key=pred.get)
    two = sorted(measured, key=measured.get)[:2]
    worst = max(pred, key=lambda n: abs(pred[n] / measured[n] - 1))
    within = sum(abs(pred[n] / measured[n] - 1) <= 0.25 for n in pred)
    return (f"planner's first choice among these: {first}; two fastest measured: "
            f"{', '.join(two)} -> {'OK' if first in two else 'MISSED'}",
            f"largest error: {worst} ({pred[worst] / measured[worst] - 1:+.0%}); within 25%: "
            f"{within}/{len(pred)}")


def text_table(pred: dict[str, float], measured: dict[str, float]) -> str:
    """The table this script prints."""
    lines = [f"{'layout':22} {'predicted s':>11} {'measured s':>10} {'ratio':>6} "
             f"{'rank pred':>9} {'rank meas':>9}"]
    lines += [f"{n:22} {p:11.3f} {m:10.3f} {r:6.2f} {a:9d} {b:9d}"
              for n, p, m, r, a, b in table_rows(pred, measured)]
    return "\n".join([*lines, "", *verdict(pred, measured)])


# --- the site's table (docs/hooks/generated.py) ---------------------------------------------

COMMAND = ("python benchmarks/planner_cpu.py --rounds 5 --steps 3 "
           "--save benchmarks/results/planner_cpu.json")
"""The command that wrote ``benchmarks/results/planner_cpu.json``."""


def markdown(results: dict) -> str:
    """The printed table as markdown, from saved results (the predictions as saved)."""
    layouts = results["layouts"]
    pred = {n: r["predicted_s"] for n, r in layouts.items()}
    measured = {n: r["measured_s"] for n, r in layouts.items()}
    rounds = {len(r["rounds_s"]) for r in layouts.values()}
    lines = ["| layout | config overrides | predicted s | measured s | predicted / measured "
             "| rank predicted | rank measured |", "|---|---|---:|---:|---:|---:|---:|"]
    for n, p, m, r, a, b in table_rows(pred, measured):
        over = ("the planner's winner: " + results["plan_winner"].split(" (")[0]
                if n == "plan" and "plan_winner" in results
                else ", ".join(f"`{o}`" for o in layouts[n]["overrides"]))
        lines.append(f"| {n} | {over} | {p:.3f} | {m:.3f} | {r:.2f} | {a} | {b} |")
    first, errors = verdict(pred, measured)
    lines += ["", f"{first[0].upper()}{first[1:]}; {errors}.", ""]
    model = ", ".join(f"`{o}`" for o in results["model_overrides"])
    lines.append(f"Measured {results['date']} on {results['devices']} simulated CPU devices, "
                 f"the model {model} on `configs/tiny.yaml`. A layout's measured time is the "
                 f"median over {', '.join(map(str, sorted(rounds)))} alternated rounds of "
                 "each round's median step; its prediction is the planner's step time on the "
                 "calibrated chip below, as the script computed it then.")
    if results.get("calibrations"):
        lines += ["", f"Calibrations (before the rounds, then one a round; the chip is each "
                  f"figure's median): {describe_calibrations(results['calibrations'])}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    simulate_devices()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--catalog", help="catalog YAML from jaxpar calibrate (default: "
                                          "calibrate now)")
    parser.add_argument("--name", default="cpu8", help="the chip's entry in --catalog")
    parser.add_argument("--quick-calibration", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--save", help="write the results as JSON")
    args = parser.parse_args(argv)
    import jax

    from jaxpar.planner.catalog import chip_from_mapping, load_catalog

    assert jax.device_count() == N_DEVICES, jax.devices()
    names = args.layouts.split(",")
    measurements = None
    if args.catalog:
        chip = load_catalog(args.catalog)[args.name]
        import dataclasses

        figures = {k: v for k, v in dataclasses.asdict(chip).items() if k != "name"}
    else:
        from jaxpar.planner.calibrate import calibrate, summary

        entry = calibrate(quick=args.quick_calibration)
        print(summary(entry), flush=True)
        measurements = entry.pop("measurements")
        figures = entry
        chip = chip_from_mapping(args.name, figures)
        calibrations = [figures]

        def recalibrate() -> None:
            again = calibrate(quick=args.quick_calibration)
            again.pop("measurements")
            calibrations.append(again)
    layouts = {n: LAYOUTS[n] for n in names}
    winner, described = planner_choice(chip)
    print(f"jaxpar.planner.plan's winner for cpu:8 at float32: {described}; measured as "
          "the layout 'plan'", flush=True)
    layouts["plan"] = winner
    names = [*names, "plan"]
    times = measure(names, args.rounds, args.steps, layouts,
                    between=None if args.catalog else recalibrate)
    if not args.catalog:
        # This shared host's speed drifts by a third over minutes: the figures are the
        # median of the calibration before the rounds and one at the start of each.
        figures = median_figures(calibrations)
        chip = chip_from_mapping(args.name, figures)
        print("\ncalibrations (before the rounds, then one a round): "
              + describe_calibrations(calibrations), flush=True)
    predicted = {n: predict_layout(layouts[n], chip) for n in names}
    measured = {n: statistics.median(v) for n, v in times.items()}
    pred = {n: predicted[n]["step_s"] for n in names}
    print()
    print(text_table(pred, measured))
    if args.save:
        out = {"chip": {"name": args.name, **figures},
               "devices": N_DEVICES, "model_overrides": MODEL,
               "command": "python benchmarks/planner_cpu.py " + " ".join(argv or sys.argv[1:]),
               "date": time.strftime("%Y-%m-%d %H:%M"),
               "plan_winner": described,
               "calibrations": None if args.catalog else calibrations,
               "layouts": {n: {"overrides": layouts[n], "predicted_s": pred[n],
                               "measured_s": measured[n], "rounds_s": times[n],
                               "breakdown": predicted[n]["breakdown"]} for n in names},
               "calibration_measurements": measurements}
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
