"""Write the tutorial notebooks in this folder (without outputs) from the cells below.

Run ``python notebooks/make_notebooks.py`` after editing a cell here (or in
``make_byo_notebook.py``, ``make_hf_notebook.py`` or ``make_long_context_notebook.py``,
which hold the fourth, fifth and sixth notebooks' cells); the ``.ipynb`` files are
generated, and ``tests/test_notebooks.py`` executes them on 8 simulated CPU devices.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from make_byo_notebook import bring_your_own_model
from make_hf_notebook import finetune_hf
from make_long_context_notebook import long_context_and_moe
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''\
# Simulate 8 CPU devices. This must run before JAX starts a backend, so it comes first.
import os

if os.path.basename(os.getcwd()) == "notebooks":  # Jupyter starts in the notebook's folder:
    os.chdir("..")  # paths below (configs/...) are the repository's
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)
print(jax.device_count(), "devices:", jax.devices())'''

# Each notebook is a list of cells; a string starting with "md:" is a markdown cell.
RULES_AND_MESHES = [
    '''md:# Logical rules and meshes

jaxpar separates *what a dimension means* from *where it lives*. Model code names every
dimension of every weight and activation (`"batch"`, `"embed"`, `"mlp"`, `"heads"`, ...).
A **mesh** arranges the devices on four named axes, `data`, `stage`, `fsdp` and `tensor`.
Ordered **rules** map the logical names onto mesh axes, and give every array a
`PartitionSpec`.

This notebook runs on 8 simulated CPU devices, so it works on a laptop: the shardings are
the ones a TPU pod or a GPU cluster would get.''',
    SETUP,
    '''md:## Meshes

`jaxpar.make_mesh` takes the size of each axis. Axes you leave out have size 1, and one
axis may be `-1`, which takes whatever devices are left. The mesh always has all four
axes, outermost (most tolerant of slow links) first.''',
    '''\
import jaxpar
from jaxpar.sharding.mesh import describe

mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
print(describe(mesh))
print(dict(mesh.shape))
print(mesh.device_ids.reshape(2, 2, 2))  # the stage axis (size 1) squeezed out

print(describe(jaxpar.make_mesh({"fsdp": -1, "tensor": 2})))
print(describe(jaxpar.make_mesh({"data": 8})))''',
    '''md:A mesh that does not match the device count is an error that shows the arithmetic:''',
    '''\
try:
    jaxpar.make_mesh({"data": 4, "tensor": 4})
except jaxpar.JaxparError as err:
    print("JaxparError:", err)''',
    '''md:## Rules

A `Rules` object is an ordered list of `(logical name, mesh axes)` pairs. For each array,
a rule fires for a dimension carrying its name when all of its mesh axes are still free in
that array: earlier rules win, later rules for the same name are fallbacks, and a target
of `None` keeps the dimension replicated. `explain` says which rule fired for each
dimension.''',
    '''\
rules = jaxpar.Rules([
    ("batch", ("data", "fsdp")),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("embed", None),
])
print(rules.spec(("embed", "mlp"), mesh))
print(rules.explain(("embed", "mlp"), mesh))
# "batch" takes data and fsdp first, so "embed" finds fsdp taken and stays replicated:
print(rules.explain(("batch", "embed"), mesh))''',
    '''md:Mesh axes of size 1 drop out, so one rule set serves every mesh shape: on a pure
data-parallel mesh the same weight is replicated.''',
    '''\
for axes in ({"data": 8}, {"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"tensor": 8}):
    m = jaxpar.make_mesh(axes)
    print(f"{describe(m):32s}", rules.spec(("embed", "mlp"), m))''',
    '''md:## Presets

jaxpar ships four strategies as presets, each a pair of rule sets: **parameter rules** (how
weights and optimizer state are stored) and **activation rules** (how the computation is
split). The table shows how each resolves the reference model's names on the
`data=2 x fsdp=2 x tensor=2` mesh.''',
    '''\
from jaxpar.analysis.report import table  # plain-text aligned columns
from jaxpar.sharding.rules import PRESETS, preset

weights = {
    "embedding (vocab, embed)": ("vocab", "embed"),
    "MLP up (embed, mlp)": ("embed", "mlp"),
    "MLP down (mlp, embed)": ("mlp", "embed"),
    "query (embed, heads, head_dim)": ("embed", "heads", "head_dim"),
}
rows = [(label, [str(preset(name)[0].spec(names, mesh)) for name in PRESETS])
        for label, names in weights.items()]
acts = ("batch", "seq", "mlp")
rows.append((f"activation {acts}", [str(preset(name)[1].spec(acts, mesh)) for name in PRESETS]))
print(table(["", *PRESETS], [(label, *specs) for label, specs in rows]))''',
    '''md:## A sharded model

`jaxpar.init_sharded` creates the reference Llama-style model straight into sharded
arrays: the shapes come from abstract evaluation, then the initialisation runs once under
`jax.jit` with the parameter shardings as outputs, so no device ever holds a whole sharded
weight. `param_table` lists every weight with its logical names and `PartitionSpec`.''',
    '''\
from flax import nnx

from jaxpar.models import Transformer, TransformerConfig
from jaxpar.sharding.partitioning import param_table

plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
cfg = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=256)
model = jaxpar.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), plan)

for row in param_table(plan, nnx.state(model)):
    print(f"{row['path']:26s} {str(row['shape']):18s} {str(row['logical_axes']):42s} "
          f"{str(row['spec']):28s} {row['bytes_per_device']:>7,d} B/device")''',
    '''md:## Drawing shardings

`jax.debug.visualize_array_sharding` draws a 2-D array's blocks and the devices that hold
each one. The embedding table is `(vocab, embed)`, stored as `(tensor, fsdp)`: four blocks,
each held by the two devices that differ only along `data` (data parallelism replicates).''',
    '''\
jax.debug.visualize_array_sharding(model.embed[...])
# One layer of the MLP's down projection, (mlp, embed) -> (tensor, fsdp):
jax.debug.visualize_array_sharding(model.blocks.mlp.w_down.kernel[...][0])''',
    '''md:The same picture with matplotlib, for any 2-D sharding: `devices_indices_map` says which
slice of the array each device holds. Below, one weight under each preset.''',
    '''\
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import NamedSharding


def draw_sharding(ax, sharding, shape, title):
    """Shade each block of a 2-D array by the devices that hold it."""
    blocks = {}
    for device, index in sharding.devices_indices_map(shape).items():
        (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(index, shape, strict=True))
        blocks.setdefault((r0, r1, c0, c1), []).append(device.id)
    colors = plt.cm.tab10(np.arange(len(blocks)) % 10)
    for color, ((r0, r1, c0, c1), ids) in zip(colors, sorted(blocks.items()), strict=False):
        ax.add_patch(plt.Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color,
                                   edgecolor="black", alpha=0.6))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, ",".join(map(str, sorted(ids))),
                ha="center", va="center", fontsize=8)
    ax.set_xlim(0, shape[1])
    ax.set_ylim(shape[0], 0)
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


shape, names = (256, 64), ("mlp", "embed")  # one layer of the MLP down projection
fig, axes = plt.subplots(1, len(PRESETS), figsize=(3 * len(PRESETS), 3.2))
for ax, name in zip(axes, PRESETS, strict=True):
    spec = preset(name)[0].spec(names, mesh)
    draw_sharding(ax, NamedSharding(mesh, spec), shape, f"{name}: {spec}")
fig.suptitle("w_down (mlp x embed) on data=2 x fsdp=2 x tensor=2; labels are device ids")
fig.tight_layout()''',
    '''md:## Activations

Inside the model, `jaxpar.constrain(x, names)` pins an activation to the sharding the
*activation* rules give its names, under the plan made current by `plan.activate()`. With
`fsdp_tp` the batch is split over `data` and `fsdp`, and the MLP's hidden dimension over
`tensor`.''',
    '''\
def hidden(x, w):
    h = jaxpar.constrain(x @ w, ("batch", "mlp"))
    return h


x = jax.numpy.ones((32, 64))
w_up = model.blocks.mlp.w_up.kernel[...][0]  # (embed, mlp)
with plan.activate():
    h = jax.jit(hidden)(x, w_up)
print(h.shape, h.sharding.spec)
fig, ax = plt.subplots(figsize=(4, 3))
draw_sharding(ax, h.sharding, h.shape, f"h (batch x mlp): {h.sharding.spec}")''',
    '''md:Next: `02_planning.ipynb` picks the mesh and strategy for a 7B and a 70B model, and
`03_pipeline_schedules.ipynb` adds the `stage` axis.''',
]

PIPELINE_SCHEDULES = [
    '''md:# Pipeline schedules

A pipeline splits a model's layers into **stages**, one group of devices per stage, and
splits the batch into **microbatches** that flow through the stages one after another.
While the pipeline fills and drains, some stages have nothing to do: the **bubble**.

jaxpar runs a pipeline as *vectorized stages*: the decoder layers are stored with two
leading axes `(repeat, stage)`, `stage` sharded over the mesh's `stage` axis, and every
iteration all stages apply their current layer at once (`jax.vmap`) before the
activations shift one stage on (a `collective-permute`). With `R` repeats
(a **circular** schedule) stage `s` holds layers `s, s + S, s + 2S, ...` and each
microbatch goes round the stages `R` times.''',
    SETUP,
    '''md:## The schedule as a timeline

In jaxpar's schedule, stage `s` at iteration `t` works on what stage 0 worked on at
iteration `t - s`: microbatch `(t - s) mod M` in repeat `(t - s) // M`, as long as
`0 <= t - s < R * M`. That is all we need to draw it. Below, the same 8-layer model on 4
stages: GPipe (each stage holds 2 consecutive layers, so one iteration costs 2 layer-times)
and the circular schedule with `R = 2` (each iteration is one layer).''',
    '''\
import matplotlib.pyplot as plt
import numpy as np

from jaxpar.parallel import pipeline as pl


def timeline(stages, microbatches, repeats):
    """grid[s, t] = (microbatch, repeat) that stage s runs at iteration t, or None (bubble)."""
    sched = pl.Schedule(stages, microbatches, repeats)
    grid = np.full((stages, sched.iterations), None, dtype=object)
    for s in range(stages):
        for t in range(sched.iterations):
            k = t - s
            if 0 <= k < repeats * microbatches:
                grid[s, t] = (k % microbatches, k // microbatches)
    return grid


def draw(ax, stages, microbatches, repeats, cell=1.0, title=""):
    grid = timeline(stages, microbatches, repeats)
    colors = plt.cm.tab10(np.arange(microbatches) % 10)
    for s in range(stages):
        for t in range(grid.shape[1]):
            if grid[s, t] is None:
                continue
            m, r = grid[s, t]
            ax.add_patch(plt.Rectangle((t * cell, s), cell, 1, facecolor=colors[m],
                                       edgecolor="white", alpha=0.45 + 0.5 * r / max(repeats, 2)))
            ax.text((t + 0.5) * cell, s + 0.5, f"{m}" + (f"/{r}" if repeats > 1 else ""),
                    ha="center", va="center", fontsize=8)
    busy = sum(c is not None for c in grid.flat) / grid.size
    ax.set_ylim(stages, 0)
    ax.set_yticks(np.arange(stages) + 0.5, [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("time (layer applications)")
    ax.set_title(f"{title}: {pl.describe_schedule(stages, microbatches, repeats)}",
                 fontsize=9)
    return 1 - busy


fig, axes = plt.subplots(2, 1, figsize=(10, 5))
gpipe = draw(axes[0], 4, 4, 1, cell=2.0, title="GPipe, 2 layers per stage")
circular = draw(axes[1], 4, 4, 2, cell=1.0, title="circular, R=2")
for ax in axes:
    ax.set_xlim(0, 14)  # GPipe: 7 iterations x 2 layers; circular: 11 x 1
fig.tight_layout()
print(f"bubble: GPipe {gpipe:.1%}, circular {circular:.1%}")
# The drawing agrees with jaxpar's formula (S - 1) / (R * M + S - 1):
assert np.isclose(gpipe, pl.bubble_fraction(4, 4, 1))
assert np.isclose(circular, pl.bubble_fraction(4, 4, 2))''',
    '''md:Cells are labelled `microbatch/repeat`. The circular schedule finishes after 11
layer-times instead of 14: its bubble is made of single layers, not pairs of them. The cost
is more stage-to-stage traffic (each microbatch crosses every stage boundary `R` times)
and, when `M > S`, a buffer on the stage-0 devices for microbatches waiting for their next
repeat.

## How the bubble shrinks

`bubble_fraction(S, M, R) = (S - 1) / (R * M + S - 1)`: more microbatches or more repeats
both shrink it. `Schedule.for_model` picks the deepest circular schedule the model allows
by default.''',
    '''\
ms = np.arange(1, 33)
fig, ax = plt.subplots(figsize=(6, 3.5))
for repeats in (1, 2, 4, 8):
    valid = ms[ms >= 8] if repeats > 1 else ms  # circular needs M >= S
    ax.plot(valid, [pl.bubble_fraction(8, m, repeats) for m in valid], label=f"R={repeats}")
ax.set_xlabel("microbatches M")
ax.set_ylabel("bubble fraction")
ax.set_title("S = 8 stages")
ax.legend()
fig.tight_layout()
print(pl.Schedule.for_model(n_layers=32, stages=8))
print(pl.Schedule.for_model(n_layers=32, stages=8).describe())''',
    '''md:## A real pipelined forward pass

Now the reference model on 8 devices: `stage=4 x data=2`, 8 layers, circular with
`R = 2` and `M = 4` microbatches. With a `Schedule`, the model stores its layers in the
`(repeat, stage)` layout and initialises them exactly as the unpipelined model would, so
the same seed gives the same weights and, up to float rounding, the same logits.''',
    '''\
from flax import nnx

import jaxpar
from jaxpar.analysis.hlo import collective_table
from jaxpar.models import Transformer, TransformerConfig

cfg = TransformerConfig(vocab_size=128, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)
schedule = pl.Schedule.for_model(cfg.n_layers, stages=4, microbatches=4, repeats=2)
print(schedule.describe())

plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"stage": 4, "data": 2}), "fsdp_tp")
piped = jaxpar.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0), pipeline=schedule),
                            plan)
plain = jaxpar.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)),
                            jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 8}), "fsdp_tp"))
wq = piped.blocks.attn.wq.kernel[...]
print("pipelined wq:", wq.shape, wq.sharding.spec)
print("plain wq:    ", plain.blocks.attn.wq.kernel[...].shape)''',
    '''\
tokens = jax.random.randint(jax.random.key(1), (16, 16), 0, cfg.vocab_size)


@nnx.jit
def forward(model, tokens):
    return model(tokens)


with plan.activate():
    piped_logits = forward(piped, tokens)
plain_logits = forward(plain, tokens)
diff = float(jax.numpy.max(jax.numpy.abs(piped_logits - plain_logits)))
print(f"logits {piped_logits.shape}, max |pipelined - unpipelined| = {diff:.2e}")
assert diff < 1e-4''',
    '''md:What moves between stages? The compiled HLO shows it: `collective-permute`s along the
`stage` axis carry microbatch activations from one stage to the next; the weights never
move. The permute sits in the body of the loop over pipeline iterations, so the HLO holds
it once though it runs 11 times; the all-reduce over `stage` at the end brings the finished
microbatches from the stage-0 devices to every stage.''',
    '''\
with plan.activate():
    hlo = forward.lower(piped, tokens).compile().as_text()
for row in collective_table(hlo, plan.mesh):
    print(f"{row['kind']:20s} over {','.join(row['axes']):12s} x{row['count']:<3d} "
          f"{row['bytes_per_device']:>9,d} bytes per device")''',
    '''md:## 1F1B and interleaved 1F1B: the backward pass in the schedule

Under GPipe and the circular schedule `jax.grad` runs the forward loop backwards, so each
stage keeps the activations of **all** `M` microbatches until the backward pass starts.
PipeDream's one-forward-one-backward order (1F1B) starts each microbatch's backward as
soon as it can and frees its activations then, so a stage holds at most `S` microbatches'
stage inputs however large `M` is; Megatron's interleaved variant gives each stage `v`
chunks of layers and cuts the bubble to `(S - 1) / (v M)` (idle over busy time).

`jaxpar.parallel.schedules.timeline` builds the tick table each stage follows (`F3`:
microbatch 3's forward, `B3` its backward, `.` idle; `F3.1`: of chunk 1).''',
    '''\
from jaxpar.parallel import schedules

for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
    tl = schedules.timeline(kind, stages=4, microbatches=8, virtual=v)
    print(tl.render())
    print(f"  idle ticks per stage {sorted(set(tl.idle_ticks()))} (formula "
          f"{schedules.idle_ticks(4, 8, v)}), most stage inputs held {max(tl.in_flight())}\\n")''',
    '''md:The same picture drawn: forward ticks light, backward ticks dark, one colour per
microbatch. All three take `2 (v M + S - 1)` ticks with `2 (S - 1)` idle on each stage;
they differ in how many microbatches each stage has begun but not finished.''',
    '''\
fig, axes = plt.subplots(3, 1, figsize=(11, 6.5))
for ax, (kind, v) in zip(axes, (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)),
                         strict=True):
    tl = schedules.timeline(kind, stages=4, microbatches=8, virtual=v)
    colors = plt.cm.tab10(np.arange(8))
    for t in range(tl.ticks):
        for s in range(tl.stages):
            for work, alpha in ((tl.forward[t][s], 0.35), (tl.backward[t][s], 0.9)):
                if work:
                    ax.add_patch(plt.Rectangle((t, s), 1, 1, facecolor=colors[work[0]],
                                               alpha=alpha, edgecolor="white"))
    ax.set_xlim(0, tl.ticks)
    ax.set_ylim(tl.stages, 0)
    ax.set_yticks(np.arange(4) + 0.5, [f"stage {s}" for s in range(4)])
    ax.set_title(f"{kind} (v={v}): {tl.ticks} ticks, peak in flight {max(tl.in_flight())}",
                 fontsize=9)
axes[-1].set_xlabel("tick")
fig.tight_layout()''',
    '''md:### Training under 1F1B

A stage runs its backward itself: it recomputes its chunk from the stored input with
`jax.vjp` and pulls back the gradient that arrived from the next stage; activations move
forwards and their gradients backwards by `ppermute` inside one `shard_map` over `stage`.
The Trainer does not know: the model's loss is a `jax.custom_vjp` whose gradient is the
schedule's. Trained for three SGD steps, the 1F1B model matches the unpipelined one.''',
    '''\
import optax


def losses(model, plan, steps=3):
    trainer = jaxpar.Trainer(model, optax.sgd(0.5), plan)
    batch = np.asarray(jax.random.randint(jax.random.key(2), (16, 17), 0, cfg.vocab_size))
    return [float(trainer.step(batch)["loss"]) for _ in range(steps)], trainer


one_f = pl.Schedule(4, 4, 1, "1f1b", layers_per_stage=2)
print(one_f.describe())
piped_1f1b = jaxpar.init_sharded(
    lambda: Transformer(cfg, rngs=nnx.Rngs(0), pipeline=one_f), plan)
got, trainer_1f1b = losses(piped_1f1b, plan)
single = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1]),
                                 "fsdp_tp")
want, _ = losses(jaxpar.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), single),
                 single)
print("1F1B:      ", [f"{x:.6f}" for x in got])
print("one device:", [f"{x:.6f}" for x in want])
assert np.allclose(got, want, rtol=1e-5)''',
    '''md:### Memory: what 1F1B buys

Compiled temporary bytes per device of the whole training step, at a fixed microbatch
size of 2 sequences, for `M = 4` and `M = 16`: the circular schedule keeps every
microbatch's activations, 1F1B about `S` stage inputs.''',
    '''\
from jaxpar.analysis.hlo import memory_stats

print(f"{'schedule':10} {'M=4':>10} {'M=16':>10}")
for kind, repeats, per in (("circular", 2, 1), ("1f1b", 1, 2)):
    temps = []
    for m in (4, 16):
        sched = pl.Schedule(4, m, repeats, kind, per)
        model = jaxpar.init_sharded(
            lambda sched=sched: Transformer(cfg, rngs=nnx.Rngs(0), pipeline=sched), plan)
        batch = np.zeros((4 * m, 17), np.int32)
        step = jaxpar.Trainer(model, optax.sgd(0.1), plan).lower(batch).compile()
        temps.append(memory_stats(step)["temp_bytes"])
    print(f"{kind:10} {temps[0]:10,} {temps[1]:10,}  x{temps[1] / temps[0]:.2f}")''',
    '''md:To train with a pipeline from the command line, give the mesh a `stage` axis:
`jaxpar train --config configs/tiny.yaml --devices 8 mesh.stage=2 mesh.data=2 mesh.fsdp=1
pipeline.microbatches=4`, and choose the schedule with `pipeline.schedule=1f1b` (or
`interleaved_1f1b` with `pipeline.repeats`, `gpipe`, `circular`).''',
]

PLANNING = [
    """md:# Planning a 7B and a 70B model

