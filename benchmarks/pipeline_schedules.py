"""Pipeline schedules: ticks and bubble measured against the formulas, memory, step time.

Part 1 builds the tick tables of GPipe, 1F1B and interleaved 1F1B (pure Python) and
prints, per (p, m, v): ticks and idle ticks per stage as measured and as the formulas
``2 * (m * v + p - 1)`` and ``2 * (p - 1)`` give them, the bubble ``(p - 1) / (v * m)``
(idle over busy stage-ticks), and the peak (microbatch, chunk) inputs a stage holds.
``--render`` prints each schedule's timeline.

Part 2 compiles :func:`jaxpar.parallel.schedules.pipeline_value_and_grad` for a toy model
(8 layers ``h + tanh(h @ w)`` of width 64, embedding on stage 0, linear head and cross
entropy) on 8 simulated CPU devices (stage 4 x data 2) and prints temporary bytes per
device for m = 4, 8, 16 at 16 rows per microbatch, and the step time. CPU "devices" share
the host's cores: the times show the schedules' overheads, not a speed-up.

Part 3 does the same for the reference decoder's whole training step through the
Trainer, under each schedule of :class:`jaxpar.parallel.pipeline.Schedule`.

    python benchmarks/pipeline_schedules.py            # all parts
    python benchmarks/pipeline_schedules.py --no-time  # tables only
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar.parallel import schedules as sc  # noqa: E402

CASES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2),
         ("1f1b", 4, 16, 1), ("interleaved_1f1b", 4, 16, 2), ("interleaved_1f1b", 4, 16, 4),
         ("gpipe", 8, 32, 1), ("1f1b", 8, 32, 1), ("interleaved_1f1b", 8, 32, 2)]
WIDTH, LAYERS, ROWS, VOCAB, CLASSES = 64, 8, 16, 32, 10


def ticks_table(render: bool) -> None:
    print(f"{'schedule':18} {'p':>2} {'m':>3} {'v':>2} {'ticks':>11} {'idle/stage':>11} "
          f"{'bubble':>7} {'in flight':>9}")
    for kind, p, m, v in CASES:
        tl = sc.timeline(kind, p, m, v)
        idle = set(tl.idle_ticks())
        assert tl.ticks == sc.ticks(p, m, v) and idle == {sc.idle_ticks(p, m, v)}
        print(f"{kind:18} {p:2} {m:3} {v:2} {tl.ticks:5} ({sc.ticks(p, m, v):3}) "
              f"{max(idle):5} ({sc.idle_ticks(p, m, v):3}) {100 * tl.bubble():6.1f}% "
              f"{max(tl.in_flight()):9}")
    if render:
        for kind, p, m, v in (("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1),
                              ("interleaved_1f1b", 4, 8, 2)):
            print("\n" + sc.timeline(kind, p, m, v).render())


def _layer(w, h):
    return h + jnp.tanh(h @ w)


def _loss(head, y, targets):
    logits = y @ head
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], 1))


def step_table(time_it: bool) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("stage", "data"))
    k = jax.random.split(jax.random.key(0), 4)
    print(f"\n{'schedule':18} {'m':>3} {'temp bytes':>11} {'step ms':>8}")
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for m in (4, 8, 16):
            w = jax.random.normal(k[0], (LAYERS, WIDTH, WIDTH)) / 8
            w = jax.device_put(sc.to_schedule_layout(w, 4, v),
                               NamedSharding(mesh, P(None, "stage")))
            head = jax.random.normal(k[1], (WIDTH, CLASSES)) / 8
            table = jax.random.normal(k[2], (VOCAB, WIDTH))
            rows = NamedSharding(mesh, P("data"))
            tokens = jax.device_put(
                jax.random.randint(k[3], (m * ROWS,), 0, VOCAB), rows)
            run = jax.jit(lambda w, hd, tok, e, kind=kind, m=m, v=v: sc.pipeline_value_and_grad(
                _layer, w, tok, _loss, hd, tok % CLASSES, mesh=mesh, schedule=kind,
                microbatches=m, virtual=v, embed_fn=lambda e, t: e[t], embed_params=e,
                batch_axes=("data",)))
            compiled = run.lower(w, head, tokens, table).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            ms = float("nan")
            if time_it:
                jax.block_until_ready(compiled(w, head, tokens, table))
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    jax.block_until_ready(compiled(w, head, tokens, table))
                    times.append(time.perf_counter() - start)
                ms = 1e3 * statistics.median(times)
            print(f"{kind:18} {m:3} {temp:11,} {ms:8.2f}")


def model_table(time_it: bool) -> None:
    """The reference decoder's whole training step (Trainer, SGD) on stage 4 x data 2:
    temporary bytes per device at m = 4, 8, 16 microbatches of 4 sequences, per schedule,
    and (with ``time_it``) the step time."""
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.analysis.hlo import memory_stats
    from jaxpar.models import Transformer, TransformerConfig
    from jaxpar.parallel.pipeline import Schedule

    cfg = TransformerConfig(vocab_size=256, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2,
                            d_ff=256, max_seq_len=128)
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"stage": 4, "data": 2}), "fsdp_tp")
    kinds = (("circular", 2, 1), ("gpipe", 1, 2), ("1f1b", 1, 2), ("interleaved_1f1b", 2, 1))
    print(f"\nTransformer ({cfg.n_layers} layers, d_model {cfg.d_model}, seq 128), stage 4 x "
          "data 2, 4 sequences a microbatch: temp bytes per device")
    print(f"{'schedule':18} {'R':>2} {'L':>2} " + " ".join(f"{f'm={m}':>12}" for m in (4, 8, 16))
          + f" {'16 / 4':>7}" + (f" {'step ms (m=8)':>14}" if time_it else ""))
    for kind, repeats, per in kinds:
        temps, ms = [], float("nan")
        for m in (4, 8, 16):
            schedule = Schedule(4, m, repeats, kind, per)
            model = jaxpar.init_sharded(
                lambda s=schedule: Transformer(cfg, rngs=nnx.Rngs(0), pipeline=s), plan)
            trainer = jaxpar.Trainer(model, optax.sgd(0.1), plan)
            batch = np.asarray(jax.random.randint(jax.random.key(m), (4 * m, 129), 0, 256))
            temps.append(memory_stats(trainer.lower(batch).compile())["temp_bytes"])
            if time_it and m == 8:
                trainer.step(batch)
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    jax.block_until_ready(trainer.step_async(batch))
                    times.append(time.perf_counter() - start)
                ms = 1e3 * statistics.median(times)
        print(f"{kind:18} {repeats:2} {per:2} " + " ".join(f"{t:12,}" for t in temps)
              + f" {temps[2] / temps[0]:6.2f}x" + (f" {ms:14.1f}" if time_it else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-time", action="store_true", help="skip the step timings")
    parser.add_argument("--render", action="store_true", help="print the timelines")
    args = parser.parse_args()
    ticks_table(args.render)
    step_table(not args.no_time)
    model_table(not args.no_time)


if __name__ == "__main__":
    main()
