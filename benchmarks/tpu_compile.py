"""The planner against the TPU compiler, at pod scale, on this CPU host.

For published runs of ``benchmarks/published_runs.yaml`` (model, layout, batch, sequence,
remat and the TPU slice they ran on), jaxpar's training step of the same model and layout
is built from shapes alone and compiled for that slice by libtpu's compiler
(``jaxpar.analysis.inspection.compile_step``; no TPU is needed), then set beside the
planner's prediction: memory per device, whether it fits the chip's HBM, the collectives
of one step by kind (bytes a device receives, each instruction times its loops' trips, a
collective matmul's permutes and the all-reduces the compiler gathers or reduce-scatters
with under the gather or reduce-scatter they make up, at the bytes they move:
``jaxpar.analysis.hlo.collective_table``; the planner prices the same forms,
``jaxpar.planner.lowering``), and the compile time.

Remat: MaxText's policies become jaxpar's closest (:func:`jaxpar_remat`): a custom list
that offloads the decoder layer's input to the host becomes ``offload:layer_input`` (the
layer's input in host memory, the rest recomputed), ``minimal`` becomes
``dots_with_no_batch_dims_saveable``, other recompute lists ``full``. The planner is
asked about that same policy, so both sides describe one program. A step the
TPU compiler refuses (its temporaries beyond HBM) is a row that does not fit, with the
temporaries the compiler reported.

    python benchmarks/tpu_compile.py                 # the default selection, ~30 min
    python benchmarks/tpu_compile.py --only 0,16     # rows by index in the YAML
    python benchmarks/tpu_compile.py --save benchmarks/results/tpu_compile.json
    python benchmarks/tpu_compile.py --replan benchmarks/results/tpu_compile.json \\
        --save benchmarks/results/tpu_compile.json   # the planner's columns anew, ~5 s
    python benchmarks/tpu_compile.py --hlo DIR ...  # keep each compiled program's HLO in
        # DIR (gzipped); with --replan, the compiler's collectives are read from it anew
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jaxpar.analysis.report import fmt_bytes, table

if TYPE_CHECKING:
    from jaxpar.config.schema import Config

HERE = Path(__file__).resolve().parent


def _published():
    """``benchmarks/published.py`` (the published runs and their jaxpar models), imported
    when first needed: it brings in the planner."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import published

    return published


DEFAULT = (
    "tpu-recipes Llama3.1-8B v6e-8 seq8192 bf16",
    "tpu-recipes Mistral-7B v6e-8 seq8192 bf16",
    "tpu-recipes Llama3.1-8B v6e-256 seq8192 bf16",
    "tpu-recipes Llama3.1-70B v6e-256 seq8192 bf16",
    "tpu-recipes Llama2-70B v6e-256 seq4096 bf16",
    "tpu-recipes Llama3.1-405B 2x v6e-256 seq8192 bf16",
    "MaxText tiering Llama2-70B v5p 512 chips seq4096 bf16",
    "MaxText 32B synthetic 1x v5p-128 seq2048 bf16",
    "MaxText 64B synthetic 2x v5p-128 seq2048 bf16",
    "MaxText 16B synthetic 2x v5e-256 seq2048 bf16",
    "MaxText 22B synthetic 1x v4-128 seq1024 bf16",
    "MaxText 128B synthetic 1x v5e-256 seq2048 bf16",
    "tpu-recipes Llama3.1-70B tpu7x-4x4x4 (64 chips) seq8192 bf16",
)
"""Runs compiled by default: Llama 3.1 8B, 70B and 405B (two slices) and Llama 2 70B on v6e,
Mistral 7B, a tensor-parallel v5p run, a multislice v5p and v5e run, v4, a 70B on 512 v5p
chips, and a 70B on 64 TPU7x chips."""

def jaxpar_remat(run: dict) -> str:
    """The jaxpar remat policy closest to the run's own (MaxText's names in
    ``remat_source``): layer inputs offloaded to the host -> ``offload:layer_input`` (the
    rest recomputed), ``minimal`` -> ``dots_with_no_batch_dims_saveable``, no remat ->
    ``none``, anything else -> ``full``."""
    source = str(run.get("remat_source", run.get("remat", "none")))
    if "offload decoder_layer_input" in source:
        return "offload:layer_input"
    if source == "minimal":
        return "dots_with_no_batch_dims_saveable"
    return "none" if run.get("remat", "none") == "none" else "full"


