"""Shard, train and LoRA-tune a model jaxpar did not write (8 simulated CPU devices).

The model below is plain Flax NNX, the way a port of a Llama checkpoint looks: no logical
names on its weights, no sharding constraints inside. Everything jaxpar needs is said from
outside, in two lists:

1. built as it is, under an FSDP x TP plan, every weight stays replicated and jaxpar warns;
2. ``ANNOTATIONS`` gives the weights logical names by path (seven lines);
3. ``LAYOUTS`` pins each decoder block's output and the embedding table's compute layout
   (two lines), so GSPMD has nothing to guess;
4. train a few steps on ``fsdp=4 x tensor=2``, then put LoRA adapters on every attention
   and MLP projection and train only them;
5. read the collectives of the compiled FSDP step from the HLO, with and without layouts.

Run: ``python examples/bring_your_own_model.py``.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.adapters import lora  # noqa: E402
from jaxpar.analysis import hlo  # noqa: E402
from jaxpar.data.loader import TokenLoader, load_tokens  # noqa: E402
from jaxpar.sharding.partitioning import ReplicationWarning  # noqa: E402
from jaxpar.sharding.paths import path_str  # noqa: E402

# --- the user's model: plain Flax NNX, nothing from jaxpar ---------------------------------


class RMSNorm(nnx.Module):
    def __init__(self, dim: int):
        self.scale = nnx.Param(jnp.ones((dim,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


def rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x`` shaped (batch, seq, heads, head_dim)."""
    half = x.shape[-1] // 2
    freqs = 10_000.0 ** (-jnp.arange(half) / half)
    angle = jnp.arange(x.shape[1])[:, None] * freqs
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
    lo, hi = x[..., :half], x[..., half:]
    return jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


