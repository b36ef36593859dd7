"""Host offload: the step-time cost of each offload, and what it takes off the device.

    python benchmarks/offload.py [--rounds 5] [--steps 10]

Trains the reference decoder (d_model 256, 4 layers, 8 heads, d_ff 1024, vocab 8192, seq
128, global batch 8, f32 AdamW) on 8 simulated CPU devices (fsdp 4 x tensor 2) without
offload and with each offload: optimizer state on the host (streamed through the device
for the update, or the update run on the host), the layers' weights streamed from the
host, activations saved to the host by name, and ``offload_dots``. After a warm-up step,
``--rounds`` rounds each run ``--steps`` steps of every variant, in an order that rotates
every round; each step fetches its loss, as ``Trainer.step`` does.

It prints, per variant: ms/step (median over rounds of the per-round median step), the
ratio against no offload (median of per-round ratios, min-max in brackets), and from the
compiled step the per-device bytes of state in device memory and in host memory, and the
device temporaries. On CPU both memories are the same RAM and a transfer is a copy (or
nothing), so the ratios price the extra work the program does, not a PCIe or host link:
only an accelerator measures that.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.analysis.hlo import memory_stats  # noqa: E402
from jaxpar.config.assembly import build_trainer  # noqa: E402

MODEL = ["model.vocab_size=8192", "model.d_model=256", "model.n_layers=4",
         "model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=1024", "model.max_seq_len=128",
         "train.seq_len=128", "train.global_batch=8", "mesh.fsdp=4", "mesh.tensor=2",
         "train.optimizer=adamw"]
VARIANTS = {
    "none": [],
    "optimizer (update on device)": ["plan.offload_optimizer=1"],
    "optimizer (update on host)": ["plan.offload_optimizer=1", "plan.host_update=true"],
    "optimizer, half": ["plan.offload_optimizer=0.5"],
    "weights streamed": ["plan.offload_params=true"],
    "activations offload:attention_out,mlp_out": ["plan.remat=offload:attention_out,mlp_out"],
    "offload_dots": ["plan.remat=offload_dots"],
}


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    batch = np.random.default_rng(0).integers(0, 8192, (8, 129)).astype(np.int32)
    trainers, memory = {}, {}
    for name, extra in VARIANTS.items():
        t = build_trainer(jaxpar.load_config(None, [*MODEL, *extra]))
        memory[name] = memory_stats(t.lower(batch).compile())
        t.step(batch)  # warm-up: compile and run once
        trainers[name] = t

    names = list(VARIANTS)
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        this_round = {}
        for name in order:
            per_step = []
            for _ in range(args.steps):
                start = time.perf_counter()
                trainers[name].step(batch)
                per_step.append(time.perf_counter() - start)
            this_round[name] = statistics.median(per_step)
            times[name].append(this_round[name])
        for name in names:
            ratios[name].append(this_round[name] / this_round["none"])

    print(f"jax {jax.__version__}, {jax.devices()[0].platform} x {len(jax.devices())}, "
          f"{args.rounds} rounds x {args.steps} steps")
    header = f"{'variant':<44}{'ms/step':>9}{'vs none':>22}{'device state':>15}" \
             f"{'host state':>13}{'device temp':>13}"
    print(header)
    print("-" * len(header))
    for name in names:
        m, rs = memory[name], ratios[name]
        ratio = f"{statistics.median(rs):.2f} [{min(rs):.2f}-{max(rs):.2f}]"
        print(f"{name:<44}{1e3 * statistics.median(times[name]):>9.1f}{ratio:>22}"
              f"{_kib(m['argument_bytes']):>15}{_kib(m['host_argument_bytes']):>13}"
              f"{_kib(m['temp_bytes']):>13}")


if __name__ == "__main__":
    main()
