"""Framework overhead: jaxpar's train step against a hand-written plain-JAX step.

    python benchmarks/overhead.py [--rounds 7] [--steps 20] [--layouts fsdp,tp,fsdp_tp]
        [--clip 1.0] [--save benchmarks/results/overhead.json]

Both sides train the same Llama-style decoder (d_model 256, 4 layers, 4 heads, 4 KV heads,
d_ff 1024, vocab 32000, seq 128, global batch 8, f32, adamw with warmup-cosine schedule
and global-norm clipping) on 8 simulated CPU devices, from the same initial weights (the
hand-written side copies jaxpar's) on the same fixed batch. The hand-written side (first
part of this file, no jaxpar imports) places every weight with an explicit
``NamedSharding`` and pins activations with ``with_sharding_constraint`` exactly where
jaxpar's model calls ``constrain``, with the PartitionSpecs jaxpar's rule presets give.
A third side, ``plain`` (part 1b), is the same model written the simplest way (one spec a
weight, the residual stream pinned to the batch split, Q/K/V fused, AdamW at a constant
rate without clipping): what jaxpar's design costs or saves against it. jaxpar runs its
defaults beyond the rules preset: its ``auto`` knobs take what its planner picks for this
model, mesh and machine (``jaxpar.assemble``, as ``jaxpar train`` does; printed first), so
under FSDP its vocabulary may be split over ``fsdp`` where the hand-written side keeps the
preset's layout.

Layouts: FSDP (fsdp=8, preset ``fsdp``), TP (data=2 x tensor=4, preset ``tp``: with
tensor=8 the 4 heads would not divide and fall back to replicated), FSDP x TP (fsdp=4 x
tensor=2, preset ``fsdp_tp``). After a warm-up, ``--rounds`` alternated rounds each time
``--steps`` steps of each side in turn (the order flips every round); each step
fetches its loss and gradient norm to the host, as ``Trainer.step`` does.

It prints, per layout: the max abs difference of the first step's losses, then a table
of ms/step (median over rounds of the per-round median step), the jaxpar/hand ratio
(median over rounds of per-round ratios, min-max in brackets), and the counts of
all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute in each
side's compiled HLO, flagged with ``!`` where they differ; then the same against plain.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

V, D, L, N, K, H, F, S, B = 32000, 256, 4, 4, 4, 64, 1024, 128, 8
LR, WARMUP, TOTAL_STEPS, WEIGHT_DECAY, EPS, THETA = 3e-3, 10, 200, 0.01, 1e-5, 10000.0

# --- Part 1: hand-written plain JAX ---------------------------------------------------------
# PartitionSpecs per layout, as jaxpar's presets resolve them (checked against jaxpar's
# state shardings at run time). Weights: embed (V,d), lm_head (d,V), wq (L,d,n,h), wk/wv
# (L,d,k,h), wo (L,n,h,d), gate/up (L,d,f), down (L,f,d); norms replicated. Activations:
# resid (b,s,d), heads (b,s,n,h), mlp (b,s,f), logits (b,s,V); the embedding lookup as
# jaxpar.parallel.embedding runs it: table (in its weight layout), ids (the token ids
# gathered over the axes splitting its columns), rows (the looked-up rows, still split).
HAND_LAYOUTS = {
    "fsdp": dict(
        mesh=((8,), ("fsdp",)),
        params=dict(embed=P(None, "fsdp"), lm_head=P("fsdp", None),
                    qkv=P(None, "fsdp", None, None), wo=P(None, None, None, "fsdp"),
                    up=P(None, "fsdp", None), down=P(None, None, "fsdp")),
        acts=dict(batch=P("fsdp", None), resid=P("fsdp", None, None),
                  heads=P("fsdp", None, None, None), mlp=P("fsdp", None, None),
                  logits=P("fsdp", None, None), table=P(None, "fsdp"), ids=P(None, None),
                  rows=P(None, None, "fsdp"))),
    "tp": dict(
        mesh=((2, 4), ("data", "tensor")),
        params=dict(embed=P("tensor", None), lm_head=P(None, "tensor"),
                    qkv=P(None, None, "tensor", None), wo=P(None, "tensor", None, None),
                    up=P(None, None, "tensor"), down=P(None, "tensor", None)),
        acts=dict(batch=P("data", None), resid=P("data", None, None),
                  heads=P("data", None, "tensor", None), mlp=P("data", None, "tensor"),
                  logits=P("data", None, "tensor"), table=P("tensor", None),
                  ids=P("data", None), rows=P("data", None, None))),
    "fsdp_tp": dict(
        mesh=((4, 2), ("fsdp", "tensor")),
        params=dict(embed=P("tensor", "fsdp"), lm_head=P("fsdp", "tensor"),
                    qkv=P(None, "fsdp", "tensor", None), wo=P(None, "tensor", None, "fsdp"),
                    up=P(None, "fsdp", "tensor"), down=P(None, "tensor", "fsdp")),
        acts=dict(batch=P("fsdp", None), resid=P("fsdp", None, None),
                  heads=P("fsdp", None, "tensor", None), mlp=P("fsdp", None, "tensor"),
                  logits=P("fsdp", None, "tensor"), table=P("tensor", "fsdp"),
                  ids=P(None, None), rows=P(None, None, "fsdp"))),
}


def hand_shardings(layout: str) -> tuple[Mesh, dict, dict]:
    """(mesh, parameter shardings tree, activation shardings by role) of a layout."""
    lay = HAND_LAYOUTS[layout]
    shape, names = lay["mesh"]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    ns = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    p, rep = lay["params"], ns(P())
    params = {"embed": ns(p["embed"]), "final_norm": rep, "lm_head": ns(p["lm_head"]),
              "layers": {"attn_norm": rep, "mlp_norm": rep, "wq": ns(p["qkv"]),
                         "wk": ns(p["qkv"]), "wv": ns(p["qkv"]), "wo": ns(p["wo"]),
                         "w_gate": ns(p["up"]), "w_up": ns(p["up"]), "w_down": ns(p["down"])}}
    return mesh, params, {k: ns(v) for k, v in lay["acts"].items()}


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * scale


def rope(x, sin, cos):
    x1, x2 = jnp.split(x, 2, axis=-1)
    sin, cos = sin[None, :, None, :], cos[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def hand_loss(params, tokens, acts):
    pin = jax.lax.with_sharding_constraint
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # The lookup where the table lies: ids gathered to its columns, rows moved back.
    table = pin(params["embed"], acts["table"])
    rows = pin(jnp.take(table, pin(inputs, acts["ids"]), axis=0), acts["rows"])
    x = pin(rows, acts["resid"])
    freqs = 1.0 / THETA ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    angles = jnp.arange(inputs.shape[1], dtype=jnp.float32)[:, None] * freqs[None, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)

    def layer(x, w):
        h = rms_norm(x, w["attn_norm"])
        q = pin(rope(jnp.einsum("bse,enh->bsnh", h, w["wq"]), sin, cos), acts["heads"])
        k = pin(rope(jnp.einsum("bse,enh->bsnh", h, w["wk"]), sin, cos), acts["heads"])
        v = pin(jnp.einsum("bse,enh->bsnh", h, w["wv"]), acts["heads"])
        o = pin(jax.nn.dot_product_attention(q, k, v, is_causal=True), acts["heads"])
        x = x + pin(jnp.einsum("bsnh,nhe->bse", o, w["wo"]), acts["resid"])
        h = rms_norm(x, w["mlp_norm"])
        hidden = pin(jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"]), acts["mlp"])
        return x + pin(hidden @ w["w_down"], acts["resid"]), None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    logits = pin(rms_norm(x, params["final_norm"]) @ params["lm_head"], acts["logits"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


CLIP = [1.0]  # --clip
PLAN: dict = {}  # --plan KNOB=VALUE: jaxpar's side only


def hand_optimizer() -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, WARMUP, TOTAL_STEPS, LR * 0.1)
    decay = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params)
    clip = [clip_by_global_norm(CLIP[0])] if CLIP[0] > 0 else []
    return optax.chain(*clip, optax.adamw(schedule, weight_decay=WEIGHT_DECAY, mask=decay))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Global-norm clipping as one scalar factor, as jaxpar clips (optax's per-element
    select costs XLA:CPU a pass over every gradient)."""
    def update(updates, state, params=None):
        factor = jnp.minimum(1.0, max_norm / jnp.maximum(optax.tree.norm(updates), 1e-30))
        return jax.tree.map(lambda g: g * factor, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def hand_trainer(layout: str, host_params: dict):
    """(jitted step, initial state, batch sharding): state is (params, opt_state)."""
    mesh, param_sh, acts = hand_shardings(layout)
    opt = hand_optimizer()
    params = jax.device_put(host_params, param_sh)
    rep = NamedSharding(mesh, P())
    opt_sh = optax.tree_map_params(opt, lambda _, sharding: sharding,
                                   jax.eval_shape(opt.init, params), param_sh,
                                   transform_non_params=lambda _: rep)
    opt_state = jax.jit(opt.init, out_shardings=opt_sh)(params)

    def step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(hand_loss)(params, tokens, acts)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss, grad_norm

    jitted = jax.jit(step, out_shardings=((param_sh, opt_sh), rep, rep), donate_argnums=0)
    return jitted, (params, opt_state), acts["batch"]


# --- Part 1b: the same model written the simplest way ---------------------------------------
# Weights placed with one spec each (the model dimension over fsdp, Megatron's split over
# tensor), the residual stream constrained to the batch split of the input (without it
# GSPMD's own choices make the FSDP step 3-4x slower), and GSPMD left to work out the rest.
# Q, K and V are one fused projection (L, d, 3, n, h). AdamW at a constant learning rate,
# no clipping, no schedule, no weight-decay mask and no gradient norm: what jaxpar's step
# adds on top of this is what it buys the user (``--clip 0`` takes jaxpar's clipping off,
# and the copy's, to measure it).
PLAIN_LAYOUTS = {
    "fsdp": dict(embed=P(None, "fsdp"), lm_head=P("fsdp", None), qkv=P(None, "fsdp"),
                 wo=P(None, None, None, "fsdp"), up=P(None, "fsdp", None),
                 down=P(None, None, "fsdp"), batch=P("fsdp")),
    "tp": dict(embed=P("tensor", None), lm_head=P(None, "tensor"),
               qkv=P(None, None, None, "tensor"), wo=P(None, "tensor"),
               up=P(None, None, "tensor"), down=P(None, "tensor", None), batch=P("data")),
    "fsdp_tp": dict(embed=P("tensor", "fsdp"), lm_head=P("fsdp", "tensor"),
                    qkv=P(None, "fsdp", None, "tensor"), wo=P(None, "tensor", None, "fsdp"),
                    up=P(None, "fsdp", "tensor"), down=P(None, "tensor", "fsdp"),
                    batch=P("fsdp")),
}


def plain_loss(params, tokens, batch):
    # One constraint: the residual stream split over the batch, as the input is.
    pin = lambda x: jax.lax.with_sharding_constraint(x, batch)  # noqa: E731
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs]
    freqs = 1.0 / THETA ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    angles = jnp.arange(inputs.shape[1], dtype=jnp.float32)[:, None] * freqs[None, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)

    def layer(x, w):
        q, k, v = jnp.einsum("bse,etnh->tbsnh", rms_norm(x, w["attn_norm"]), w["wqkv"])
        o = jax.nn.dot_product_attention(rope(q, sin, cos), rope(k, sin, cos), v,
                                         is_causal=True)
        x = x + jnp.einsum("bsnh,nhe->bse", o, w["wo"])
        h = rms_norm(x, w["mlp_norm"])
        return pin(x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]), None

    x, _ = jax.lax.scan(layer, pin(x), params["layers"])
    logits = rms_norm(x, params["final_norm"]) @ params["lm_head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def plain_trainer(layout: str, host_params: dict):
    """(jitted step, initial state, batch sharding) of the simplest step, from the
    hand-written tree's weights (Q, K and V fused)."""
    shape, names = HAND_LAYOUTS[layout]["mesh"]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    spec = PLAIN_LAYOUTS[layout]
    ns = lambda s: NamedSharding(mesh, s)  # noqa: E731
    layers = dict(host_params["layers"])
    layers["wqkv"] = np.stack([layers.pop("wq"), layers.pop("wk"), layers.pop("wv")], axis=2)
    params = {**host_params, "layers": layers}
    rep = ns(P())
    param_sh = {"embed": ns(spec["embed"]), "final_norm": rep, "lm_head": ns(spec["lm_head"]),
                "layers": {"attn_norm": rep, "mlp_norm": rep, "wqkv": ns(spec["qkv"]),
                           "wo": ns(spec["wo"]), "w_gate": ns(spec["up"]),
                           "w_up": ns(spec["up"]), "w_down": ns(spec["down"])}}
    params = jax.device_put(params, param_sh)
    opt = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    opt_state = jax.jit(opt.init)(params)

    batch = ns(P(*spec["batch"], None, None))

    def step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(plain_loss)(params, tokens, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(step, donate_argnums=0), (params, opt_state), ns(spec["batch"])


# --- Part 2: jaxpar through its public API --------------------------------------------------
JAXPAR_LAYOUTS = {"fsdp": ({"data": 1, "fsdp": 8}, "fsdp"),
                  "tp": ({"data": 2, "tensor": 4}, "tp"),
                  "fsdp_tp": ({"data": 1, "fsdp": 4, "tensor": 2}, "fsdp_tp")}
_HAND_NAMES = {("embed",): "embed", ("lm_head", "kernel"): "lm_head",
               ("final_norm", "scale"): "final_norm"}


def jaxpar_trainer(layout: str):
    import jaxpar
    from jaxpar.config.schema import Config, MeshConfig, ModelConfig, PlanConfig, TrainConfig

    mesh, rules = JAXPAR_LAYOUTS[layout]
    config = Config(
        model=ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=N, n_kv_heads=K,
                          d_ff=F, max_seq_len=S),
        mesh=MeshConfig(**mesh), plan=PlanConfig(rules=rules, **PLAN),
        train=TrainConfig(global_batch=B, seq_len=S, lr=LR, warmup_steps=WARMUP,
                          steps=TOTAL_STEPS, weight_decay=WEIGHT_DECAY, grad_clip=CLIP[0],
                          optimizer="adamw"))
    run = jaxpar.assemble(config)  # auto knobs resolved, as jaxpar train does
    for line in run.auto:
        print(f"  {layout}: {line}", flush=True)
    return run.trainer


def hand_path(path: tuple) -> tuple[str, ...]:
    """jaxpar's parameter path -> the hand-written tree's path."""
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    if keys in _HAND_NAMES:
        return (_HAND_NAMES[keys],)
    assert keys[0] == "blocks", keys
    return ("layers", keys[-2] if keys[-1] == "kernel" else keys[1])


def copy_params(trainer) -> tuple[dict, dict]:
    """jaxpar's initial weights as a host tree in the hand-written layout, and jaxpar's
    PartitionSpec of each (by hand-written path)."""
    from flax import nnx

    host: dict = {"layers": {}}
    specs: dict = {}
    shardings = dict(nnx.to_flat_state(trainer.state_shardings["params"]))
    for path, var in nnx.to_flat_state(trainer.state["params"]):
        where = hand_path(path)
        node = host if len(where) == 1 else host["layers"]
        node[where[-1]] = np.array(jax.device_get(var.get_value()))
        specs[where] = shardings[path].get_value().spec
    return host, specs


# --- Harness --------------------------------------------------------------------------------
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLL = re.compile(r"=\s*\S.*?\s(" + "|".join(KINDS) + r")(?:-start)?\(")


def collectives(hlo: str) -> dict[str, int]:
    counts = dict.fromkeys(KINDS, 0)
    for line in hlo.splitlines():
        if m := _COLL.search(line):
            counts[m[1]] += 1
    return counts


def same_spec(a: P, b: P) -> bool:
    norm = lambda s: tuple(e for e in s) + (None,) * (4 - len(s))  # noqa: E731
    return norm(a) == norm(b)


def run_layout(layout: str, args) -> dict:
    trainer = jaxpar_trainer(layout)
    host, jp_specs = copy_params(trainer)
    step, state, batch_sh = hand_trainer(layout, host)
    plain_step, plain_state, plain_sh = plain_trainer(layout, host)
    mine = jax.tree_util.tree_map_with_path(
        lambda p, a: a.sharding.spec, state[0])
    split = trainer.plan.vocab_over_fsdp  # the hand-written side keeps the vocabulary whole
    for where, spec in jp_specs.items():
        node = mine if len(where) == 1 else mine["layers"]
        if split and where in (("embed",), ("lm_head",)):
            print(f"  {layout} {where}: hand {node[where[-1]]}, jaxpar {spec} (vocabulary "
                  "split over fsdp)")
        elif not same_spec(node[where[-1]], spec):
            print(f"  WARNING {layout} {where}: hand {node[where[-1]]} vs jaxpar {spec}")
    jp_ids = np.asarray(trainer.plan.mesh.device_ids).ravel().tolist()
    if jp_ids != list(range(8)):
        print(f"  WARNING jaxpar's mesh orders devices {jp_ids}")

    tokens = np.random.default_rng(0).integers(0, V, (B, S + 1), dtype=np.int32)
    jp_batch = jax.device_put(tokens, trainer.plan.batch_sharding(2))
    hand_batch = jax.device_put(tokens, batch_sh)
    plain_batch = jax.device_put(tokens, plain_sh)

    def run_plain():
        nonlocal plain_state
        plain_state, loss = plain_step(plain_state, plain_batch)
        return jax.device_get(loss)

    def run_hand():
        nonlocal state
        state, loss, grad_norm = step(state, hand_batch)
        return jax.device_get((loss, grad_norm))

    def run_jaxpar():
        m = trainer.step(jp_batch)
        return m["loss"], m["grad_norm"]

    hlo_hand = step.lower(state, hand_batch).compile().as_text()
    hlo_jp = trainer.lower(jp_batch).compile().as_text()
    hlo_plain = plain_step.lower(plain_state, plain_batch).compile().as_text()
    first = (run_hand(), run_jaxpar(), run_plain())
    loss_diff = max(abs(float(first[0][0]) - float(first[1][0])),
                    abs(float(first[2]) - float(first[1][0])))
    gnorm_diff = abs(float(first[0][1]) - float(first[1][1]))
    for _ in range(args.warmup):
        run_hand()
        run_jaxpar()
        run_plain()

    def timed(fn) -> float:
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    hand_ms, jp_ms, plain_ms, ratios, plain_ratios = [], [], [], [], []
    for r in range(args.rounds):
        order = (run_hand, run_jaxpar, run_plain)
        got = {fn: timed(fn) for fn in (order if r % 2 == 0 else order[::-1])}
        hand_ms.append(got[run_hand] * 1e3)
        jp_ms.append(got[run_jaxpar] * 1e3)
        plain_ms.append(got[run_plain] * 1e3)
        ratios.append(got[run_jaxpar] / got[run_hand])
        plain_ratios.append(got[run_jaxpar] / got[run_plain])
        print(f"  {layout} round {r}: hand {hand_ms[-1]:.2f} ms, jaxpar {jp_ms[-1]:.2f} ms, "
              f"plain {plain_ms[-1]:.2f} ms; jaxpar/hand {ratios[-1]:.3f}, jaxpar/plain "
              f"{plain_ratios[-1]:.3f}", flush=True)
    if args.dump:
        for side, text in (("hand", hlo_hand), ("jaxpar", hlo_jp), ("plain", hlo_plain)):
            with open(os.path.join(args.dump, f"{layout}.{side}.hlo.txt"), "w") as f:
                f.write(text)
    return {"layout": layout, "first_loss": float(first[1][0]), "loss_diff": loss_diff,
            "gnorm_diff": gnorm_diff, "hand_ms": statistics.median(hand_ms),
            "jaxpar_ms": statistics.median(jp_ms), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "plain_ms": statistics.median(plain_ms), "plain_ratio": statistics.median(plain_ratios),
            "plain_min": min(plain_ratios), "plain_max": max(plain_ratios),
            "coll_hand": collectives(hlo_hand), "coll_jaxpar": collectives(hlo_jp),
            "coll_plain": collectives(hlo_plain)}


MESHES = {"fsdp": "fsdp=8", "tp": "data=2 x tensor=4", "fsdp_tp": "fsdp=4 x tensor=2"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each side")
    parser.add_argument("--layouts", default="fsdp,tp,fsdp_tp")
    parser.add_argument("--dump", default="", help="folder to write the compiled HLOs to")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="global-norm clipping of jaxpar and its copy (0: none)")
    parser.add_argument("--plan", nargs="*", default=[], metavar="KNOB=VALUE",
                        help="plan knobs for jaxpar's side (e.g. vocab_over_fsdp=false); "
                        "default: jaxpar's defaults")
    parser.add_argument("--save", default="", help="write the results as JSON (the docs' "
                        "benchmark page shows benchmarks/results/overhead.json)")
    args = parser.parse_args(argv)
    CLIP[0] = args.clip
    for item in args.plan:
        knob, value = item.split("=", 1)
        PLAN[knob] = {"true": True, "false": False}.get(value.lower(), value)
    assert jax.device_count() == 8, jax.devices()
    rows = []
    for layout in args.layouts.split(","):
        row = run_layout(layout, args)
        print(f"  {layout}: first-step loss {row['first_loss']:.6f}, max abs diff "
              f"{row['loss_diff']:.2e} (grad norm diff {row['gnorm_diff']:.2e})", flush=True)
        rows.append(row)
    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
             "all-to-all": "A2A", "collective-permute": "CP"}
    print(f"\n{'layout':8} {'mesh':18} {'hand ms':>8} {'jaxpar ms':>9} {'ratio':>6} "
          f"{'[min-max]':>13}  collectives hand | jaxpar (AR AG RS A2A CP)")
    for r in rows:
        h, j = r["coll_hand"], r["coll_jaxpar"]
        counts = lambda c: " ".join(f"{short[k]}{c[k]}" for k in KINDS)  # noqa: E731
        flag = "" if h == j else "  ! differ: " + ", ".join(
            f"{short[k]} {h[k]}->{j[k]}" for k in KINDS if h[k] != j[k])
        print(f"{r['layout']:8} {MESHES[r['layout']]:18} {r['hand_ms']:8.2f} "
              f"{r['jaxpar_ms']:9.2f} {r['ratio']:6.3f} "
              f"[{r['ratio_min']:.3f}-{r['ratio_max']:.3f}]  {counts(h)} | {counts(j)}{flag}")
    print(f"\n{'layout':8} {'mesh':18} {'plain ms':>8} {'jaxpar ms':>9} {'ratio':>6} "
          f"{'[min-max]':>13}  collectives plain | jaxpar (AR AG RS A2A CP)")
    for r in rows:
        print(f"{r['layout']:8} {MESHES[r['layout']]:18} {r['plain_ms']:8.2f} "
              f"{r['jaxpar_ms']:9.2f} {r['plain_ratio']:6.3f} "
              f"[{r['plain_min']:.3f}-{r['plain_max']:.3f}]  {counts(r['coll_plain'])} | "
              f"{counts(r['coll_jaxpar'])}")
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"rounds": args.rounds, "steps": args.steps, "rows": rows}, f, indent=1)
    return 0


