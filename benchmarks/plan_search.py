"""How long the planner's search takes, with its bound and without.

    python benchmarks/plan_search.py [--rounds 3] [--only llama-7b,...]

For each machine of :data:`CASES` (the models and slices the docs and notebooks plan),
runs :func:`jaxpar.planner.search.search` with the bound (``prune=True``, what
``jaxpar plan`` does) and without it (every fitting candidate priced), alternated over
``--rounds`` rounds (the order reversed every other round: this shared host's speed
drifts), and prints the median seconds of each, their ratio, the estimates each priced,
and whether both returned the same plans (they must: the bound only skips candidates
that cannot enter the result). The search is pure Python on one core; no devices.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxpar.analysis.report import table
from jaxpar.planner import parse_chips
from jaxpar.planner.api import resolve_model
from jaxpar.planner.search import search

CASES = [
    ("configs/llama-7b.yaml", "tpu-v5p:256", 1, 512, 4096),
    ("configs/llama-7b.yaml", "h100:64", 1, 512, 4096),
    ("configs/llama-70b.yaml", "tpu-v5p:512", 1, 512, 4096),
    ("configs/llama-70b.yaml", "h100:32", 1, 512, 4096),
    ("configs/llama-70b.yaml", "h100:128", 1, 256, 4096),
    ("configs/llama-8b.yaml", "tpu-v6e:256", 2, 512, 8192),
    ("configs/mixtral-8x7b.yaml", "tpu-v5p:64", 1, 256, 4096),
]
"""(model, chips, slices, global batch, sequence length)."""


def _timed(model, chips, slices, batch, seq, prune):
    resolved = resolve_model(model)
    machine = parse_chips(chips, slices=slices)
    start = time.perf_counter()
    result = search(resolved.spec_for, machine, batch, seq, top=3, pipeline=resolved.pipeline,
                    prune=prune)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated model names to keep")
    args = parser.parse_args()
    keep = [k for k in args.only.split(",") if k]
    cases = [c for c in CASES if not keep or any(k in c[0] for k in keep)]
    rows = []
    for case in cases:
        times = {True: [], False: []}
        results = {}
        for r in range(args.rounds):
            for prune in ((True, False) if r % 2 == 0 else (False, True)):
                seconds, results[prune] = _timed(*case, prune)
                times[prune].append(seconds)
        bound, full = (statistics.median(times[p]) for p in (True, False))
        same = ([(p.candidate, p.step_time_s) for p in results[True].plans]
                == [(p.candidate, p.step_time_s) for p in results[False].plans])
        model, chips, slices = case[0].split("/")[-1].removesuffix(".yaml"), case[1], case[2]
        rows.append((model, f"{chips}{f' x {slices}' if slices > 1 else ''}",
                     f"{bound:.2f}", f"{full:.2f}", f"{bound / full:.2f}",
                     f"{results[True].priced:,}", f"{results[False].priced:,}",
                     "yes" if same else "NO"))
        print(f"{rows[-1][0]} {rows[-1][1]} done", flush=True)
    print(table(["model", "chips", "bound s", "all priced s", "ratio", "priced (bound)",
                 "priced (all)", "same plans"], rows, right=(2, 3, 4, 5, 6)))


if __name__ == "__main__":
    main()
