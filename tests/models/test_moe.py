"""Mixture-of-experts MLP: routing and both expert paths against a per-token reference,
router diagnostics, and the expert-parallel layout (all-to-all, no expert-weight gather)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import TransformerConfig
from jaxpar.models.moe import MoE, aux_loss, capacity, top_k

E, K, B, S, D = 4, 2, 8, 8, 16
CFG = TransformerConfig(d_model=D, d_ff=32, n_heads=4, n_kv_heads=2, n_experts=E,
                        experts_per_token=K, expert_capacity=E / K)


def cfg_with(**changes) -> TransformerConfig:
    return TransformerConfig(**{**vars(CFG), "head_dim": 0, **changes})


def inputs(seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (B, S, D), jnp.float32)


def weights(moe: MoE) -> dict[str, np.ndarray]:
    out = {n: np.asarray(getattr(moe, n).kernel[...], np.float64)
           for n in ("w_gate", "w_up", "w_down")}
    out["router"] = np.asarray(moe.router.kernel[...], np.float64)
    if hasattr(moe, "shared_gate"):
        for n in ("shared_gate", "shared_up", "shared_down"):
            out[n] = np.asarray(getattr(moe, n).kernel[...], np.float64)
    return out


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def routing(w, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token: chosen experts (best first) and gates renormalised over them."""
    logits = x @ w["router"]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    g = np.take_along_axis(p, top, -1)
    return top, g / g.sum(-1, keepdims=True)


def reference(w, x: np.ndarray, k: int, keep: np.ndarray | None = None) -> np.ndarray:
    """Token by token: sum of gate x expert MLP over the kept choices, plus shared."""
    x = np.asarray(x, np.float64)
    top, g = routing(w, x, k)
    y = np.zeros_like(x)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            t = x[b, s]
            for j in range(k):
                if keep is not None and not keep[b, s, j]:
                    continue
                e = top[b, s, j]
                h = silu(t @ w["w_gate"][e]) * (t @ w["w_up"][e])
                y[b, s] += g[b, s, j] * (h @ w["w_down"][e])
            if "shared_gate" in w:
                h = silu(t @ w["shared_gate"]) * (t @ w["shared_up"])
                y[b, s] += h @ w["shared_down"]
    return y


def kept_by_hand(top: np.ndarray, cap: int) -> np.ndarray:
    """Which (token, choice) pairs fit: per sequence, first choices in token order take
    slots first, then second choices; an expert holds ``cap``."""
    keep = np.zeros(top.shape, bool)
    for b in range(top.shape[0]):
        used = np.zeros(E, int)
        for j in range(top.shape[2]):
            for s in range(top.shape[1]):
                e = top[b, s, j]
                keep[b, s, j] = used[e] < cap
                used[e] += 1
    return keep


@pytest.mark.parametrize("shared", [0, 1])
def test_capacity_and_dropless_match_reference(shared):
    x = inputs()
    cap_moe = MoE(cfg_with(n_shared_experts=shared), rngs=nnx.Rngs(0))
    free_moe = MoE(cfg_with(n_shared_experts=shared, expert_capacity=0.0), rngs=nnx.Rngs(0))
    want = reference(weights(cap_moe), x, K)
    y_cap, aux_cap = cap_moe(x)
    y_free, aux_free = free_moe(x)
    assert y_cap.shape == x.shape and y_cap.dtype == x.dtype
    np.testing.assert_allclose(y_cap, want, atol=1e-5)
    np.testing.assert_allclose(y_free, want, atol=1e-5)
    np.testing.assert_allclose(y_cap, y_free, atol=1e-6)
    assert float(aux_cap["moe_dropped"]) == 0.0 == float(aux_free["moe_dropped"])
    for name in ("moe_load_balance", "moe_router_z"):
        assert aux_cap[name].shape == () and aux_cap[name].dtype == jnp.float32
        np.testing.assert_allclose(aux_cap[name], aux_free[name], rtol=1e-6)


def test_small_capacity_drops_beyond_capacity_in_priority_order():
    cfg = cfg_with(expert_capacity=0.5)
    cap = capacity(0.5, S, E, K)
    assert cap == 2
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = inputs(2)
    w = weights(moe)
    keep = kept_by_hand(routing(w, np.asarray(x, np.float64), K)[0], cap)
    y, aux = moe(x)
    assert float(aux["moe_dropped"]) > 0
    np.testing.assert_allclose(aux["moe_dropped"], 1 - keep.mean(), rtol=1e-6)
    np.testing.assert_allclose(y, reference(w, x, K, keep), atol=1e-5)


