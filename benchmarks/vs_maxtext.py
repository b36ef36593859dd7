"""jaxpar's training step against MaxText's on the same decoder, layout by layout.

    MAXTEXT_PYTHON=../maxtext-venv/bin/python python benchmarks/vs_maxtext.py \\
        [--layouts fsdp8,fsdp4xtensor2,data2xtensor4,stage2xfsdp4] [--rounds 5] [--steps 5]
        [--dump DIR] [--jaxpar-overrides k=v ...]

Both sides train the decoder of the issue that asked for this comparison (d_model 256,
4 layers, 4 heads of 64, 4 KV heads, SwiGLU d_ff 1024, vocab 32000, 20.6M parameters),
global batch 8 x sequence 128, float32 weights and compute, AdamW, on 8 simulated CPU
devices, both with MaxText's default remat policy (``full``: every layer recomputed in
the backward pass) and jaxpar with its defaults otherwise (``plan.vocab_over_fsdp`` left
at ``auto``: what its planner picks for this model and mesh). MaxText (0.2.4, an optional
dependency in its own virtual environment: see
docs/benchmarks/vs-maxtext.md for the install steps) is found through
``MAXTEXT_PYTHON`` or ``../maxtext-venv/bin/python``; without it the benchmark says so
and exits 0.

Each side runs in a worker process of its own (this file, ``--worker maxtext|jaxpar``)
that builds its trainer from its own configuration system, compiles the step, reports
the compiled program (collectives by kind with counts and bytes, FLOPs from XLA's cost
analysis, HLO instruction counts by kind) and then times steps on request. The workers
are alternated: ``--rounds`` rounds, each ``--steps`` blocking steps of one side then the
other (the order flips every round). The table gives each side's median step time (the
median over rounds of the per-round median) and the median of the per-round ratios.
MaxText's step is timed as its train loop runs it (``p_train_step`` on a batch of its
synthetic dataset); jaxpar's as ``Trainer.step_async`` + ``block_until_ready`` on a
fixed batch. FLOPs are XLA's cost analysis of each program, which counts a loop body
(the layer scan, the pipeline's iterations) once: comparable between the two programs
of a layout, not a count of the step's work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
D, HEADS, HEAD_DIM, FF, LAYERS, VOCAB_SIZE, SEQ, BATCH = 256, 4, 64, 1024, 4, 32000, 128, 8

# layout -> (MaxText mesh arguments, jaxpar overrides). jaxpar runs its defaults: the
# layout knobs left at auto (plan.vocab_over_fsdp) take what its planner picks for this
# model and mesh, as `jaxpar train` would (the worker prints what they became).
LAYOUTS: dict[str, tuple[list[str], list[str]]] = {
    "fsdp8": (["ici_fsdp_parallelism=8"], ["mesh.fsdp=8"]),
    "fsdp4xtensor2": (["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
                      ["mesh.fsdp=4", "mesh.tensor=2"]),
    "data2xtensor4": (["ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                       "ici_tensor_parallelism=4"], ["mesh.data=2", "mesh.tensor=4"]),
    "stage2xfsdp4": (["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
                      "num_pipeline_microbatches=2"],
                     ["mesh.stage=2", "mesh.fsdp=4", "pipeline.microbatches=2"]),
}

MAXTEXT_ARGS = [
    "run_name=vs_jaxpar", "hardware=cpu", "skip_jax_distributed_system=true",
    "dataset_type=synthetic", "steps=1000", f"base_emb_dim={D}",
    f"base_num_query_heads={HEADS}", f"base_num_kv_heads={HEADS}", f"base_mlp_dim={FF}",
    f"base_num_decoder_layers={LAYERS}", f"head_dim={HEAD_DIM}", f"vocab_size={VOCAB_SIZE}",
    "per_device_batch_size=1", f"max_target_length={SEQ}", "enable_checkpointing=false",
    "attention=dot_product", "dtype=float32", "weight_dtype=float32",
]

JAXPAR_ARGS = [
    f"model.d_model={D}", f"model.n_heads={HEADS}", f"model.n_kv_heads={HEADS}",
    f"model.d_ff={FF}", f"model.n_layers={LAYERS}", f"model.vocab_size={VOCAB_SIZE}",
    f"model.max_seq_len={SEQ}", f"train.seq_len={SEQ}", f"train.global_batch={BATCH}",
    "train.optimizer=adamw", "plan.precision=params=float32,compute=float32,output=float32",
    "plan.remat=full",  # MaxText's default remat policy: the same recomputation on both sides
]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.+?\s+([\w\-]+)\(", re.M)


def program_summary(hlo: str) -> dict:
    """Collectives (count and result bytes a device, by kind, read by
    :func:`jaxpar.analysis.hlo.parse_collectives`) and instruction counts by opcode of a
    compiled program's HLO text (every computation, fusion bodies included; a loop body
    once)."""
    sys.path.insert(0, str(ROOT))
    from jaxpar.analysis.hlo import parse_collectives

    coll = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for c in parse_collectives(hlo):
        coll[c.kind]["count"] += 1
        coll[c.kind]["bytes"] += c.bytes
    return {"collectives": coll, "ops": dict(Counter(_OP.findall(hlo)))}


# --- workers --------------------------------------------------------------------------------


def _serve(step, report: dict) -> None:
    """Print ``report`` as one JSON line, then answer each ``N`` read from stdin with the
    seconds of N blocking steps (a JSON list); stop at end of input."""
    print("READY " + json.dumps(report), flush=True)
    for line in sys.stdin:
        n = int(line)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print("TIMES " + json.dumps(times), flush=True)


def _compiled_report(compiled, dump: str | None, name: str) -> dict:
    hlo = compiled.as_text()
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        Path(dump, f"{name}.hlo.txt").write_text(hlo)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    return {"flops": float(cost.get("flops", 0.0)), "hlo": hlo,
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0))}


def maxtext_worker(layout: str, dump: str | None) -> None:
    """Build MaxText's train step as its own train loop does and serve timings."""
    import jax
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning
    from maxtext.trainers.pre_train import train as mt
    from maxtext.utils import sharding, train_utils

    config, recorder = mt.initialize(["train", *MAXTEXT_ARGS, *LAYOUTS[layout][0],
                                      "base_output_directory=" + os.environ["MT_OUT"]])
    (init_rng, _, shardings, model, mesh, _, _, loader, rampup, _, state
     ) = train_utils.setup_train_loop(config, recorder)
    linen = not config.pure_nnx
    jit_model = model
    if not linen and not config.enable_diloco:
        jit_model, state = nnx.split(state)
    params_sh, shardings = sharding.maybe_update_params_sharding_with_opt(config, shardings)
    p_step, _ = train_utils.jit_train_and_eval_step(config, jit_model, mesh, state, shardings,
                                                    mt.train_step, mt.eval_step, None,
                                                    params_sh)
    def rules():
        return nn_partitioning.axis_rules(config.logical_axis_rules)

    with jax.set_mesh(mesh), rules():
        batch = loader.load_next_batch(rampup_manager=rampup)
        extra = (init_rng,) if linen else ()
        compiled = p_step.lower(state, batch, *extra).compile()
    box = {"state": state}

    def step():
        with jax.set_mesh(mesh), rules():
            box["state"], metrics = p_step(box["state"], batch, *extra)
        jax.block_until_ready(metrics)

    step()
    step()
    _serve(step, _compiled_report(compiled, dump, f"{layout}.maxtext"))