def run_config(run: dict, devices_per_chip: int = 1) -> Config:
    """The published run as a jaxpar run config (bf16 compute, f32 master weights); on
    chips that expose two devices (TPU7x's two TensorCores), its largest in-slice axis
    spans both."""
    from jaxpar.config.schema import Config, from_dict
    from jaxpar.sharding.mesh import MESH_AXES

    cand = _published().candidate(run)
    ici = {a: dict(cand.ici).get(a, 1) for a in MESH_AXES}
    ici[max(ici, key=ici.get)] *= devices_per_chip
    model = {**_published().model_config(run).__dict__, "loss_chunk": 1024}
    remat = jaxpar_remat(run)
    return from_dict(Config, {
        "model": model,
        "mesh": {**ici,
                 **{f"dcn_{a}": dict(cand.dcn).get(a, 1) for a in MESH_AXES}},
        # MaxText's rules split the residual stream's embedding over the tensor axis; the
        # same bytes per device here are sequence parallelism's split.
        "plan": {"rules": "fsdp_tp", "zero_stage": run.get("zero_stage", 0), "remat": remat,
                 "sequence_parallel": ici["tensor"] > 1,
                 "microbatches": run.get("microbatches", 1),
                 "precision": "params=float32,compute=bfloat16,output=float32"},
        "train": {"global_batch": run["global_batch"], "seq_len": run["seq"]},
    })


def run_topology(run: dict) -> str:
    """The run's slice as a TPU target name, e.g. ``tpu-v4:4x4x4``."""
    from jaxpar.analysis.targets import topology_for

    kind, count = run["chips"].split(":")
    return f"{kind}:{topology_for(kind, int(count) // run.get('slices', 1))}"


def _target(run: dict):
    from jaxpar.analysis.targets import tpu_target

    return tpu_target(run_topology(run), run.get("slices", 1))


def _hlo_path(hlo_dir: Path, run: dict) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in run["name"]).strip("-")
    return hlo_dir / f"{slug}.hlo.gz"


SIGNIFICANT = 0.02
"""A collective kind counts towards a run's per-kind agreement when it carries at least
this share of the step's bytes on the wire (on either side)."""


def collective_figures(comparison: list[dict]) -> dict:
    """Per-step wire bytes of a run's collectives on both sides, by kind (mesh axes
    summed), and how many of the significant kinds agree within 15%."""
    kinds: dict[str, list[float]] = {}
    for c in comparison:
        both = kinds.setdefault(c["kind"], [0.0, 0.0])
        both[0] += c.get("predicted_wire_bytes_per_step") or 0.0
        both[1] += c.get("wire_bytes_per_step") or 0.0
    planner, compiler = (sum(v[i] for v in kinds.values()) for i in (0, 1))
    significant = {k: v for k, v in kinds.items()
                   if max(v[0] / planner if planner else 0, v[1] / compiler if compiler else 0)
                   >= SIGNIFICANT}
    agree = sum(1 for p, m in significant.values() if m and abs(p / m - 1) <= 0.15)
    return {"planner_wire_bytes": planner, "compiler_wire_bytes": compiler,
            "by_kind": {k: {"planner": v[0], "compiler": v[1]} for k, v in sorted(kinds.items())},
            "kinds_within_15": agree, "kinds": len(significant)}