class Attention(nnx.Module):
    """Grouped-query attention: ``kv_heads`` key/value heads shared by ``heads`` queries."""

    def __init__(self, dim: int, heads: int, kv_heads: int, *, rngs: nnx.Rngs):
        head_dim = dim // heads
        self.q_proj = nnx.LinearGeneral(dim, (heads, head_dim), use_bias=False, rngs=rngs)
        self.k_proj = nnx.LinearGeneral(dim, (kv_heads, head_dim), use_bias=False, rngs=rngs)
        self.v_proj = nnx.LinearGeneral(dim, (kv_heads, head_dim), use_bias=False, rngs=rngs)
        self.o_proj = nnx.LinearGeneral((heads, head_dim), dim, axis=(-2, -1), use_bias=False,
                                        rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = rotary(self.q_proj(x)), rotary(self.k_proj(x)), self.v_proj(x)
        return self.o_proj(jax.nn.dot_product_attention(q, k, v, is_causal=True))


class FeedForward(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, rngs=rngs)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = FeedForward(dim, hidden, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nnx.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, kv_heads: int = 2,
                 hidden: int = 192, layers: int = 2, *, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([DecoderBlock(dim, heads, kv_heads, hidden, rngs=rngs)
                                for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


# --- what jaxpar needs to know, said from outside -----------------------------------------

ANNOTATIONS = [  # (path regex, logical names of the array as stored; short = trailing unnamed)
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"attn/q_proj/kernel$", ("embed", "heads")),          # (embed, heads, head_dim)
    (r"attn/(k|v)_proj/kernel$", ("embed", "kv_heads")),   # GQA: falls through if too few
    (r"attn/o_proj/kernel$", ("heads", None, "embed")),
    (r"mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
]
LAYOUTS = [  # block outputs, and the table gathered whole before each lookup
    (DecoderBlock, ("batch", "seq", "embed")),
    (r"embed_tokens/embedding$", ("vocab", "embed")),
]


def fsdp_step_collectives(plan: jaxpar.Plan, batch) -> tuple[list[dict], dict]:
    """Collectives and memory of one compiled (not run) train step of a fresh model."""
    model = jaxpar.init_sharded(lambda: TinyLlama(rngs=nnx.Rngs(0)), plan)
    compiled = jaxpar.Trainer(model, optax.adamw(3e-3), plan).lower(batch).compile()
    return (hlo.collective_table(compiled.as_text(), plan.mesh),
            hlo.memory_stats(compiled))


def main() -> None:
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2})
    data = TokenLoader(load_tokens("stdlib", 1_000_000), global_batch=16, seq_len=32)

    # 1. As it comes: no names, so the plan has nothing to shard.
    bare = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReplicationWarning)
        model = jaxpar.init_sharded(lambda: TinyLlama(rngs=nnx.Rngs(0)), bare)
    for w in caught:
        if issubclass(w.category, ReplicationWarning):
            print(f"1. unannotated -> ReplicationWarning:\n   {w.message}\n")
    report = jaxpar.replication_report(bare, nnx.state(model))
    print(f"   replicated share: {report['replicated_share']:.0%}")

    # 2 + 3. Names by path and pinned layouts, as plan fields (init_sharded applies them).
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", annotations=ANNOTATIONS, layouts=LAYOUTS)
    model = jaxpar.init_sharded(lambda: TinyLlama(rngs=nnx.Rngs(0)), plan)
    report = jaxpar.replication_report(plan, nnx.state(model))
    print(f"2. annotated: replicated share {report['replicated_share']:.1%}")
    shown = {"embed_tokens/embedding", "blocks/0/attn/q_proj/kernel",
             "blocks/0/attn/k_proj/kernel", "blocks/0/mlp/down_proj/kernel"}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path_str(path) in shown:
            value = var.get_value()
            print(f"   {path_str(path):30s} {str(value.shape):13s} {value.sharding.spec}")

    # 4. Train the whole model, then adapters only.
    trainer = jaxpar.Trainer(model, optax.adamw(3e-3), plan)
    for step in range(10):
        metrics = trainer.step(data.batch(step))
        if step % 3 == 0 or step == 9:
            print(f"   step {metrics['step']:2d}  loss {metrics['loss']:.3f}")
    compiled = trainer.lower(data.batch(0)).compile()
    train_hlo = compiled.as_text()

    tuned = trainer.model
    with plan.activate():
        lora.apply(tuned, r"attn/[qkvo]_proj$|mlp/(gate|up|down)_proj$", rank=4, alpha=8,
                   plan=plan)
    ft = jaxpar.Trainer(tuned, optax.adamw(1e-2), plan, trainable=nnx.LoRAParam)
    n_lora = lora.count_params(tuned, nnx.LoRAParam)
    print(f"3. LoRA on {len(lora.adapted(tuned))} projections: {n_lora:,} trainable, "
          f"{lora.count_params(tuned, nnx.Param) - n_lora:,} frozen")
    print(f"   before: eval loss {ft.eval_loss(data.batch(100)):.3f}")
    for step in range(10, 16):
        ft.step(data.batch(step))
    print(f"   after 6 adapter steps: eval loss {ft.eval_loss(data.batch(100)):.3f}")

    # 5. What XLA did: the FSDP x TP step, then a pure FSDP step without and with layouts.
    print("4. collectives of the fsdp=4 x tensor=2 train step:")
    for row in hlo.collective_table(train_hlo, plan.mesh):
        print(f"   {row['kind']:20s} over {','.join(row['axes']):13s} x{row['count']:<3d} "
              f"{row['bytes_per_device']:>9,d} B/device")
    fsdp = jaxpar.make_mesh({"fsdp": 8})
    batch = data.batch(0)
    for label, layouts in (("without layouts", ()), ("with layouts", LAYOUTS)):
        p = jaxpar.Plan.from_preset(fsdp, "fsdp", annotations=ANNOTATIONS, layouts=layouts)
        table, memory = fsdp_step_collectives(p, batch)
        a2a = sum(r["count"] for r in table if r["kind"] == "all-to-all")
        print(f"   fsdp=8 step {label:16s}: {a2a:2d} all-to-all, "
              f"{memory.get('temp_bytes', 0):,} temp bytes")


if __name__ == "__main__":
    main()
