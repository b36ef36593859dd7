"""LoRA fine-tuning on an FSDP x TP mesh (8 simulated CPU devices), end to end.

1. Train a small base model fully for a few steps (stands in for a trained checkpoint).
2. Add adapters to its attention and MLP projections (sharded like their weights), with
   the frozen base kept in float32, bfloat16 or int8, and fine-tune only the adapters.
3. Check merged == unmerged, save the adapters alone, load them into a fresh copy.
4. Report trainable parameters and optimizer memory versus full fine-tuning for the
   ~100M reference configuration (from abstract shapes; nothing allocated).

Run: ``python examples/lora_finetune.py [--base-dtype int8] [--steps 20]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.adapters import lora  # noqa: E402
from jaxpar.data.loader import TokenLoader, load_tokens, split_holdout  # noqa: E402
from jaxpar.models import Transformer, TransformerConfig  # noqa: E402

SMALL = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          d_ff=128, max_seq_len=64)
REF_100M = TransformerConfig(vocab_size=32000, d_model=768, n_layers=12, n_heads=12,
                             n_kv_heads=12, d_ff=2048)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()

    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp")
    tokens = load_tokens("stdlib", 1_000_000)
    pretrain, finetune = split_holdout(tokens, 0.3)  # two "domains": two parts of a corpus
    pre_loader = TokenLoader(pretrain, 16, 32, seed=0)
    ft_loader, eval_batch = TokenLoader(finetune, 16, 32, seed=1), TokenLoader(
        finetune, 16, 32, seed=2).batch(0)

    # 1. the base model
    base = jaxpar.init_sharded(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)), plan)
    trainer = jaxpar.Trainer(base, optax.adamw(3e-3), plan)
    for step in range(args.steps):
        trainer.step(pre_loader.batch(step))
    print(f"base: pretrained {args.steps} steps, fine-tune-domain loss "
          f"{trainer.eval_loss(eval_batch):.3f}")
    model = trainer.model  # a trained, sharded model: what restoring a checkpoint gives

    # 2. adapters + frozen base in the chosen precision, then adapter-only training
    cfg = lora.LoraConfig(enabled=True, rank=args.rank, alpha=2.0 * args.rank,
                          base_dtype=args.base_dtype)
    with plan.activate():
        lora.apply_config(model, cfg, plan=plan)
    ft = jaxpar.Trainer(model, optax.adamw(1e-2), plan,
                        trainable=lora.trainable_filter("lora", lora=True))
    n_train = lora.count_params(ft.model, nnx.LoRAParam)
    print(f"LoRA r={cfg.rank} on {len(lora.adapted(ft.model))} projections, base "
          f"{cfg.base_dtype}: {n_train:,} trainable; base model has {SMALL.param_count():,}")
    print(f"  before fine-tuning: loss {ft.eval_loss(eval_batch):.3f}")
    for step in range(args.steps):
        ft.step(ft_loader.batch(step))
    print(f"  after {args.steps} steps: loss {ft.eval_loss(eval_batch):.3f}")

    # 3. merge, save, load
    tuned = ft.model
    with plan.activate():
        fwd = nnx.jit(lambda m, t: m(t))
        unmerged = np.asarray(fwd(tuned, eval_batch[:, :-1]))
        with tempfile.TemporaryDirectory() as tmp:
            path = lora.save_adapters(tuned, Path(tmp) / "adapters")
            fresh = ft.model
            for _, m in lora.adapted(fresh):
                m.lora_b.set_value(m.lora_b[...] * 0)
            lora.load_adapters(fresh, path)
            reloaded = np.asarray(fwd(fresh, eval_batch[:, :-1]))
        merged = np.asarray(fwd(lora.merge(tuned, plan=plan), eval_batch[:, :-1]))
    print(f"  adapters saved and reloaded: max |diff| {np.max(np.abs(reloaded - unmerged)):.2e}")
    print(f"  merged vs unmerged: max |diff| {np.max(np.abs(merged - unmerged)):.2e}")

    # 4. the ~100M configuration, from abstract shapes
    print(f"\n~100M model {REF_100M}:")
    for dtype in ("float32", "bfloat16", "int8"):
        report = lora.finetune_report(lambda: Transformer(REF_100M, rngs=nnx.Rngs(0)),
                                      lora.LoraConfig(rank=8, base_dtype=dtype))
        print(f"-- LoRA r=8 on attention+MLP, frozen base {dtype}, adamw --")
        print(report)


if __name__ == "__main__":
    main()
