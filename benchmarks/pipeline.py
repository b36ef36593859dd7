"""Pipeline benchmark: the bubble measured in compiled FLOPs, and 3D versus FSDP step time.

Part 1 compiles the decoder stack's forward and backward pass twice on one device: as a
pipeline (``jaxpar.pipeline``, loop unrolled) and as a plain sequence of the same layers
(unrolled too, since XLA's cost analysis counts a while loop's body once). The pipeline
runs ``R*M + S - 1`` iterations of all ``S`` stages where the sequence runs ``R*S`` layers,
so ``1 - flops(sequence) / flops(pipeline)`` is the bubble it actually pays, printed beside
the theoretical ``(S - 1) / (R*M + S - 1)``. The small excess is the pipeline's own
element-wise work (the shift and the buffer selects).

Part 2 times full training steps on 8 simulated CPU devices: 3D parallelism (data=2 x
tensor=2 x stage=2, circular pipeline) against pure FSDP (fsdp=8) on the same model and
batch. CPU "devices" share the host's cores, so this shows overheads, not real speed-ups.

    python benchmarks/pipeline.py            # both parts
    python benchmarks/pipeline.py --no-time  # FLOPs table only
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.analysis import hlo as jinspect  # noqa: E402
from jaxpar.models import Transformer, TransformerConfig  # noqa: E402
from jaxpar.models.transformer import rotary_tables  # noqa: E402
from jaxpar.parallel import pipeline as pl  # noqa: E402

SCHEDULES = [(2, 2, 1), (2, 8, 1), (4, 4, 1), (4, 8, 1), (4, 16, 1),
             (2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 4, 4)]
ROWS_PER_MICROBATCH, SEQ = 2, 64


def _config(layers: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=256, d_model=128, n_layers=layers, n_heads=4,
                             n_kv_heads=2, d_ff=512, max_seq_len=SEQ)


def _blocks_flops(stages: int, microbatches: int, repeats: int) -> tuple[float, float]:
    """(pipelined, sequential) FLOPs of sum(blocks(x)**2) and its gradient, on one device."""
    cfg = _config(stages * repeats)
    schedule = pl.Schedule(stages, microbatches, repeats)
    with nnx.use_eager_sharding(False):
        plain = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        piped = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), pipeline=schedule))
    x = jax.ShapeDtypeStruct((microbatches * ROWS_PER_MICROBATCH, SEQ, cfg.d_model),
                             jnp.float32)
    sin, cos = rotary_tables(SEQ, cfg.head_dim, cfg.rope_theta)
    call = lambda block, h: block(h, sin, cos)  # noqa: E731

    graphdef_p, state_p = nnx.split(piped.blocks)
    graphdef_s, state_s = nnx.split(plain.blocks)

    def pipelined(state, x):
        y = pl.pipeline_module(nnx.merge(graphdef_p, state), x, call,
                               microbatches=microbatches, unroll=True)
        return jnp.sum(y * y)

    def sequential(state, x):
        for layer in range(cfg.n_layers):
            one = jax.tree.map(lambda a, i=layer: a[i], state)
            x = call(nnx.merge(graphdef_s, one), x)
        return jnp.sum(x * x)

    def cost(fn, state):
        compiled = jax.jit(jax.value_and_grad(fn)).lower(state, x).compile()
        return jinspect.flops(compiled)

    return cost(pipelined, state_p), cost(sequential, state_s)


def flops_table() -> None:
    print("Bubble from compiled FLOPs (decoder stack fwd+bwd, d_model=128, seq=64, "
          f"{ROWS_PER_MICROBATCH} rows per microbatch, one device)")
    header = (f"{'S':>2} {'M':>3} {'R':>2} {'layers':>6} {'iters':>5} {'pipeline GFLOP':>14} "
              f"{'sequential GFLOP':>16} {'measured bubble':>15} {'(S-1)/(RM+S-1)':>14}")
    print(header)
    print("-" * len(header))
    for stages, microbatches, repeats in SCHEDULES:
        piped, seq = _blocks_flops(stages, microbatches, repeats)
        sched = pl.Schedule(stages, microbatches, repeats)
        print(f"{stages:>2} {microbatches:>3} {repeats:>2} {sched.layers:>6} "
              f"{sched.iterations:>5} {piped / 1e9:>14.3f} {seq / 1e9:>16.3f} "
              f"{1 - seq / piped:>15.3f} {sched.bubble:>14.3f}", flush=True)


def _time_steps(axes: dict[str, int], schedule: pl.Schedule | None, steps: int,
                batch: np.ndarray) -> tuple[float, float]:
    cfg = _config(4)
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), "fsdp_tp")
    model = jaxpar.init_sharded(
        lambda: Transformer(cfg, rngs=nnx.Rngs(0), pipeline=schedule), plan)
    trainer = jaxpar.Trainer(model, optax.adamw(1e-3), plan)
    first = trainer.step(batch)  # compile
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times), first["loss"]


def step_times(steps: int) -> None:
    batch = np.asarray(jax.random.randint(jax.random.key(0), (16, SEQ + 1), 0, 256))
    print(f"\nStep time, 8 simulated CPU devices, 4 layers, batch 16 x {SEQ} "
          f"(median of {steps} steps)")
    runs = [("fsdp=8, no pipeline", {"fsdp": 8}, None)]
    for m in (2, 4):
        sched = pl.Schedule(2, m, 2)
        runs.append((f"data=2 x tensor=2 x stage=2, S=2 M={m} R=2",
                     {"data": 2, "tensor": 2, "stage": 2}, sched))
    for name, axes, sched in runs:
        seconds, loss = _time_steps(axes, sched, steps, batch)
        extra = f"  [{sched.describe()}]" if sched else ""
        print(f"  {name:<44} {1e3 * seconds:8.1f} ms/step  first loss {loss:.5f}{extra}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--no-time", action="store_true", help="skip the step-time part")
    args = parser.parse_args()
    flops_table()
    if not args.no_time:
        step_times(args.steps)


if __name__ == "__main__":
    main()