def measure(run: dict, hlo_dir: Path | None = None) -> dict:
    """Compile the run's jaxpar step for its slice; the compiler's figures beside the
    planner's. With ``hlo_dir``, the optimized program is kept there."""
    import gzip

    from jaxpar.analysis.inspection import StepDoesNotFit, compile_step, step_report

    target = _target(run)
    name, slices = target.name, target.slices
    start = time.perf_counter()
    config = run_config(run, len(target.devices) // target.chips)
    try:
        step = compile_step(config, target)
    except StepDoesNotFit as err:
        return {"name": run["name"], "target": name, "slices": slices, "mesh": "-",
                "remat": config.plan.remat, "compiler_bytes": None,
                "compiler_temp_at_least": err.temp_bytes, "hbm_bytes": err.hbm_bytes,
                "fits": False, "compiler_wire_bytes": None, "splash_kernels": None,
                "compile_s": time.perf_counter() - start,
                "wall_s": time.perf_counter() - start, **planner_figures(run, name, slices)}
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        _hlo_path(hlo_dir, run).write_bytes(gzip.compress(step.compiled.as_text().encode()))
    report = step_report(step, source=run["name"])
    mem, pred = report["memory"], (report["predicted"] or {})
    pmem = pred.get("memory", {})
    return {"name": run["name"], "target": name, "slices": slices,
            "mesh": report["header"]["mesh"], "remat": run_config(run).plan.remat,
            "compiler_bytes": mem["total_bytes"], "planner_bytes": pmem.get("total_bytes"),
            "hbm_bytes": mem["hbm_bytes"], "fits": mem["fits"],
            "planner_fits": (pmem.get("total_bytes") or 0) <= mem["hbm_bytes"],
            "temp_bytes": mem["temp_bytes"], "argument_bytes": mem["argument_bytes"],
            "xla_temp_bytes": mem.get("xla_temp_bytes"),
            "fragmentation_bytes": mem.get("fragmentation_bytes"),
            "usable_bytes": mem.get("usable_bytes"),
            "splash_kernels": report["kernels"].get("tpu_custom_call", 0),
            "collectives": report["comparison"]["collectives"],
            **collective_figures(report["comparison"]["collectives"]),
            "compile_s": report["header"]["compile_s"],
            "wall_s": time.perf_counter() - start}


def planner_figures(run: dict, target_name: str, slices: int) -> dict:
    """The planner's memory and per-step collective bytes for the run's jaxpar step."""
    from jaxpar.analysis.inspection import for_slices, planner_prediction
    from jaxpar.analysis.targets import tpu_target

    target = tpu_target(target_name, slices)
    config = run_config(run, len(target.devices) // target.chips)
    pred, note = planner_prediction(for_slices(config, slices), len(target.devices), target)
    if pred is None:
        raise RuntimeError(note)
    return {"planner_bytes": pred["memory"]["total_bytes"], "catalog_hbm_bytes": target.hbm_bytes,
            "planner_wire_bytes": sum(c.get("wire_bytes_per_step", 0)
                                      for c in pred["collectives"]),
            "predicted_collectives": pred["collectives"]}


def replan(row: dict, run: dict, hlo_dir: Path | None = None) -> dict:
    """A saved row with the current planner's figures (and the catalog's HBM); with
    ``hlo_dir`` holding the run's program, the compiler's collectives read anew from it."""
    import gzip

    from jaxpar.analysis.hlo import collective_table
    from jaxpar.analysis.inspection import compare_collectives, for_slices
    from jaxpar.planner.auto import assemble

    out = {**row, **planner_figures(run, row["target"], row["slices"])}
    predicted = out.pop("predicted_collectives")
    if out["compiler_bytes"]:
        out["hbm_bytes"] = out["catalog_hbm_bytes"]
        out["fits"] = out["compiler_bytes"] <= out["hbm_bytes"]
        out["planner_fits"] = out["planner_bytes"] <= out["hbm_bytes"]
        target = _target(run)
        config = for_slices(run_config(run, len(target.devices) // target.chips),
                            target.slices)
        mesh = assemble(config, target.devices, abstract=True, machine=target.machine).plan.mesh
        path = _hlo_path(hlo_dir, run) if hlo_dir is not None else None
        if path is not None and path.exists():
            measured = collective_table(gzip.decompress(path.read_bytes()).decode(), mesh)
        else:  # the compiler's rows as saved, without the planner's columns
            measured = [{k: v for k, v in c.items()
                         if not k.startswith("predicted_") and k != "step_ratio"}
                        for c in out.get("collectives", []) if c["count"]]
        out["collectives"] = compare_collectives(measured, predicted, mesh)
        out.update(collective_figures(out["collectives"]))
    return out


def _kinds(r: dict) -> str:
    """Each significant kind's planner/compiler ratio, e.g. ``AG 0.88 RS 0.79`` (``planner
    only`` / ``compiler only`` where the other side has none of that kind)."""
    short = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR",
             "all-to-all": "A2A", "collective-permute": "CP"}
    total = max(r.get("compiler_wire_bytes") or 0, r.get("planner_wire_bytes") or 0)
    parts = []
    for kind, v in (r.get("by_kind") or {}).items():
        if total and max(v["planner"], v["compiler"]) >= SIGNIFICANT * total:
            ratio = (f"{v['planner'] / v['compiler']:.2f}" if v["compiler"] and v["planner"]
                     else "planner only" if v["planner"] else "compiler only")
            parts.append(f"{short.get(kind, kind)} {ratio}")
    return " ".join(parts) or "-"


def _summary(rows: list[dict]) -> str:
    within = sum(1 for r in rows if r["planner_bytes"] and r["compiler_bytes"]
                 and abs(r["planner_bytes"] / r["compiler_bytes"] - 1) <= 0.10)
    fits = sum(r["fits"] for r in rows)
    compiled = [r for r in rows if r.get("kinds")]
    coll = sum(1 for r in compiled if r["kinds_within_15"] == r["kinds"])
    return (f"{within} of {len(rows)} within 10% on memory; {fits} of {len(rows)} fit their "
            f"chips under jaxpar; collectives: every kind within 15% on {coll} of "
            f"{len(compiled)} compiled runs")


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def render(rows: list[dict]) -> str:
    body = [(r["name"][:46], r["target"] + (f" x{r['slices']}" if r["slices"] > 1 else ""),
             fmt_bytes(r["planner_bytes"]),
             fmt_bytes(r["compiler_bytes"]) if r["compiler_bytes"] else
             f"> {fmt_bytes(r['compiler_temp_at_least'])}",
             _ratio(r["planner_bytes"], r["compiler_bytes"]),
             f"{'yes' if r['fits'] else 'NO'} ({fmt_bytes(r['hbm_bytes'])})",
             fmt_bytes(r.get("planner_wire_bytes")), fmt_bytes(r.get("compiler_wire_bytes")),
             _ratio(r.get("planner_wire_bytes"), r.get("compiler_wire_bytes")), _kinds(r),
             f"{r['compile_s']:.0f}") for r in rows]
    return (table(["run", "target", "planner mem", "compiler mem", "ratio", "fits HBM",
                   "planner coll/step", "compiler coll/step", "ratio", "by kind",
                   "compile s"], body, right=(2, 3, 4, 6, 7, 8, 10))
            + "\n\n" + _summary(rows))


# --- the site's table (docs/hooks/generated.py) ---------------------------------------------

COMMAND = "python benchmarks/tpu_compile.py --save benchmarks/results/tpu_compile.json"
"""The command that wrote ``benchmarks/results/tpu_compile.json`` (its planner columns
refreshed since by ``--replan benchmarks/results/tpu_compile.json --save ...``)."""


def markdown(rows: list[dict]) -> str:
    """:func:`render`'s table as markdown, from saved rows."""
    lines = ["| run | target | planner mem | compiler mem | ratio | fits HBM | planner coll "
             "| compiler coll | ratio | by kind | compile s |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    for r in rows:
        compiler = (fmt_bytes(r["compiler_bytes"]) if r["compiler_bytes"]
                    else f"> {fmt_bytes(r['compiler_temp_at_least'])}")
        fits = f"{'yes' if r['fits'] else '**no**'} ({fmt_bytes(r['hbm_bytes'])})"
        if r["compiler_bytes"]:  # the margin: how much of the chip the step takes
            fits += f", {100 * r['compiler_bytes'] / r['hbm_bytes']:.0f}%"
        target = r["target"] + (f" x {r['slices']}" if r["slices"] > 1 else "")
        coll = fmt_bytes(r["compiler_wire_bytes"]) if r.get("compiler_wire_bytes") else "-"
        lines.append(f"| {r['name']} | `{target}` | {fmt_bytes(r['planner_bytes'])} | "
                     f"{compiler} | {_ratio(r['planner_bytes'], r['compiler_bytes'])} | "
                     f"{fits} | {fmt_bytes(r.get('planner_wire_bytes'))} | {coll} | "
                     f"{_ratio(r.get('planner_wire_bytes'), r.get('compiler_wire_bytes'))} | "
                     f"{_kinds(r)} | {r['compile_s']:.0f} |")
    lines += ["", _summary(rows) + ".", "",
              "Memory and collective bytes are per device. \"compiler mem\" is what the TPU "
              "compiler says the step needs, in its log: the arguments and its program "
              "requirement (`memory_analysis()`'s temporaries count the gaps in the "
              "program's heap twice); \"> X\" marks a "
              "step it refused, X being the temporaries it reported; \"fits HBM\" sets the "
              "compiler's memory against the chip's HBM, and the share of it the step "
              "takes (for a refused step, against what the compiler gave a program). "
              "Collectives are the bytes a device receives in "
              "one step: each collective instruction of the compiled program times the trips "
              "of the loops around it, a collective matmul's permutes counted under the "
              "all-gather or reduce-scatter they make up; \"by kind\" gives planner / "
              "compiler for each kind carrying at least 2% of them (AG all-gather, RS "
              "reduce-scatter, AR all-reduce, A2A all-to-all, CP collective-permute). The "
              "planner's columns are its figures for the same config (`--replan` recomputes "
              "them without compiling); \"compile s\" is the compile time on the 2-core "
              "host."]
    return "\n".join(lines) + "\n"


def save(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` into the table at ``path``, replacing rows of the same run."""
    old = json.loads(path.read_text()) if path.exists() else []
    new = {r["name"]: r for r in rows}
    merged = [new.pop(r["name"], r) for r in old] + list(new.values())
    path.write_text(json.dumps(merged, indent=1))


def write_configs(runs: list[dict], folder: Path) -> list[Path]:
    """Each run's jaxpar config as ``folder/<name>.yaml`` (spaces and dots as ``_``), its
    first line a comment with the ``jaxpar compile`` command that compiles it."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for run in runs:
        target = _target(run)
        config = run_config(run, len(target.devices) // target.chips)
        slices = run.get("slices", 1)
        topology = run_topology(run)
        path = folder / (re.sub(r"[^\w-]+", "_", run["name"]).strip("_") + ".yaml")
        command = (f"# jaxpar compile --config {path} --target {topology}"
                   + (f" --slices {slices}" if slices > 1 else "") + "\n")
        path.write_text(command + yaml.safe_dump(config.to_dict(), sort_keys=False))
        written.append(path)
        print(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated row indices of published_runs.yaml")
    parser.add_argument("--save", help="write the rows as JSON here")
    parser.add_argument("--replan", metavar="JSON",
                        help="print a saved table with the planner's figures computed anew "
                             "(the compiler's as saved): no compiling; with --save, write "
                             "it")
    parser.add_argument("--hlo", metavar="DIR", type=Path,
                        help="keep each compiled program's HLO here (gzipped); with "
                             "--replan, read the compiler's collectives anew from it")
    parser.add_argument("--write-configs", metavar="DIR", type=Path,
                        help="write each chosen run's jaxpar config here as NAME.yaml "
                             "(with its target in the first line) and stop: for `jaxpar "
                             "compile --config ... --target ...` with overrides")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU compiler needs no TPU
    runs = _published().load_runs()
    if args.replan:
        rows = [replan(row, {r["name"]: r for r in runs}[row["name"]], args.hlo)
                for row in json.loads(Path(args.replan).read_text())]
        print(render(rows))
        if args.save:
            save(Path(args.save), rows)
        return 0
    if args.only:
        chosen = [runs[int(i)] for i in args.only.split(",")]
    else:
        by_name = {r["name"]: r for r in runs}
        chosen = [by_name[n] for n in DEFAULT]
    if args.write_configs:
        write_configs(chosen, args.write_configs)
        return 0
    rows = []
    for run in chosen:
        rows.append(measure(run, args.hlo))
        r = rows[-1]
        got = r["compiler_bytes"] or r.get("compiler_temp_at_least")
        print(f"{r['name']}: compiler {fmt_bytes(got)}, planner "
              f"{fmt_bytes(r['planner_bytes'])}, compiled in {r['compile_s']:.0f} s",
              flush=True)
        if args.save:
            save(Path(args.save), rows)
    print()
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
