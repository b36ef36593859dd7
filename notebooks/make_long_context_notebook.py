"""Cells of ``06_long_context_and_moe.ipynb``: splitting the sequence (context and sequence
parallelism) and the experts (expert parallelism). Imported by ``make_notebooks.py``,
which writes the notebook."""

from __future__ import annotations


def long_context_and_moe(setup: str) -> list[str]:
    """The notebook's cells (``md:`` marks markdown); ``setup`` is the device set-up cell."""
    return [
        '''md:# Long sequences and mixtures of experts

Two more ways to split a training step over devices, each with its own mesh axis:

1. **context parallelism** (`mesh.context`): the sequence of every activation is split,
   and attention stays exact by gathering keys and values (`allgather`) or passing them
   around a ring (`ring`), with chunks laid out so every device does the same causal work;
2. **sequence parallelism** (`plan.sequence_parallel`): under tensor parallelism, the
   residual stream between blocks is split along the sequence too, so each all-reduce
   becomes a reduce-scatter plus an all-gather;
3. **expert parallelism** (`mesh.expert`): a mixture-of-experts MLP whose experts are
   spread over devices, tokens travelling to them all-to-all;
4. and what the planner makes of a 70B model at 128k tokens and of Mixtral 8x7B.''',
        setup,
        '''md:## Context parallelism: same numbers, a fraction of the memory

The reference decoder on `data=2 x context=4`, trained for two steps beside the same model
on one device. The activation rules send the logical `seq` axis to `context`; attention
(`jaxpar/parallel/context.py`) runs per shard inside `shard_map`.''',
        '''\
import dataclasses

import numpy as np
from flax import nnx

import jaxpar
from jaxpar.analysis.hlo import collective_table
from jaxpar.config.schema import load_config
from jaxpar.data.loader import TokenLoader, load_tokens
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.training.optimizer import make_optimizer

cfg = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4,
                        d_ff=128, max_seq_len=256)
optimizer = make_optimizer(load_config(None, ["train.lr=3e-3"]).train)
data = TokenLoader(load_tokens("stdlib", 200_000), 8, 64, seed=0)
batches = [data.batch(i) for i in range(2)]


def trainer_on(axes, devices=None, config=cfg, **knobs):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes, devices=devices), "fsdp_tp",
                                   **knobs)
    model = jaxpar.init_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), plan)
    return jaxpar.Trainer(model, optimizer, plan)


one = trainer_on({"data": 1}, devices=jax.devices()[:1])
reference = [one.step(b)["loss"] for b in batches]
for kind in ("allgather", "ring"):
    trainer = trainer_on({"data": 2, "context": 4}, context_attention=kind)
    losses = [trainer.step(b)["loss"] for b in batches]
    table = collective_table(trainer.lower(batches[0]).compile().as_text(),
                             trainer.plan.mesh)
    moved = {(r["kind"], "x".join(r["axes"])): r["count"] for r in table
             if "context" in r["axes"]}
    print(f"{kind:9s} losses {np.round(losses, 6)} (one device {np.round(reference, 6)}), "
          f"over context: {moved}")
print("attention activations:", trainer.plan.act_spec(("batch", "seq", "heads", "head_dim")))''',
        '''md:### Balanced chunks

Causal attention is a triangle: with the sequence cut in `c` contiguous pieces the last
device's queries see every key and the first device's only its own. jaxpar's layout cuts
the sequence in `2c` chunks and gives device `i` chunks `i` and `2c - 1 - i`; the ring
skips blocks no query can see, so the work per device is what the plot counts.''',
        '''\
import matplotlib.pyplot as plt

from jaxpar.parallel.context import balanced_order

SEQ_LEN, C = 1024, 4


def work_per_device(positions):
    shards = np.split(np.asarray(positions), C)
    # visible (query, key) pairs each device's queries have, over the whole sequence
    return [int(sum(p + 1 for p in shard)) for shard in shards]


natural = work_per_device(np.arange(SEQ_LEN))
balanced = work_per_device(balanced_order(SEQ_LEN, C))
fig, ax = plt.subplots(figsize=(6, 2.5))
ax.bar(np.arange(C) - 0.2, natural, 0.4, label="contiguous")
ax.bar(np.arange(C) + 0.2, balanced, 0.4, label="balanced (jaxpar)")
ax.set_xlabel("context device"), ax.set_ylabel("visible q-k pairs"), ax.legend()
plt.show()
print("busiest / mean work: contiguous", round(max(natural) / np.mean(natural), 2),
      "balanced", round(max(balanced) / np.mean(balanced), 2))''',
        '''md:### Memory per device at a long sequence

Compiled temporary memory of one training step at 1024 tokens (batch 1, one layer, XLA's
attention that holds the seq x seq scores), on one device and split over 2 and 4 (the
README's table is the same at 2048).''',
        '''\
long = dataclasses.replace(cfg, n_layers=1, max_seq_len=1024, attention="xla")
tokens = np.zeros((1, 1025), np.int32)
for c in (1, 2, 4):
    trainer = trainer_on({"context": c}, devices=jax.devices()[:c], config=long)
    temp = trainer.lower(tokens).compile().memory_analysis().temp_size_in_bytes
    print(f"context={c}: {temp / 2**20:7.1f} MiB of temporaries per device")''',
        '''md:## Sequence parallelism

Megatron tensor parallelism all-reduces each block's attention and MLP outputs. With
`sequence_parallel=True` the residual stream (logical `residual_seq`) is split over the
tensor axis as well: the all-reduce becomes a reduce-scatter into the split residual, and
the next block all-gathers its normed input. Same bytes on the wire, but norms, residual
adds and dropout work on a quarter of the sequence. (The CPU backend writes a
reduce-scatter as an all-reduce whose result each device slices;
`jaxpar.analysis.hlo.count_reduce_scatters` counts both forms.)''',
        '''\
from jaxpar.analysis.hlo import count_reduce_scatters

for sp in (False, True):
    trainer = trainer_on({"data": 2, "tensor": 4}, sequence_parallel=sp)
    loss = trainer.step(batches[0])["loss"]
    hlo = trainer.lower(batches[1]).compile().as_text()
    table = collective_table(hlo, trainer.plan.mesh)
    moved = {r["kind"]: r["count"] for r in table if r["axes"] == ["tensor"]}
    print(f"sequence_parallel={sp!s:5}: loss {loss:.6f}; over tensor: {moved}, of which "
          f"reduce-scatters: {count_reduce_scatters(hlo)}; residual "
          f"{trainer.plan.act_spec(('batch', 'residual_seq', 'embed'))}")''',
        '''md:## A mixture of experts on `expert=4 x fsdp=2`

`model.n_experts=4`, two experts per token: each layer's MLP becomes four gated experts
and a router (`jaxpar/models/moe.py`). Expert weights carry the logical axis `expert`, which the
rules map to the `expert` mesh axis; the batch is split over `fsdp x expert`, so sending
tokens to their experts moves the `expert` axis from the batch to the experts: an
all-to-all. The router's statistics come back as metrics, the load-balancing and z-losses
join the training loss.''',
        '''\
moe = dataclasses.replace(cfg, n_experts=4, experts_per_token=2, expert_d_ff=64)
single = trainer_on({"data": 1}, devices=jax.devices()[:1], config=moe)
spread = trainer_on({"expert": 4, "fsdp": 2}, config=moe)
for b in batches:
    a, m = single.step(b), spread.step(b)
    print(f"step {m['step']}: loss {m['loss']:.6f} (one device {a['loss']:.6f}), "
          f"load balance {m['moe_load_balance']:.4f}, z {m['moe_router_z']:.3f}, "
          f"dropped {m['moe_dropped']:.3f}")
w = spread.state["params"]["blocks"]["mlp"]["w_gate"]["kernel"]
print("w_gate", w.shape, w.sharding.spec)
table = collective_table(spread.lower(batches[0]).compile().as_text(), spread.plan.mesh)
print({(r["kind"], "x".join(r["axes"])): r["count"] for r in table})''',
        '''md:## The planner at 128k tokens and for Mixtral

The cost model knows the new axes: activations split by `context`, the K/V all-gathers or
ring permutes (overlapped with attention), expert weights split by `expert`, the
all-to-alls of dispatch and combine and a margin for uneven expert load. A 70B model at
128k tokens on a TPU v5p pod, and Mixtral 8x7B on 64 H100s:''',
        '''\
from jaxpar.planner import plan

for model, chips, batch, seq in [("configs/llama-70b.yaml", "tpu-v5p:512", 64, 131072),
                                 ("configs/mixtral-8x7b.yaml", "h100:64", 256, 4096)]:
    best = plan(model, chips=chips, global_batch=batch, seq=seq, top=2)[0]
    print(f"--- {model} on {chips}, {batch} x {seq}: {best.candidate.describe()}, "
          f"{best.memory_per_device_bytes / 2**30:.1f} GiB per device, "
          f"{best.step_time_s:.2f} s a step")
    print("why:", best.reason)''',
    ]