def test_identical_tokens_fill_capacity_then_drop():
    # Every token of a sequence is the same, so all pick the same two experts: with
    # C = 4 slots the first four tokens get both experts and the last four get nothing.
    moe = MoE(cfg_with(expert_capacity=1.0), rngs=nnx.Rngs(0))
    x = jnp.broadcast_to(inputs(3)[:, :1], (B, S, D))
    y, aux = moe(x)
    np.testing.assert_allclose(aux["moe_dropped"], 0.5)
    np.testing.assert_allclose(y[:, 4:], 0.0)
    np.testing.assert_allclose(y[:, :4], reference(weights(moe), x[:, :4], K), atol=1e-5)


def test_router_losses_uniform_and_collapsed():
    moe = MoE(CFG, rngs=nnx.Rngs(0))
    moe.router.kernel[...] = jnp.zeros_like(moe.router.kernel[...])
    _, aux = moe(inputs())
    np.testing.assert_allclose(aux["moe_load_balance"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(aux["moe_router_z"], math.log(E) ** 2, rtol=1e-6)
    np.testing.assert_allclose(aux_loss(aux, CFG),
                               CFG.router_aux_loss + CFG.router_z_loss * math.log(E) ** 2,
                               rtol=1e-6)
    # A router that sends every token to expert 0: with one choice per token the loss is
    # E (its maximum); with two it is E / 2 (the second choices spread over the rest).
    x = jnp.abs(inputs())
    for k, expect in ((1, E), (2, E / 2)):
        moe = MoE(cfg_with(experts_per_token=k), rngs=nnx.Rngs(0))
        moe.router.kernel[...] = jnp.zeros((D, E)).at[:, 0].set(100.0)
        _, aux = moe(x)
        np.testing.assert_allclose(aux["moe_load_balance"], expect, rtol=1e-3)


def test_top_k_matches_lax_including_ties():
    v = jnp.array([[0.1, 0.4, 0.4, 0.1], [0.3, 0.2, 0.3, 0.2]])
    v = jnp.concatenate([v, jax.random.uniform(jax.random.key(0), (6, 4))])
    for k in (1, 2, 3):
        for got, want in zip(top_k(v, k), jax.lax.top_k(v, k), strict=True):
            np.testing.assert_array_equal(got, want)


def test_compute_follows_input_dtype():
    moe = MoE(cfg_with(n_shared_experts=1), rngs=nnx.Rngs(0))
    x = inputs().astype(jnp.bfloat16)
    for m in (moe, MoE(cfg_with(expert_capacity=0.0), rngs=nnx.Rngs(0))):
        y, aux = m(x)
        assert y.dtype == jnp.bfloat16
        assert all(v.dtype == jnp.float32 for v in aux.values())
    np.testing.assert_allclose(np.asarray(y, np.float32), reference(weights(m), x, K),
                               atol=2e-2)


def _loss_fn(graphdef, cfg):
    def loss(state, x):
        y, aux = nnx.merge(graphdef, state)(x)
        return jnp.mean(y * y) * 100 + aux_loss(aux, cfg)
    return jax.value_and_grad(loss)


def _sharded_step(cfg: TransformerConfig):
    """Loss, gradients and compiled HLO of one step on an expert=4 x fsdp=2 mesh, and the
    same step's loss and gradients on one device."""
    mesh = jaxpar.make_mesh({"expert": 4, "fsdp": 2})
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    with plan.activate():
        model = jaxpar.init_sharded(lambda: MoE(cfg, rngs=nnx.Rngs(0)), plan)
    for name in ("w_gate", "w_up", "w_down"):
        assert getattr(model, name).kernel[...].sharding.spec[0] == "expert"
    x = inputs()
    graphdef, state = nnx.split(model)
    with plan.activate(mesh_context=True):
        xs = jax.device_put(x, plan.sharding(plan.act_spec(("batch", "residual_seq",
                                                            "embed"))))
        step = jax.jit(_loss_fn(graphdef, cfg))
        loss, grads = step(state, xs)
        hlo = step.lower(state, xs).compile().as_text()
    ref_graphdef, ref_state = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))
    ref_loss, ref_grads = jax.jit(_loss_fn(ref_graphdef, cfg))(ref_state, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    return model, hlo


def test_expert_parallel_matches_one_device_and_uses_all_to_all(devices):
    model, hlo = _sharded_step(CFG)
    assert "all-to-all" in hlo
    gathered = [line.split("all-gather")[0] for line in hlo.splitlines()
                if re.search(r"all-gather(-start)?\(", line)]
    # Expert weights are gathered over fsdp only (one expert's slice per device), and the
    # router's probabilities are never gathered over the batch.
    full = "f32[{},{},{}]".format(*model.w_gate.kernel[...].shape)
    assert not [g for g in gathered if full in g or f"f32[{B},{S},{E}]" in g], gathered


def test_dropless_under_expert_parallel_plan_matches_one_device(devices):
    _sharded_step(cfg_with(expert_capacity=0.0))
