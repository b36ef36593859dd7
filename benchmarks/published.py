"""The planner beside published training runs: each run's own layout, estimated.

    python benchmarks/published.py [--fit [--contention]] [--all] [--no-plan] [--json]

``benchmarks/published_runs.yaml`` holds LLM training runs published with their machine,
model, global batch, sequence length, parallel layout, remat policy and measured throughput
(MaxText tpu-recipes on TPU v5p/v6e/v7; NeMo/Megatron, torchtitan, llm-foundry, MaxText and
papers on A100/H100/H200; each row names its source and quotes the figure). For each run
this asks the cost model (:func:`jaxpar.planner.cost.estimate`) for *that* layout and
compares tokens per second per chip, which does not depend on how a source counts FLOPs;
then, unless ``--no-plan``, the planner's own choice for the same machine and batch.

Calibration without cheating: the rows are split into two halves, alternating by name
within each chip kind (:func:`halves`). ``--fit`` fits each chip's ``matmul_efficiency``
and ``memory_efficiency`` on the ``fit`` half only (the grid pair minimising the median
absolute log error of that chip's fit rows) and prints them, which the built-in catalog
(:data:`jaxpar.planner.catalog.BUILTIN`) carries; the table reports the ``check`` half,
which no fitted value has seen (``--all`` shows both halves, marked). ``--fit
--contention`` also scans the one figure shared by every chip,
:data:`jaxpar.planner.catalog.CONTENTION` (the share of an FSDP / data-parallel
collective's time that hiding it beside compute does not save), refitting the rest at
each value (:func:`scan_contention`; two minutes).

How rows were normalised: MaxText's ``ici_fsdp_transpose`` counts as ``fsdp``; FSDP /
ZeRO-3 (PyTorch FSDP, MaxText) is the ``fsdp`` axis, Megatron's distributed optimizer is
ZeRO-1 over ``data``, HSDP is ``fsdp`` inside a node and ``data`` across; a GPU axis
beyond an 8-GPU NVLink node crosses InfiniBand (tensor first inside the node, pipeline
last); a 2-matrix GELU MLP of width ``4h`` is a gated MLP of width ``8h/3`` (the same
parameters and FLOPs); remat policies become the parts they recompute (MaxText's custom
lists: tensors marked ``remat`` are recomputed, ``offload``/``device`` saved; Megatron's
selective recomputation reruns the attention core; torchtitan's per-op SAC saves every
matmul); Megatron pipelines run ``pipeline_microbatches`` microbatches with
``pipeline_repeats`` virtual stages. fp8/int8 runs, A100-40GB, and architectures the
planner does not model (MLA, interleaved MoE layers, GPT-OSS) are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpar.models import TransformerConfig  # noqa: E402
from jaxpar.planner import plan  # noqa: E402
from jaxpar.planner.catalog import BUILTIN, CONTENTION, parse_chips  # noqa: E402
from jaxpar.planner.cost import Candidate, estimate  # noqa: E402
from jaxpar.planner.model import from_transformer  # noqa: E402

RUNS = Path(__file__).with_name("published_runs.yaml")


def load_runs(path: Path = RUNS) -> list[dict]:
    """The published runs, each with its ``half`` (``fit`` or ``check``)."""
    rows = yaml.safe_load(path.read_text())
    return halves(rows)


def halves(rows: list[dict]) -> list[dict]:
    """Mark rows ``fit`` / ``check``, alternating by name within each chip kind (a kind's
    first row by name fits), so both halves span every chip kind with two or more rows."""
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_kind[r["chips"].split(":")[0]].append(r)
    for kind_rows in by_kind.values():
        for i, r in enumerate(sorted(kind_rows, key=lambda r: r["name"])):
            r["half"] = "fit" if i % 2 == 0 else "check"
    return rows


def candidate(run: dict) -> Candidate:
    """The run's own layout and knobs."""
    return Candidate.make(
        run.get("ici", {}), run.get("dcn", {}), zero_stage=run.get("zero_stage", 0),
        remat=run.get("remat", "none"), microbatches=run.get("microbatches", 1),
        pipeline_microbatches=run.get("pipeline_microbatches", 0),
        pipeline_repeats=run.get("pipeline_repeats", 0),
        sequence_parallel=run.get("sequence_parallel", False),
        context_attention=run.get("context_attention", "allgather"))


def model_config(run: dict) -> TransformerConfig:
    """The run's model as the reference decoder's config."""
    fields = dict(run["model"], max_seq_len=run["seq"])
    return TransformerConfig(**fields)


