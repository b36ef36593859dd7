"""Per-device memory of each ZeRO strategy: measured arrays, XLA's compiled figures, formula.

    python benchmarks/memory.py [--config configs/tiny.yaml] [--devices 8] [--json]
        [key=value ...]

For every strategy (ZeRO 0-3 on the data axis, and ZeRO-3 x tensor parallelism) it builds
the trainer with the mixed-precision policy p=f32,c=bf16,o=f32, measures the bytes one
device holds of parameters (bf16 working copy), gradients (as the stage stores them) and
optimizer state (f32 master weights and Adam moments), compiles one train step and reads
XLA's per-device argument/output/temp bytes, and prints them beside the ZeRO formula.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print rows as a JSON list")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import jax

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    import jaxpar
    from jaxpar.analysis.hlo import memory_stats
    from jaxpar.config.assembly import build_trainer
    from jaxpar.runs.loop import make_loader

    n = args.devices
    strategies = {f"zero{s}": [f"mesh.data={n}", "mesh.fsdp=1", "mesh.tensor=1",
                               f"plan.zero_stage={s}"] for s in range(4)}
    strategies["zero3_tp2"] = [f"mesh.data={n // 2}", "mesh.fsdp=1", "mesh.tensor=2",
                               "plan.zero_stage=3"]
    rows = []
    for name, knobs in strategies.items():
        config = jaxpar.load_config(args.config, [
            *args.overrides, *knobs, "plan.precision=p=f32,c=bf16,o=f32"])
        trainer = build_trainer(config)
        batch = make_loader(config).batch(0)
        report = trainer.memory_report(batch)
        xla = memory_stats(trainer.lower(batch).compile())
        measured = report["param_bytes"] + report["grad_bytes"] + report["opt_bytes"]
        rows.append({
            "strategy": name, "n_params": report["n_params"],
            "param_bytes": report["param_bytes"], "grad_bytes": report["grad_bytes"],
            "opt_bytes": report["opt_bytes"], "formula_bytes": int(report["formula_bytes"]),
            "ratio": measured / report["formula_bytes"],
            "xla_argument_bytes": xla.get("argument_bytes", 0),
            "xla_output_bytes": xla.get("output_bytes", 0),
            "xla_temp_bytes": xla.get("temp_bytes", 0),
        })
        del trainer
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    mib = lambda b: f"{b / 2**20:9.2f}"
    print(f"model {rows[0]['n_params'] / 1e6:.1f}M params, {n} devices, "
          "precision p=f32,c=bf16,o=f32; MiB per device")
    print(f"{'strategy':10} {'params':>9} {'grads':>9} {'opt':>9} {'total':>9} "
          f"{'formula':>9} {'ratio':>6} {'xla_arg':>9} {'xla_out':>9} {'xla_temp':>9}")
    for r in rows:
        total = r["param_bytes"] + r["grad_bytes"] + r["opt_bytes"]
        print(f"{r['strategy']:10} {mib(r['param_bytes'])} {mib(r['grad_bytes'])} "
              f"{mib(r['opt_bytes'])} {mib(total)} {mib(r['formula_bytes'])} "
              f"{r['ratio']:6.3f} {mib(r['xla_argument_bytes'])} {mib(r['xla_output_bytes'])} "
              f"{mib(r['xla_temp_bytes'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