def jaxpar_worker(layout: str, dump: str | None, overrides: list[str]) -> None:
    """Build jaxpar's trainer from ``configs/tiny.yaml`` with this model and serve timings."""
    import jax
    import numpy as np

    sys.path.insert(0, str(ROOT))
    import jaxpar

    config = jaxpar.load_config(str(ROOT / "configs/tiny.yaml"),
                                [*JAXPAR_ARGS, *LAYOUTS[layout][1], *overrides])
    run = jaxpar.assemble(config)  # auto knobs resolved, as jaxpar train does
    for line in run.auto:
        print(f"jaxpar {layout}: {line}", file=sys.stderr, flush=True)
    trainer = run.trainer
    tokens = np.random.default_rng(0).integers(0, VOCAB_SIZE, (BATCH, SEQ + 1), dtype=np.int32)
    batch = trainer.global_batch(tokens)
    compiled = trainer.lower(batch).compile()

    def step():
        jax.block_until_ready(trainer.step_async(batch))

    step()
    step()
    _serve(step, _compiled_report(compiled, dump, f"{layout}.jaxpar"))


# --- driver ---------------------------------------------------------------------------------


class Worker:
    """One side's worker process."""

    def __init__(self, python: str, side: str, layout: str, args, env: dict):
        cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--layouts", layout]
        if args.dump:
            cmd += ["--dump", args.dump]
        if side == "jaxpar":
            cmd += ["--jaxpar-overrides", *args.jaxpar_overrides]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        self.report = json.loads(self._read("READY"))
        self.report.update(program_summary(self.report.pop("hlo")))

    def _read(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return line[len(tag) + 1:]
        raise RuntimeError(f"worker exited before {tag} (rc {self.proc.wait()})")

    def times(self, steps: int) -> list[float]:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return json.loads(self._read("TIMES"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def maxtext_python() -> str | None:
    """The MaxText environment's interpreter: ``MAXTEXT_PYTHON`` or ``../maxtext-venv``."""
    for candidate in (os.environ.get("MAXTEXT_PYTHON"),
                      str(ROOT.parent / "maxtext-venv" / "bin" / "python")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def compare(layout: str, args, mt_python: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                         + " --xla_force_host_platform_device_count=8").strip(),
           "MT_OUT": args.maxtext_out}
    workers = {"maxtext": Worker(mt_python, "maxtext", layout, args, env),
               "jaxpar": Worker(sys.executable, "jaxpar", layout, args, env)}
    rounds: dict[str, list[float]] = {s: [] for s in workers}
    try:
        for r in range(args.rounds):
            for side in (("jaxpar", "maxtext") if r % 2 == 0 else ("maxtext", "jaxpar")):
                rounds[side].append(statistics.median(workers[side].times(args.steps)))
            print(f"  {layout} round {r}: jaxpar {rounds['jaxpar'][-1] * 1e3:.0f} ms, "
                  f"maxtext {rounds['maxtext'][-1] * 1e3:.0f} ms", flush=True)
    finally:
        for w in workers.values():
            w.close()
    ratios = [j / m for j, m in zip(rounds["jaxpar"], rounds["maxtext"], strict=True)]
    return {"rounds": rounds, "ratio": statistics.median(ratios),
            "ratio_range": (min(ratios), max(ratios)),
            "ms": {s: statistics.median(v) * 1e3 for s, v in rounds.items()},
            "programs": {s: w.report for s, w in workers.items()}}


def _coll(report: dict) -> str:
    c = report["collectives"]
    return " ".join(f"{c[k]['count']}/{c[k]['bytes'] / 1e6:.1f}" for k in KINDS)


def _op_diff(result: dict) -> list[str]:
    """``"kind jaxpar|MaxText"`` for each HLO instruction kind whose counts in the two
    programs differ by more than 10% of the larger (of 5 when both are smaller)."""
    oj, om = result["programs"]["jaxpar"]["ops"], result["programs"]["maxtext"]["ops"]
    return [f"{k} {oj.get(k, 0)}|{om.get(k, 0)}" for k in sorted(set(oj) | set(om))
            if abs(oj.get(k, 0) - om.get(k, 0)) > 0.1 * max(oj.get(k, 0), om.get(k, 0), 5)]


def print_table(results: dict) -> None:
    print(f"\n{'layout':15} {'jaxpar ms':>9} {'MaxText ms':>10} {'ratio':>6} {'[min-max]':>11}"
          f"  {'GFLOP j/m':>11}  collectives count/MB a device "
          "(AR AG RS A2A CP): jaxpar | MaxText")
    for name, r in results.items():
        pj, pm = r["programs"]["jaxpar"], r["programs"]["maxtext"]
        lo, hi = r["ratio_range"]
        print(f"{name:15} {r['ms']['jaxpar']:9.0f} {r['ms']['maxtext']:10.0f} "
              f"{r['ratio']:6.3f} [{lo:.2f}-{hi:.2f}]  {pj['flops'] / 1e9:5.2f}/"
              f"{pm['flops'] / 1e9:5.2f}  {_coll(pj)} | {_coll(pm)}")
    print("\nHLO instructions by kind (jaxpar | MaxText), where they differ by > 10%:")
    for name, r in results.items():
        print(f"  {name}: " + ", ".join(_op_diff(r)))


# --- the site's tables (docs/hooks/generated.py) --------------------------------------------

COMMAND = ("python benchmarks/vs_maxtext.py --rounds 5 --steps 3 "
           "--save benchmarks/results/vs_maxtext.json")
"""The command that wrote ``benchmarks/results/vs_maxtext.json``."""

_SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
          "collective-permute": "CP"}


def _layout_name(name: str) -> str:
    """``fsdp4xtensor2`` -> ``fsdp 4 x tensor 2`` (from :data:`LAYOUTS`' jaxpar mesh)."""
    if name not in LAYOUTS:
        return name
    over = dict(o.split("=", 1) for o in LAYOUTS[name][1])
    mesh = " x ".join(f"{k[5:]} {v}" for k, v in over.items() if k.startswith("mesh."))
    micro = over.get("pipeline.microbatches")
    return mesh + (f" ({micro} microbatches)" if micro else "")


def _coll_md(report: dict) -> str:
    """``6 AR 6.3 MB, 18 AG 10.5 MB, 2 A2A``: each kind present, its count and (where the
    bytes reach 0.1 MB) its result bytes a device."""
    out = []
    for kind in KINDS:
        c = report["collectives"][kind]
        if c["count"]:
            mb = f" {c['bytes'] / 1e6:.1f} MB" if c["bytes"] >= 5e4 else ""
            out.append(f"{c['count']} {_SHORT[kind]}{mb}")
    return ", ".join(out) or "none"


def markdown(results: dict) -> str:
    """The tables :func:`print_table` prints, as markdown, from the saved results."""
    lines = ["| layout (8 CPU devices) | jaxpar ms | MaxText ms | jaxpar / MaxText (range) "
             "| GFLOP jaxpar / MaxText | collectives a device, jaxpar | MaxText |",
             "|---|---:|---:|---|---|---|---|"]
    for name, r in results.items():
        pj, pm = r["programs"]["jaxpar"], r["programs"]["maxtext"]
        lo, hi = r["ratio_range"]
        lines.append(f"| {_layout_name(name)} | {r['ms']['jaxpar']:.0f} | "
                     f"{r['ms']['maxtext']:.0f} | **{r['ratio']:.3f}** ({lo:.2f}-{hi:.2f}) | "
                     f"{pj['flops'] / 1e9:.2f} / {pm['flops'] / 1e9:.2f} | {_coll_md(pj)} | "
                     f"{_coll_md(pm)} |")
    rounds = {len(v) for r in results.values() for v in r["rounds"].values()}
    lines += ["", f"Times are the median over {', '.join(map(str, sorted(rounds)))} alternated "
              "rounds of each round's median step; the ratio is the median of the per-round "
              "ratios, its range their lowest and highest. AR all-reduce, AG all-gather, RS "
              "reduce-scatter, A2A all-to-all, CP collective-permute; bytes are each "
              "collective's result bytes a device, summed, a loop body counted once, as are "
              "XLA's FLOPs.", "",
              "HLO instructions by kind where the two programs' counts differ by more than "
              "10%:", "",
              "| layout | instruction: count in jaxpar's program / in MaxText's |", "|---|---|"]
    for name, r in results.items():
        diff = ", ".join(d.replace("|", " / ") for d in _op_diff(r))
        lines.append(f"| {_layout_name(name)} | {diff or 'none'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps a round and side")
    parser.add_argument("--dump", help="write each compiled program's HLO text here")
    parser.add_argument("--save", help="write the results as JSON")
    parser.add_argument("--maxtext-out", default="/tmp/jaxpar_vs_maxtext",
                        help="MaxText's base_output_directory")
    parser.add_argument("--jaxpar-overrides", nargs="*", default=[],
                        help="extra jaxpar config overrides (e.g. plan.remat=full)")
    parser.add_argument("--worker", choices=("maxtext", "jaxpar"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "maxtext":
        maxtext_worker(args.layouts, args.dump)
        return 0
    if args.worker == "jaxpar":
        jaxpar_worker(args.layouts, args.dump, args.jaxpar_overrides)
        return 0
    mt_python = maxtext_python()
    if mt_python is None:
        print("MaxText not found (set MAXTEXT_PYTHON to its environment's python, or install "
              "it in ../maxtext-venv as docs/benchmarks/vs-maxtext.md says): skipped")
        return 0
    results = {}
    for layout in args.layouts.split(","):
        results[layout] = compare(layout, args, mt_python)
    print_table(results)
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
