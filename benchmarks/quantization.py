"""Quantized training on this machine: what can be measured without int8/fp8 units.

For the reference decoder on 8 simulated CPU devices (fsdp 8, bf16 compute), per setting
of ``plan.quantize`` (none, int8, fp8), ``plan.quantize_gather`` and
``plan.quantize_reduce`` (none, int8: ZeRO++ qwZ and qgZ): the matmuls of the step as
handed to XLA by operand type (count and FLOPs, the layer loop's body counted once), the
all-gather and the gradient-reduction (all-reduce, reduce-scatter, all-to-all) bytes per
device of the compiled step, and the step
time (median of alternated rounds; XLA:CPU widens 8-bit products, so this shows the
quantization passes' cost, not a speed-up: ``benchmarks/mfu.py`` runs on a GPU when one
is lent).

    python benchmarks/quantization.py [--rounds 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.analysis.hlo import collective_table  # noqa: E402
from jaxpar.models import Transformer, TransformerConfig  # noqa: E402
from jaxpar.sharding.precision import Policy  # noqa: E402

CFG = TransformerConfig(vocab_size=2048, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                        d_ff=1024, max_seq_len=128)
SETTINGS = [("none", "none", "none"), ("int8", "none", "none"), ("fp8", "none", "none"),
            ("none", "int8", "none"), ("none", "none", "int8"), ("none", "int8", "int8"),
            ("int8", "int8", "int8")]
REDUCTIONS = ("all-reduce", "reduce-scatter", "all-to-all")
_DOT = re.compile(r"stablehlo\.dot_general .*?contracting_dims = \[([\d, ]*)\] x .*?: "
                  r"\(tensor<((?:\d+x)*)(\w+)>, tensor<(?:\d+x)*(\w+)>\) -> "
                  r"tensor<((?:\d+x)*)\w+>")


def dots_by_type(text: str) -> dict[str, tuple[int, float]]:
    """(count, FLOPs) of the dots in lowered StableHLO text, by operand types."""
    out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for contract, lhs, lt, rt, result in _DOT.findall(text):
        dims = [int(d) for d in lhs.split("x") if d]
        k = math.prod(dims[int(i)] for i in contract.split(",") if i.strip())
        n = math.prod(int(d) for d in result.split("x") if d)
        row = out[f"{lt} x {rt}"]
        row[0] += 1
        row[1] += 2.0 * n * k
    return {key: (c, f) for key, (c, f) in out.items()}


def build(quantize: str, gather: str, reduce: str) -> jaxpar.Trainer:
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 8}), "fsdp", zero_stage=0,
                                   quantize=quantize, quantize_gather=gather,
                                   quantize_reduce=reduce,
                                   precision=Policy.parse("p=f32,c=bf16,o=f32"))
    model = jaxpar.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan)
    return jaxpar.Trainer(model, optax.adam(1e-3), plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    batch = np.random.default_rng(0).integers(0, CFG.vocab_size, (16, 129)).astype(np.int32)
    trainers = {s: build(*s) for s in SETTINGS}
    print(f"{'quantize':8} {'gather':6} {'reduce':6} {'dots by operand types (count, GFLOP)':58}"
          f" {'all-gather B/dev':>16} {'reductions B/dev':>16}")
    for (q, g, r), tr in trainers.items():
        dots = dots_by_type(tr.lower(batch).as_text())
        text = ", ".join(f"{k} {c} ({f / 1e9:.2f})" for k, (c, f) in sorted(dots.items()))
        rows = collective_table(tr.lower(batch).compile().as_text(), tr.plan.mesh)
        gathered = sum(x["bytes_per_device"] for x in rows if x["kind"] == "all-gather")
        reduced = sum(x["bytes_per_device"] for x in rows if x["kind"] in REDUCTIONS)
        print(f"{q:8} {g:6} {r:6} {text:58} {gathered:16,} {reduced:16,}")
    times: dict[tuple, list[float]] = {s: [] for s in SETTINGS}
    for tr in trainers.values():
        tr.step(batch)  # compile
    for _ in range(args.rounds):  # alternated: each round times every setting once
        for s, tr in trainers.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                out = tr.step_async(batch)
            jax.block_until_ready(out)
            times[s].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times[SETTINGS[0]])
    print(f"\n{'quantize':8} {'gather':6} {'reduce':6} {'ms/step':>8} {'ratio':>6}")
    for s, ts in times.items():
        ms = statistics.median(ts)
        print(f"{s[0]:8} {s[1]:6} {s[2]:6} {1e3 * ms:8.1f} {ms / base:6.2f}")


if __name__ == "__main__":
    main()
