"""Cells of ``04_bring_your_own_model.ipynb``: a model jaxpar did not write, sharded from
outside. Imported by ``make_notebooks.py``, which writes the notebook."""

from __future__ import annotations


def bring_your_own_model(setup: str) -> list[str]:
    """The notebook's cells (``md:`` marks markdown); ``setup`` is the device set-up cell."""
    return [
        '''md:# Bring your own model

jaxpar's reference decoder names every weight and activation itself. Most models do not:
a port of a Llama checkpoint is plain Flax, with no logical names on its weights and no
sharding constraints inside. This notebook shards such a model without touching its code:

1. built as it is, under an FSDP x TP plan, everything stays replicated, and jaxpar says so;
2. **annotations** give the weights logical names by path;
3. **layouts** pin the decoder blocks' outputs, so GSPMD has nothing left to guess;
4. the model trains on `fsdp=4 x tensor=2`, then LoRA adapters on every attention and MLP
   projection train alone;
5. the compiled FSDP step, read from the HLO, with and without layouts;
6. a Flax **linen** model, wrapped with `jaxpar.from_linen` and trained the same way.''',
        setup,
        '''md:## The model

A small Llama-like decoder: RMSNorm, rotary embeddings, grouped-query attention (4 query
heads sharing 2 key/value heads) through `jax.nn.dot_product_attention`, a SwiGLU MLP.
Attention projections are `nnx.LinearGeneral` with kernels shaped `(embed, heads,
head_dim)`. Nothing here imports jaxpar.''',
        '''\
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, dim):
        self.scale = nnx.Param(jnp.ones((dim,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


def rotary(x):  # (batch, seq, heads, head_dim)
    half = x.shape[-1] // 2
    angle = jnp.arange(x.shape[1])[:, None] * 10_000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
    lo, hi = x[..., :half], x[..., half:]
    return jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, dim, heads, kv_heads, *, rngs):
        hd = dim // heads
        self.q_proj = nnx.LinearGeneral(dim, (heads, hd), use_bias=False, rngs=rngs)
        self.k_proj = nnx.LinearGeneral(dim, (kv_heads, hd), use_bias=False, rngs=rngs)
        self.v_proj = nnx.LinearGeneral(dim, (kv_heads, hd), use_bias=False, rngs=rngs)
        self.o_proj = nnx.LinearGeneral((heads, hd), dim, axis=(-2, -1), use_bias=False,
                                        rngs=rngs)

    def __call__(self, x):
        q, k, v = rotary(self.q_proj(x)), rotary(self.k_proj(x)), self.v_proj(x)
        return self.o_proj(jax.nn.dot_product_attention(q, k, v, is_causal=True))


class FeedForward(nnx.Module):
    def __init__(self, dim, hidden, *, rngs):
        self.gate_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nnx.Module):
    def __init__(self, dim, heads, kv_heads, hidden, *, rngs):
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, rngs=rngs)
        self.mlp = FeedForward(dim, hidden, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nnx.Module):
    def __init__(self, vocab=256, dim=64, heads=4, kv_heads=2, hidden=192, layers=2, *, rngs):
        self.embed_tokens = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([DecoderBlock(dim, heads, kv_heads, hidden, rngs=rngs)
                                for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


new_model = lambda: TinyLlama(rngs=nnx.Rngs(0))
print(new_model()(jnp.zeros((2, 8), jnp.int32)).shape)  # runs on one device, no jaxpar''',
        '''md:## 1. As it comes

`init_sharded` builds the model straight into the shardings the plan's parameter rules
give. With no logical names on any weight there is nothing for the rules to act on, so
every weight is replicated on all 8 devices; jaxpar notices that a plan meant to shard
left most parameter bytes whole and warns (once), naming the largest arrays.
`replication_report` gives the same figures, and `jaxpar inspect` prints them as
"replicated by the rules".''',
        '''\
import jaxpar

mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2})
bare = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
model = jaxpar.init_sharded(new_model, bare)  # -> ReplicationWarning
report = jaxpar.replication_report(bare, nnx.state(model))
print(f"replicated: {report['replicated_share']:.0%} of {report['total_bytes']:,} bytes")
print("largest:", report["largest"][:3])''',
        '''md:## 2. Names by path

`jaxpar.annotate(model, [(path_regex, names), ...])` attaches logical names to every
variable whose path matches, first matching pattern first. Names describe the array as it
is stored and may be shorter than it: `("embed", "heads")` on a `(64, 4, 16)` kernel leaves
`head_dim` unnamed. It works in place on a built model (or on an abstract one); as a plan
field, `annotations=`, it is applied by `init_sharded` before anything is placed. Norm
scales stay unnamed, hence replicated: they are tiny.''',
        '''\
ANNOTATIONS = [
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"attn/q_proj/kernel$", ("embed", "heads")),
    (r"attn/(k|v)_proj/kernel$", ("embed", "kv_heads")),
    (r"attn/o_proj/kernel$", ("heads", None, "embed")),
    (r"mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
]
jaxpar.annotate(model, ANNOTATIONS)
print(jaxpar.logical_names(model.blocks[0].attn.q_proj.kernel))
report = jaxpar.replication_report(bare, nnx.state(model))
print(f"replicated now: {report['replicated_share']:.1%}, largest: {report['largest'][:2]}")''',
        '''md:Rules resolve names against the mesh, and they are forgiving where real models need
it. A rule whose mesh axes do not divide a dimension falls through to the next rule for
that name, or to replicated: with 2 key/value heads on 4-way tensor parallelism the K and
V kernels stay whole on `tensor`, as Megatron does. `strict=True` makes that an error.
Mesh-axis names, their aliases (`dp`, `tp`/`mp`, `pp`) and `PartitionSpec` entries are
accepted where logical names go, so a model annotated for a mesh works unchanged.''',
        '''\
from jax.sharding import PartitionSpec as P

wide_tp = jaxpar.make_mesh({"fsdp": 2, "tensor": 4})
rules = jaxpar.Plan.from_preset(wide_tp, "fsdp_tp").param_rules
print(rules.explain(("embed", "kv_heads", "head_dim"), wide_tp, shape=(64, 2, 16)))
try:
    jaxpar.Plan.from_preset(wide_tp, "fsdp_tp", strict=True).param_spec(
        ("embed", "kv_heads"), shape=(64, 2, 16), path="k_proj/kernel")
except jaxpar.JaxparError as err:
    print("strict:", err)
plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
print(plan.param_spec(("fsdp", "tp"), shape=(64, 192)))           # mesh axes, an alias
print(plan.param_spec(tuple(P(None, ("fsdp", "tensor"))), shape=(256, 64)))''',
        '''md:## 3. Layouts

Names on weights are enough for correct sharded training. Between the weights and the
batch, though, GSPMD guesses activation layouts, and in a model without constraints the
guesses can be poor. `layouts` (or `jaxpar.constrain_outputs(model, ...)`) pins the output
of every module a target matches, a class, `"type:ClassName"` or a path regex, to logical
names resolved by the activation rules. A regex that matches a *variable* pins that
weight's compute layout instead: the embedding table is gathered whole before the lookup
instead of the looked-up rows being exchanged with all-to-alls. The matched modules keep
their class, attributes and paths; outside a plan the pins do nothing.

Written out here to show the mechanism: a plan with no `layouts` of its own pins the
same two things by default (`layouts="auto"`: the outputs of repeated blocks such as
these `nnx.List` entries, and annotated `nnx.Embed` tables); `layouts=()` opts out, as
section 5 does for its "without layouts" step.''',
        '''\
from jaxpar.sharding.layouts import pinned
from jaxpar.sharding.paths import path_str

LAYOUTS = [
    (DecoderBlock, ("batch", "seq", "embed")),
    (r"embed_tokens/embedding$", ("vocab", "embed")),
]
plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", annotations=ANNOTATIONS, layouts=LAYOUTS)
model = jaxpar.init_sharded(new_model, plan)  # annotated, pinned, then placed

for path, outputs, weights in pinned(model):
    print(f"pinned {path:13s} outputs {outputs}, weights {weights}")
print("still a DecoderBlock:", isinstance(model.blocks[0], DecoderBlock))
for path, var in nnx.to_flat_state(nnx.state(model)):
    if path_str(path).startswith(("embed", "blocks/0/attn", "blocks/0/mlp", "lm_head")):
        value = var.get_value()
        print(f"{path_str(path):30s} {str(value.shape):12s} {value.sharding.spec}")''',
        '''md:## 4. Training on fsdp=4 x tensor=2, then LoRA

The `Trainer` takes the model as it is. The default loss is next-token cross-entropy on
token ids shaped `(batch, seq + 1)`; a model with other inputs takes
`loss_fn=fn(model, batch)` and any pytree batch.''',
        '''\
import optax

from jaxpar.data.loader import TokenLoader, load_tokens

data = TokenLoader(load_tokens("stdlib", 1_000_000), global_batch=16, seq_len=32)
trainer = jaxpar.Trainer(model, optax.adamw(3e-3), plan)
losses = [trainer.step(data.batch(step))["loss"] for step in range(10)]
print(" ".join(f"{x:.2f}" for x in losses))
assert losses[-1] < losses[0]''',
        '''md:`lora.apply` adds adapters to every `nnx.Linear`, `nnx.LinearGeneral` or `nnx.Einsum`
whose path matches. They take their shardings from the kernels they adapt, so they need no
annotation of their own; with `trainable=nnx.LoRAParam` only they get gradients and
optimizer state.''',
        '''\
from jaxpar.adapters import lora

tuned = trainer.model
with plan.activate():
    lora.apply(tuned, r"attn/[qkvo]_proj$|mlp/(gate|up|down)_proj$", rank=4, alpha=8,
               plan=plan)
n_lora = lora.count_params(tuned, nnx.LoRAParam)
print(f"{len(lora.adapted(tuned))} projections adapted, {n_lora:,} trainable, "
      f"{lora.count_params(tuned, nnx.Param) - n_lora:,} frozen")
a = tuned.blocks[0].attn.q_proj.lora_a[...]
print("q_proj lora_a", a.shape, a.sharding.spec)
ft = jaxpar.Trainer(tuned, optax.adamw(1e-2), plan, trainable=nnx.LoRAParam)
before = ft.eval_loss(data.batch(100))
for step in range(10, 16):
    ft.step(data.batch(step))
print(f"held-out batch: {before:.3f} -> {ft.eval_loss(data.batch(100)):.3f}")''',
        '''md:## 5. What XLA did, with and without layouts

Compile (without running) one train step of the annotated model on a pure FSDP mesh,
`fsdp=8`, once without layouts and once with them, and count the collectives in the
optimized HLO. Without guidance GSPMD moves activations between layouts with all-to-alls
and keeps more temporaries; with the two layout lines the step only all-gathers weights
just in time and reduces gradients.''',
        '''\
from jaxpar.analysis import hlo

fsdp = jaxpar.make_mesh({"fsdp": 8})
batch = data.batch(0)
tables, temps = {}, {}
for label, layouts in (("without layouts", ()), ("with layouts", LAYOUTS)):
    p = jaxpar.Plan.from_preset(fsdp, "fsdp", annotations=ANNOTATIONS, layouts=layouts)
    step = jaxpar.Trainer(jaxpar.init_sharded(new_model, p), optax.adamw(3e-3), p)
    compiled = step.lower(batch).compile()
    tables[label] = hlo.collective_table(compiled.as_text(), fsdp)
    temps[label] = hlo.memory_stats(compiled).get("temp_bytes", 0)
    print(f"--- {label}: {temps[label]:,} temp bytes per device")
    for row in tables[label]:
        print(f"  {row['kind']:20s} over {','.join(row['axes']):6s} x{row['count']:<3d} "
              f"{row['bytes_per_device']:>10,d} B/device")
counts = {label: {r["kind"]: 0 for r in rows} for label, rows in tables.items()}
for label, rows in tables.items():
    for r in rows:
        counts[label][r["kind"]] += r["count"]
assert counts["with layouts"].get("all-to-all", 0) == 0''',
        '''\
import matplotlib.pyplot as plt
import numpy as np

kinds = sorted({k for c in counts.values() for k in c})
x = np.arange(len(kinds))
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4),
                                  gridspec_kw={"width_ratios": [3, 1]})
for i, (label, c) in enumerate(counts.items()):
    bars = left.bar(x + (i - 0.5) * 0.4, [c.get(k, 0) for k in kinds], 0.4, label=label)
    left.bar_label(bars, fontsize=8)
left.set_xticks(x, kinds)
left.set_ylabel("ops in the compiled step")
left.set_title("collectives of one fsdp=8 train step", fontsize=10)
left.legend(fontsize=8)
right.bar(list(temps), [t / 2**20 for t in temps.values()], color=["tab:blue", "tab:orange"])
right.set_ylabel("MiB per device")
right.set_title("temporaries", fontsize=10)
right.tick_params(axis="x", labelsize=8)
fig.tight_layout()''',
        '''md:## 6. A Flax linen model

A linen module, your own or a Hugging Face Flax model's `.module`, is wrapped by
`jaxpar.from_linen(module, example_input, rngs=seed)` (inside the factory, so its weights
are born sharded). Its variables sit under `linen/` with their linen paths, so the same
kind of annotations name them; the wrapper passes `train=` (or `deterministic=`) to the
linen call, so the steps run with dropout and `eval_loss` without. Below, a small decoder
written as linen users write it: `nn.DenseGeneral` attention projections to and from
`(heads, head_dim)`, a tied `nn.Embed`.''',
        '''\
from flax import linen


class LinenBlock(linen.Module):
    dim: int
    heads: int

    @linen.compact
    def __call__(self, x, mask, train):
        hd = self.dim // self.heads
        h = linen.RMSNorm(name="attn_norm")(x)
        q, k, v = (linen.DenseGeneral((self.heads, hd), use_bias=False, name=n)(h)
                   for n in ("query", "key", "value"))
        h = linen.dot_product_attention(q, k, v, mask=mask)
        x = x + linen.DenseGeneral(self.dim, axis=(-2, -1), use_bias=False, name="out")(h)
        h = linen.Dense(4 * self.dim, name="up")(linen.RMSNorm(name="mlp_norm")(x))
        h = linen.Dropout(0.1, deterministic=not train)(linen.gelu(h))
        return x + linen.Dense(self.dim, name="down")(h)


class LinenDecoder(linen.Module):
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    layers: int = 2

    @linen.compact
    def __call__(self, tokens, train: bool = False):
        embed = linen.Embed(self.vocab, self.dim, name="embed")
        pos = self.param("pos", linen.initializers.normal(0.02), (128, self.dim))
        x = embed(tokens) + pos[: tokens.shape[1]]
        mask = linen.make_causal_mask(tokens)
        for i in range(self.layers):
            x = LinenBlock(self.dim, self.heads, name=f"block_{i}")(x, mask, train)
        return embed.attend(linen.RMSNorm(name="norm")(x))


LINEN_ANNOTATIONS = [
    (r"embed/embedding$", ("vocab", "embed")),
    (r"pos$", (None, "embed")),
    (r"(query|key|value)/kernel$", ("embed", "heads", "head_dim")),
    (r"out/kernel$", ("heads", "head_dim", "embed")),
    (r"up/kernel$", ("embed", "mlp")),
    (r"down/kernel$", ("mlp", "embed")),
]
lplan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", annotations=LINEN_ANNOTATIONS)
example = jnp.zeros((16, 32), jnp.int32)
linen_model = jaxpar.init_sharded(
    lambda: jaxpar.from_linen(LinenDecoder(), example, rngs=0), lplan)
for path, var in nnx.to_flat_state(nnx.state(linen_model, nnx.Param)):
    if path_str(path).startswith("linen/block_0/") and path[-1] == "kernel":
        print(f"{path_str(path):28s} {str(var.get_value().shape):12s} "
              f"{var.get_value().sharding.spec}")
lt = jaxpar.Trainer(linen_model, optax.adamw(3e-3), lplan)
print(f"eval_loss before: {lt.eval_loss(data.batch(100)):.3f}")
print("train losses:", " ".join(f"{lt.step(data.batch(s))['loss']:.3f}" for s in range(3)))
print(f"eval_loss after:  {lt.eval_loss(data.batch(100)):.3f}")''',
        '''md:LoRA reaches `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` layers by path; the
adapters are named like the kernel's own dimensions, so they shard like it (`lora_b` of a
`(embed, heads, head_dim)` kernel is `(lora_rank, heads, head_dim)`). A target that
matches another module holding weights (a norm, the embedding) is an error.
`linen_params()` gives the weights back as the linen params tree (adapters folded in),
ready for `module.apply` or a Hugging Face Flax model's `save_pretrained(params=...)`;
`save_hf(folder, config)` writes a PyTorch `transformers` folder for a model laid out as
a Hugging Face family.''',
        '''\
tuned_linen = lt.model
lora.apply(tuned_linen, r"(query|key|value|out)$", rank=4, plan=lplan)
b = tuned_linen.adapters["block_0/query"].lora_b[...]
print("block_0/query lora_b", b.shape, b.sharding.spec)
try:
    lora.apply(tuned_linen, r"norm$", rank=4)
except jaxpar.JaxparError as err:
    print("refused:", str(err)[:100], "...")
params = tuned_linen.linen_params()
print({k: v.shape for k, v in params["block_0"]["query"].items()})''',
        '''md:## From the command line

The same run as a config: `model.factory` names a function returning the model
(`package.module:function`, called with `model.kwargs` and, if it takes one, `rngs`), and
`plan.annotations` / `plan.layouts` hold the two lists (a layout target is `type:ClassName`
or a path regex there). `train.loss` names a loss for models the default next-token loss
does not fit. Then `jaxpar train --config byo.yaml --devices 8` trains it and
`jaxpar inspect --config byo.yaml --devices 8` shows its shardings, replicated share and
collectives.

```yaml
model:
  factory: mypackage.models:tiny_llama
  kwargs: {dim: 64, layers: 2}
  vocab_size: 256
mesh: {fsdp: 4, tensor: 2}
plan:
  rules: fsdp_tp
  annotations:
    - ["embed_tokens/embedding$", [vocab, embed]]
    - ["attn/q_proj/kernel$", [embed, heads]]
    # ...
  layouts:
    - ["type:DecoderBlock", [batch, seq, embed]]
    - ["embed_tokens/embedding$", [vocab, embed]]
```''',
    ]
