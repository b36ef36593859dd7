"""Long context on the TPU compiler: Llama 3.1 8B at 32k, 64k and 128k tokens a sequence,
the sequence split over ``context`` (2, 4, 8; fsdp over the rest of the slice), attention
on the splash kernel per device against the plain-JAX blocks, compiled for a v5p and a v6e
slice by libtpu's compiler on this CPU host (no TPU needed).

Each row: per-device memory (arguments + temporaries, the compiler's), whether it fits the
chip, the Mosaic kernels in the program (``tpu_custom_call``), the compile time, and the
planner's memory and step time for the same program. One sequence per fsdp shard; the
ring context attention in the balanced layout; the layers' inputs in host memory
(``configs/llama-8b.yaml``'s remat).

    python benchmarks/long_context.py                       # every row, ~20 min
    python benchmarks/long_context.py --only 0,1 --save benchmarks/results/long_context.json
    python benchmarks/long_context.py --replan benchmarks/results/long_context.json \\
        --save benchmarks/results/long_context.json   # the planner's columns anew
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxpar.analysis.report import fmt_bytes, table

SLICES = ("tpu-v5p:2x4x4", "tpu-v6e:4x8")
"""32 chips each: v5p (95 GiB HBM a chip) and v6e (32 GiB)."""
LENGTHS = ((32768, 2), (65536, 4), (131072, 8))
"""(tokens a sequence, context ways)."""
ATTENTION = ("splash", "xla")
COMMAND = "python benchmarks/long_context.py --save benchmarks/results/long_context.json"
"""The command the saved results come from (the docs page names it)."""


def rows() -> list[dict]:
    """Every (slice, length, attention) combination, in table order."""
    return [{"target": target, "seq": seq, "context": context, "attention": attention}
            for target in SLICES for seq, context in LENGTHS for attention in ATTENTION]


def row_config(row: dict, devices: int):
    """The row's run config: ``configs/llama-8b.yaml`` at the row's length and layout."""
    from jaxpar.config.schema import load_config

    fsdp = devices // row["context"]
    return load_config("configs/llama-8b.yaml", [
        f"train.seq_len={row['seq']}", f"model.max_seq_len={row['seq']}",
        f"train.global_batch={fsdp}", f"mesh.fsdp={fsdp}", f"mesh.context={row['context']}",
        "plan.context_attention=ring", f"model.attention={row['attention']}"])


def planner(row: dict) -> dict:
    """The planner's memory, step time and MFU for the row's config on its slice."""
    from jaxpar.analysis.inspection import planner_prediction
    from jaxpar.analysis.targets import tpu_target

    target = tpu_target(row["target"])
    pred, note = planner_prediction(row_config(row, len(target.devices)),
                                    len(target.devices), target)
    if pred is None:
        raise RuntimeError(note)
    return {"planner_bytes": pred["memory"]["total_bytes"],
            "planner_step_s": pred.get("step_time_s"), "planner_mfu": pred.get("mfu")}


def measure(row: dict) -> dict:
    """Compile the row's step for its slice; the compiler's figures beside the planner's."""
    from jaxpar.analysis.inspection import StepDoesNotFit, compile_step, step_report
    from jaxpar.analysis.targets import tpu_target

    target = tpu_target(row["target"])
    config = row_config(row, len(target.devices))
    start = time.perf_counter()
    out = {**row, "hbm_bytes": target.hbm_bytes, **planner(row)}
    try:
        report = step_report(compile_step(config, target))
    except StepDoesNotFit as err:
        return {**out, "fits": False, "compiler_bytes": None,
                "temp_at_least": err.temp_bytes, "kernels": None,
                "compile_s": time.perf_counter() - start}
    mem = report["memory"]
    return {**out, "fits": mem["fits"], "compiler_bytes": mem["total_bytes"],
            "temp_bytes": mem["temp_bytes"],
            "kernels": report["kernels"].get("tpu_custom_call", 0),
            "compile_s": report["header"]["compile_s"]}


def _columns(r: dict) -> list[str]:
    mem = (fmt_bytes(r["compiler_bytes"]) if r["compiler_bytes"] is not None
           else f">= {fmt_bytes(r['temp_at_least'])}")
    plan = fmt_bytes(r["planner_bytes"]) if r.get("planner_bytes") else "-"
    step = f"{r['planner_step_s']:.2f} s" if r.get("planner_step_s") else "-"
    mfu = f"{r['planner_mfu']:.0%}" if r.get("planner_mfu") else "-"
    kernels = "-" if r["kernels"] is None else str(r["kernels"])
    return [r["target"], f"{r['seq'] // 1024}k", str(r["context"]), r["attention"], mem,
            "yes" if r["fits"] else "no", plan, kernels, step, mfu, f"{r['compile_s']:.0f} s"]


HEADER = ["slice", "seq", "context", "attention", "compiler memory", "fits",
          "planner memory", "Mosaic kernels", "planner step", "planner MFU", "compile"]


def render(results: list[dict]) -> str:
    return table(HEADER, [_columns(r) for r in results])


def markdown(results: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_columns(r)) + " |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="row indices, comma separated")
    parser.add_argument("--save", type=Path, help="write the rows as JSON here")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--replan", type=Path,
                        help="saved rows: recompute the planner's columns only (seconds)")
    args = parser.parse_args(argv)
    if args.replan:
        results = [{**r, **planner(r)} for r in json.loads(args.replan.read_text())]
        if args.save:
            args.save.write_text(json.dumps(results, indent=1) + "\n")
        print(markdown(results) if args.markdown else render(results))
        return 0
    todo = rows()
    if args.only:
        todo = [todo[int(i)] for i in args.only.split(",")]
    results = []
    for row in todo:
        results.append(measure(row))
        print(render(results[-1:]), flush=True)
        if args.save:
            args.save.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results) if args.markdown else render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
