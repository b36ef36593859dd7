"""Shared builders for tests: a small reference model on a chosen mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jaxpar
from jaxpar.data.loader import TokenLoader, load_tokens
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.models.transformer import RESIDUAL, rotary_tables
from jaxpar.training.optimizer import make_optimizer

SMALL = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4,
                          d_ff=128, max_seq_len=64)
MESH_2X2X2 = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
"""Overrides for the 3D mesh (data x fsdp x tensor) most run tests use on 8 devices."""
SEQ = 32
BATCH = 16


def small_config(*overrides: str) -> jaxpar.Config:
    """A run config around :data:`SMALL`, with overrides."""
    base = [f"model.{k}={v}" for k, v in vars(SMALL).items()]
    return jaxpar.load_config(None, [*base, f"train.seq_len={SEQ}",
                                     f"train.global_batch={BATCH}", "train.steps=5",
                                     "train.warmup_steps=1", *overrides])


def make_trainer(mesh_axes: dict[str, int], rules: str = "fsdp_tp", *, devices=None,
                 cfg: TransformerConfig = SMALL) -> jaxpar.Trainer:
    """A Trainer of ``cfg`` on a mesh of ``mesh_axes`` over ``devices`` (default: all)."""
    mesh = jaxpar.make_mesh(mesh_axes, devices=devices)
    plan = jaxpar.Plan.from_preset(mesh, rules)
    model = jaxpar.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), plan)
    opt = make_optimizer(small_config().train)
    return jaxpar.Trainer(model, opt, plan)


def loader(batch: int = BATCH, seq: int = SEQ) -> TokenLoader:
    """A deterministic loader over the built-in corpus."""
    return TokenLoader(load_tokens("stdlib", 400_000), batch, seq, seed=0)


def without_cache(env) -> dict:
    """``env`` without the session's compilation cache (tests/conftest.py), for the
    processes of one multi-process run: they would write the same entries at once."""
    return {k: v for k, v in env.items() if k not in (
        "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")}


def one_device():
    return jax.devices()[:1]


def block_forward_hlo(plan: jaxpar.Plan, seq: int = 16) -> str:
    """Optimized HLO of the forward pass of one :data:`SMALL` decoder block under
    ``plan``, its input laid out as the residual stream."""
    model = jaxpar.init_sharded(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)), plan)
    blocks_def, blocks_state = nnx.split(model.blocks)
    layer0 = jax.tree.map(lambda x: x[0], blocks_state)
    sin, cos = rotary_tables(seq, SMALL.head_dim, SMALL.rope_theta)

    def block_forward(state, x):
        return nnx.merge(blocks_def, state)(x, sin, cos)

    with plan.activate():
        x = jax.device_put(jnp.ones((8, seq, SMALL.d_model)),
                           plan.sharding(plan.act_spec(RESIDUAL)))
        return jax.jit(block_forward).lower(layer0, x).compile().as_text()
