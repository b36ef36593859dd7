"""Train the reference model with FSDP x tensor parallelism from Python, then look at what
XLA did. Run: python examples/train_fsdp_tp.py  (8 simulated CPU devices)."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.analysis import hlo  # noqa: E402
from jaxpar.data.loader import TokenLoader, load_tokens  # noqa: E402
from jaxpar.models import Transformer, TransformerConfig  # noqa: E402


def main() -> None:
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2})
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    cfg = TransformerConfig(d_model=128, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=512)
    model = jaxpar.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), plan)
    print(plan.param_rules.explain(("embed", "mlp"), mesh))

    trainer = jaxpar.Trainer(model, optax.adamw(3e-3), plan)
    data = TokenLoader(load_tokens("stdlib", 2_000_000), global_batch=16, seq_len=64)
    for step in range(20):
        metrics = trainer.step(data.batch(step))
        if step % 5 == 0:
            print(f"step {metrics['step']:3d}  loss {metrics['loss']:.4f}")

    compiled = trainer.lower(data.batch(0)).compile()
    for row in hlo.collective_table(compiled.as_text(), mesh):
        print(row)
    print(hlo.memory_stats(compiled))


if __name__ == "__main__":
    main()