Which mesh, ZeRO stage, remat policy and microbatching should a run use? `jaxpar.planner`
answers from a **cost model** that needs no devices: per-device memory (parameters,
gradients, optimizer state, activations by remat policy, XLA's temporaries), compute time
from the model's FLOPs over the chip's peak, and the time of every collective over the
fast in-slice links (ICI, NVLink) or the data-centre network (DCN, InfiniBand). The search
enumerates meshes over `data x stage x fsdp x tensor`, drops what does not fit in HBM and
ranks the rest by estimated step time.

Here: a Llama 7B and a Llama 70B (`configs/llama-7b.yaml`, `configs/llama-70b.yaml`),
global batch 512 x 4096 tokens, on a TPU v5p pod and on an H100 cluster. The last section
checks the cost model against what XLA compiles, on 8 simulated CPU devices.""",
    SETUP,
    """md:## The device catalog

Per chip: peak dense bf16 FLOP/s, HBM, the bandwidth one chip pushes into collectives
inside its ICI domain and across the DCN, and how many chips share one ICI domain. Each
figure's public source is cited in `jaxpar/planner/catalog.py`; custom chips can be added
from YAML (`--catalog`).""",
    """\
import jaxpar
from jaxpar.analysis.report import table
from jaxpar.planner import BUILTIN, parse_chips, plan

rows = [(name, f"{c.peak_flops / 1e12:.0f}", f"{c.hbm_bytes / 2**30:.0f}",
         f"{c.ici_bw / 1e9:.0f}", f"{c.dcn_bw / 1e9:.1f}", c.domain)
        for name, c in BUILTIN.items()]
print(table(["chip", "TFLOP/s", "HBM GiB", "ICI GB/s", "DCN GB/s", "chips per ICI domain"],
            rows, right=(1, 2, 3, 4, 5)))
for chips in ("tpu-v5p:256", "tpu-v5p:512", "h100:64", "h100:32"):
    print(chips, "->", parse_chips(chips).describe())""",
    """md:## 7B on 256 TPU v5p chips

`plan` returns the best plans, fastest first, each an `Estimate` with the candidate (mesh
and knobs), `memory`, `step_time_s`, `mfu`, `fits` and a `reason` saying why it beats the
next one. The same search runs behind `jaxpar plan --model configs/llama-7b.yaml --chips
tpu-v5p:256 --global-batch 512 --seq 4096`.""",
    """\
GLOBAL_BATCH, SEQ = 512, 4096


def show(plans):
    rows = [(p.candidate.describe(), p.candidate.zero_stage, p.candidate.remat,
             p.candidate.microbatches, f"{p.memory_per_device_bytes / 2**30:.1f}",
             f"{p.step_time_s:.2f}", f"{p.mfu:.2f}",
             f"{GLOBAL_BATCH * SEQ / p.step_time_s:,.0f}") for p in plans]
    print(table(["mesh", "zero", "remat", "micro", "GiB/device", "step s", "MFU", "tokens/s"],
                rows, right=(1, 3, 4, 5, 6, 7)))
    print("winner:", plans[0].reason)


plans_7b = plan("configs/llama-7b.yaml", chips="tpu-v5p:256", global_batch=GLOBAL_BATCH,
                seq=SEQ)
show(plans_7b)""",
    """md:## The other three: 7B on 64 H100s, 70B on 512 v5p chips and on 32 H100s

GPU clusters are 8-GPU NVLink nodes joined by InfiniBand, so `h100:64` is 8 slices: the
planner keeps tensor parallelism inside a node and puts the axes that communicate least
(data, then pipeline stages) across nodes.""",
    """\
SCENARIOS = [("configs/llama-7b.yaml", "tpu-v5p:256"), ("configs/llama-7b.yaml", "h100:64"),
             ("configs/llama-70b.yaml", "tpu-v5p:512"), ("configs/llama-70b.yaml", "h100:32")]
winners = {("configs/llama-7b.yaml", "tpu-v5p:256"): plans_7b[0]}
for model, chips in SCENARIOS[1:]:
    print(f"--- {model} on {chips}")
    plans = plan(model, chips=chips, global_batch=GLOBAL_BATCH, seq=SEQ, top=3)
    show(plans)
    winners[(model, chips)] = plans[0]""",
    """md:## Strategies side by side

The search compares meshes; to see *why* it lands where it does, fix the layout to a few
classic strategies and let each pick its best remat policy and gradient-accumulation
microbatches (the fastest combination that fits, or the leanest one if nothing fits):

* **DP**: weights, gradients and Adam state replicated on every chip;
* **ZeRO-1 / ZeRO-3**: data parallel, with the optimizer state (1) or everything (3) split
  over the data-parallel chips;
* **FSDP**: weights split over an `fsdp` axis inside each slice, data parallel across;
* **FSDP + TP**: Megatron tensor parallelism over 8 chips of a slice, FSDP over the rest;
* **FSDP + PP**: 4 pipeline stages, FSDP inside each.

`estimate` gives the cost model's figures for one `Candidate`.""",
    """\
from jaxpar.planner import Candidate, estimate, resolve_model
from jaxpar.planner.cost import check_divisible
from jaxpar.planner.search import REMATS


def strategies(machine):
    n, s = machine.per_slice, machine.slices
    pp = (({"stage": 4, "fsdp": n // 4}, {"data": s}) if s == 1 else
          ({"fsdp": n}, {"stage": 4, "data": s // 4}))
    return {
        "DP": ({"data": n}, {"data": s}, 0),
        "ZeRO-1": ({"data": n}, {"data": s}, 1),
        "ZeRO-3": ({"data": n}, {"data": s}, 3),
        "FSDP": ({"fsdp": n}, {"data": s}, 0),
        "FSDP + TP": ({"fsdp": n // 8, "tensor": 8}, {"data": s}, 0),
        "FSDP + PP": (*pp, 0),
    }


def tuned(model, chips, ici, dcn, zero):
    \"\"\"The fastest (remat, microbatches) that fits, else the one needing least memory.\"\"\"
    resolved = resolve_model(model)
    best = leanest = None
    for remat in REMATS:
        mb = 1
        while True:
            cand = Candidate.make(ici, dcn, zero_stage=zero, remat=remat, microbatches=mb)
            if check_divisible(resolved.spec_for(cand.sizes["stage"]), cand, GLOBAL_BATCH):
                break  # the batch does not split any further
            est = estimate(model, cand, chips=chips, global_batch=GLOBAL_BATCH, seq=SEQ)
            if est.fits:
                if best is None or est.step_time_s < best.step_time_s:
                    best = est
                break
            if leanest is None or est.memory_per_device_bytes < leanest.memory_per_device_bytes:
                leanest = est
            mb *= 2
    return best or leanest


results = {}
for model, chips in SCENARIOS:
    machine = parse_chips(chips)
    results[(model, chips)] = {name: tuned(model, chips, *layout)
                               for name, layout in strategies(machine).items()}
    results[(model, chips)]["planner"] = winners[(model, chips)]
    fitting = {k: e for k, e in results[(model, chips)].items() if e.fits}
    fastest = min(fitting, key=lambda k: fitting[k].step_time_s) if fitting else "none"
    print(f"{model} on {chips}: {len(fitting)} of 7 fit; fastest: {fastest}")""",
    """md:Memory per device (arguments: weights and optimizer state; temporaries: activations
and XLA's working buffers) against the chip's HBM, and the estimated step time. Hatched
bars do not fit even with full remat and the most microbatches the batch allows; bars
taller than the plot are cut, with their height written on them.""",
    """\
import matplotlib.pyplot as plt
import numpy as np

fig, axes = plt.subplots(len(SCENARIOS), 2, figsize=(12, 3.2 * len(SCENARIOS)))
for row, (model, chips) in zip(axes, SCENARIOS, strict=True):
    ests = results[(model, chips)]
    names = list(ests)
    x = np.arange(len(names))
    args = np.array([e.memory["argument_bytes"] for e in ests.values()]) / 2**30
    temp = np.array([e.memory["temp_bytes"] for e in ests.values()]) / 2**30
    hatch = ["" if e.fits else "//" for e in ests.values()]
    row[0].bar(x, args, label="arguments (state)", hatch=hatch)
    row[0].bar(x, temp, bottom=args, label="temporaries (activations)", hatch=hatch)
    hbm = next(iter(ests.values())).hbm_bytes / 2**30
    row[0].axhline(hbm, color="black", linestyle="--", label=f"HBM {hbm:.0f} GiB")
    top = 2.2 * hbm  # bars above this are cut; their height is written on them
    row[0].set_ylim(0, top)
    for i, total in enumerate(args + temp):
        if total > top:
            row[0].text(i, 0.97 * top, f"{total:,.0f}", ha="center", va="top", fontsize=7,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    row[0].set_ylabel("GiB per device")
    row[0].set_title(f"{model.split('/')[-1]} on {chips}: memory", fontsize=10)
    row[1].bar(x, [e.step_time_s for e in ests.values()], hatch=hatch,
               color=["tab:green" if e.fits else "tab:gray" for e in ests.values()])
    for i, e in enumerate(ests.values()):
        row[1].text(i, e.step_time_s, f"MFU {e.mfu:.2f}", ha="center", va="bottom", fontsize=7)
    row[1].set_ylabel("seconds per step")
    row[1].set_title(f"{model.split('/')[-1]} on {chips}: step time", fontsize=10)
    for ax in row:
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
axes[0][0].legend(fontsize=7)
fig.tight_layout()""",
    """md:The pattern to look for: replicated state (DP) is the first thing that stops fitting
as the model grows; splitting it (ZeRO, FSDP) leaves activations as the big item, which
remat and gradient accumulation trade for time; tensor parallelism splits activations too
but puts all-reduces on the critical path of every layer, cheap over TPU ICI, dearer across
a GPU node; pipeline stages add a bubble but communicate little.

## The winner as a run config

`jaxpar plan ... --write run.yaml` writes the winning plan as a config that `jaxpar train`
runs; in Python, `run_config` does the same.""",
    """\
import tempfile
from pathlib import Path

from jaxpar.planner.api import run_config

base = jaxpar.load_config("configs/llama-7b.yaml")
config = run_config(plans_7b[0], base, None, GLOBAL_BATCH, SEQ)
print("mesh:", config.mesh)
print("plan:", config.plan)
with tempfile.TemporaryDirectory() as tmp:
    config.save(Path(tmp) / "run.yaml")
    assert jaxpar.load_config(Path(tmp) / "run.yaml") == config""",
    """md:## Checking the cost model against the compiler

A plan is only as good as its cost model. `jaxpar inspect` compiles one train step
(without running it) and puts the planner's prediction beside what XLA reports: per-device
memory, every collective in the optimized HLO, and FLOPs. Here on the 8 simulated CPU
devices, for the tiny config on a `data=2 x fsdp=2 x tensor=2` mesh (the CLI:
`jaxpar inspect --config configs/tiny.yaml --devices 8`).""",
    """\
from jaxpar.analysis.inspection import inspect_config
from jaxpar.analysis.report import render_inspection

tiny = jaxpar.load_config("configs/tiny.yaml", ["train.global_batch=16", "train.seq_len=64"])
report = inspect_config(tiny, source="configs/tiny.yaml")
text = render_inspection(report)
print(text[text.index("Memory per device"):])""",
]

NOTEBOOKS = {
    "01_rules_and_meshes.ipynb": RULES_AND_MESHES,
    "02_planning.ipynb": PLANNING,
    "03_pipeline_schedules.ipynb": PIPELINE_SCHEDULES,
    "04_bring_your_own_model.ipynb": bring_your_own_model(SETUP),  # make_byo_notebook.py
    "05_finetune_hf.ipynb": finetune_hf(SETUP),  # make_hf_notebook.py
    "06_long_context_and_moe.ipynb": long_context_and_moe(SETUP),  # make_long_context_notebook.py
}


def build(cells: list[str]) -> nbformat.NotebookNode:
    """A notebook (no outputs) from cell sources; ``md:`` marks markdown."""
    nb = new_notebook()
    nb.cells = [new_markdown_cell(c[3:]) if c.startswith("md:") else new_code_cell(c)
                for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        nbformat.write(build(cells), HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