# --- the site's table (docs/hooks/generated.py) ---------------------------------------------

COMMAND = ("python benchmarks/overhead.py --rounds 5 --steps 3 "
           "--save benchmarks/results/overhead.json")
"""The command that wrote ``benchmarks/results/overhead.json``."""


def markdown(results: dict) -> str:
    """The tables :func:`main` prints, as markdown, from the saved results."""
    rows = results["rows"]
    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
             "all-to-all": "A2A", "collective-permute": "CP"}
    counts = lambda c: ", ".join(f"{c[k]} {short[k]}" for k in KINDS if c[k]) or "none"  # noqa: E731
    out = ["| layout (8 CPU devices) | hand-written ms | jaxpar ms | jaxpar / hand (range) | "
           "plain ms | jaxpar / plain (range) | collectives hand | jaxpar | plain |",
           "|---|---:|---:|---|---:|---|---|---|---|"]
    for r in rows:
        out.append(f"| {MESHES[r['layout']]} | {r['hand_ms']:.0f} | {r['jaxpar_ms']:.0f} | "
                   f"**{r['ratio']:.3f}** ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
                   f"{r['plain_ms']:.0f} | **{r['plain_ratio']:.3f}** ({r['plain_min']:.2f}-"
                   f"{r['plain_max']:.2f}) | {counts(r['coll_hand'])} | "
                   f"{counts(r['coll_jaxpar'])} | {counts(r['coll_plain'])} |")
    out += ["", f"Medians over {results['rounds']} alternated rounds of {results['steps']} "
            "steps each "
            "(each round's median step); ratios are the medians of the per-round ratios, "
            "with their lowest and highest. jaxpar runs its defaults (auto knobs resolved "
            "by the planner for this machine); AR all-reduce, AG all-gather, RS "
            "reduce-scatter, A2A all-to-all, CP collective-permute in the compiled programs."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