SOFTWARE = {"xla": 1.0, "megatron": 0.96, "pytorch": 0.96}
"""How fast each implementation family runs the same matmuls, relative to XLA (what jaxpar
runs, so the planner uses 1): a factor on the chip's ``matmul_efficiency``, fitted on the
fit half with the chips' efficiencies (``--fit``). Without it one figure per GPU would
have to serve Megatron's fused kernels and PyTorch FSDP's (torchtitan, llm-foundry,
fms-fsdp: eager kernels, unfused norms and, for torchtitan, 500 W H100s) alike."""


def predict_tokens(run: dict, chips: dict | None = None,
                   software: dict[str, float] | None = None) -> float:
    """Estimated tokens per second per chip of ``run``'s own layout, its chip's matmul
    efficiency scaled by its implementation family's factor (:data:`SOFTWARE`)."""
    chips = dict(chips if chips is not None else BUILTIN)
    factor = (software or SOFTWARE)[run.get("software", "xla")]
    kind = run["chips"].split(":")[0]
    chips[kind] = dataclasses.replace(
        chips[kind], matmul_efficiency=chips[kind].matmul_efficiency * factor)
    machine = parse_chips(run["chips"], slices=run.get("slices", 1), catalog=chips)
    cand = candidate(run)
    if cand.n_devices != machine.count:
        raise ValueError(f"{run['name']}: layout spans {cand.n_devices} of {machine.count}")
    spec = from_transformer(model_config(run), stages=cand.sizes["stage"])
    est = estimate(spec, machine, cand, run["global_batch"], run["seq"])
    return run["global_batch"] * run["seq"] / est.step_time_s / machine.count


def error(run: dict, predicted: float) -> float:
    """Relative error of a prediction against the published tokens/s per chip."""
    return predicted / run["tokens_per_s_chip"] - 1


EFFICIENCY_GRID = tuple(x / 100 for x in range(40, 97, 2))
MEMORY_GRID = tuple(x / 10 for x in range(6, 11))
ANCHORS = ("xla",)
"""Families held at factor 1: the chips' efficiencies are what XLA reaches (XLA is what
jaxpar runs), the other families' factors are fitted relative to it."""
SOFTWARE_GRID = tuple(x / 100 for x in range(40, 161, 2))


def _loss(rows: list[dict], chips: dict, software: dict[str, float],
          predict=predict_tokens) -> float:
    return statistics.median(abs(math.log(predict(r, chips, software)
                                          / r["tokens_per_s_chip"])) for r in rows)


def fit(rows: list[dict], rounds: int = 3, chips: dict | None = None
        ) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """On the ``fit`` rows only: per chip kind the (``matmul_efficiency``,
    ``memory_efficiency``) grid pair over its runs, then per implementation family but
    XLA (:data:`ANCHORS`, held at factor 1) its factor over that family's runs, each
    minimising the median absolute log error of its rows, alternately for ``rounds``
    rounds, from ``chips`` (the built-in catalog by default). Returns (chip figures,
    family factors).

    A row's prediction depends only on its own chip entry and its family's factor, so
    they are memoised within the call on (row, that chip entry, that factor): the grids
    revisit the same points each round and across the two searches."""
    fit_rows = [r for r in rows if r["half"] == "fit"]
    chips = dict(chips if chips is not None else BUILTIN)
    software = dict.fromkeys(SOFTWARE, 1.0)
    position = {id(r): i for i, r in enumerate(fit_rows)}
    cache: dict[tuple, float] = {}

    def predict(run: dict, chips: dict, software: dict[str, float]) -> float:
        key = (position[id(run)], chips[run["chips"].split(":")[0]],
               software[run.get("software", "xla")])
        if key not in cache:
            cache[key] = predict_tokens(run, chips, software)
        return cache[key]

    kinds = sorted({r["chips"].split(":")[0] for r in fit_rows})
    for _ in range(rounds):
        for kind in kinds:
            mine = [r for r in fit_rows if r["chips"].startswith(kind + ":")]

            def loss(pair: tuple[float, float], kind=kind, mine=mine) -> float:
                trial = dict(chips)
                trial[kind] = dataclasses.replace(chips[kind], matmul_efficiency=pair[0],
                                                  memory_efficiency=pair[1])
                return _loss(mine, trial, software, predict)
            m, h = min(((m, h) for m in EFFICIENCY_GRID for h in MEMORY_GRID), key=loss)
            chips[kind] = dataclasses.replace(chips[kind], matmul_efficiency=m,
                                              memory_efficiency=h)
        for family in software:
            mine = [r for r in fit_rows if r.get("software", "xla") == family]
            if family in ANCHORS or not mine:
                continue
            software[family] = min(SOFTWARE_GRID, key=lambda f, fam=family, mine=mine:
                                   _loss(mine, chips, {**software, fam: f}, predict))
    return ({k: (chips[k].matmul_efficiency, chips[k].memory_efficiency) for k in kinds},
            software)


CONTENTION_GRID = tuple(x / 4 for x in range(5))


def scan_contention(rows: list[dict]) -> dict[float, float]:
    """On the ``fit`` rows only: for each shared ``contention`` in :data:`CONTENTION_GRID`
    (every chip's; :data:`jaxpar.planner.catalog.CONTENTION`), the chips' efficiencies
    and the families' factors fitted at it (:func:`fit`), then the median absolute log
    error of all the fit rows (:data:`jaxpar.planner.catalog.CONTENTION` says what the
    scan found and why the catalog keeps 0)."""
    fit_rows = [r for r in rows if r["half"] == "fit"]
    losses = {}
    for c in CONTENTION_GRID:
        chips = {k: dataclasses.replace(v, contention=c) for k, v in BUILTIN.items()}
        fitted, software = fit(rows, chips=chips)
        for kind, (m, h) in fitted.items():
            chips[kind] = dataclasses.replace(chips[kind], matmul_efficiency=m,
                                              memory_efficiency=h)
        losses[c] = _loss(fit_rows, chips, software)
    return losses


def summary(errors: list[float]) -> str:
    """Share within +-15% and the median absolute error."""
    if not errors:
        return "no rows"
    within = sum(abs(e) <= 0.15 for e in errors)
    med = statistics.median(abs(e) for e in errors)
    return (f"{within}/{len(errors)} within +-15% ({within / len(errors) * 100:.0f}%), "
            f"median |error| {med * 100:.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true",
                        help="fit matmul_efficiency per chip on the fit half and print it")
    parser.add_argument("--contention", action="store_true",
                        help="with --fit: scan the shared contention too (slow)")
    parser.add_argument("--all", action="store_true", help="show the fit half too")
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's own choice")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = load_runs()
    if args.fit:
        fitted, software = fit(rows)
        print("fitted on the fit half: matmul_efficiency, memory_efficiency "
              "(catalog values in brackets)")
        for kind, (eff, mem) in fitted.items():
            chip = BUILTIN[kind]
            print(f"  {kind:10} {eff:.2f} {mem:.1f}  [{chip.matmul_efficiency:.2f} "
                  f"{chip.memory_efficiency:.1f}]")
        print("implementation families' factors (SOFTWARE in brackets):")
        for family, f in software.items():
            print(f"  {family:10} {f:.2f}  [{SOFTWARE[family]:.2f}]")
        if args.contention:
            print("contention: median |log error| of the fit half, each refitted "
                  f"(catalog: {CONTENTION})")
            for c, loss in scan_contention(rows).items():
                print(f"  {c:.2f}  {loss:.4f}")
        return 0
    shown = [r for r in rows if args.all or r["half"] == "check"]
    out = []
    for r in sorted(shown, key=lambda r: (r["chips"].split(":")[0], r["name"])):
        pred = predict_tokens(r)
        row = {"run": r["name"], "half": r["half"], "chips": r["chips"],
               "batch": r["global_batch"], "seq": r["seq"],
               "layout": describe(r), "published": r["tokens_per_s_chip"],
               "predicted": pred, "error": error(r, pred)}
        if not args.no_plan:
            best = plan(model_config(r), chips=r["chips"], slices=r.get("slices", 1),
                        global_batch=r["global_batch"], seq=r["seq"], top=1)[0]
            n = best.candidate.n_devices
            row["plan"] = best.candidate.describe() + f" z{best.candidate.zero_stage} " \
                f"{best.candidate.remat}"
            row["plan_tokens"] = r["global_batch"] * r["seq"] / best.step_time_s / n
            row["plan_fits"] = best.fits
        out.append(row)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    head = (f"{'run':58} {'half':5} {'chips':>14} {'layout':32} {'published':>9} "
            f"{'predicted':>9} {'error':>7}")
    if not args.no_plan:
        head += f" | {'planner choice':48} {'tok/s':>7}"
    print(head)
    print("-" * len(head))
    for o in out:
        line = (f"{o['run'][:58]:58} {o['half']:5} {o['chips']:>14} {o['layout'][:32]:32} "
                f"{o['published']:9.0f} {o['predicted']:9.0f} {o['error'] * 100:+6.1f}%")
        if "plan" in o:
            line += f" | {o['plan'][:48]:48} {o['plan_tokens']:7.0f}"
        print(line)
    print("tokens/s per chip. check half: "
          + summary([o["error"] for o in out if o["half"] == "check"]))
    if args.all:
        print("fit half (seen by the fit): "
              + summary([o["error"] for o in out if o["half"] == "fit"]))
    return 0


def describe(run: dict) -> str:
    """The run's layout in short: axes, ZeRO, remat."""
    return (candidate(run).describe() + f" z{run.get('zero_stage', 0)} "
            + run.get("remat", "none").replace("recompute=", "re:"))


if __name__ == "__main__":
    sys.exit(main())
