"""LoRA on 8 simulated devices with an FSDP x TP plan (fsdp=4, tensor=2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.adapters import lora, quant
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.sharding.partitioning import logical_names
from jaxpar.sharding.paths import path_str

CFG = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)
SEQ, BATCH, RANK = 16, 8, 4
INT8_TOL = 0.05  # max |logit error| of the int8 base, relative to max |logit|
BF16_TOL = 0.02


@pytest.fixture(scope="module")
def plan(devices):
    return jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp")


def factory(**lora_kw):
    def make():
        return lora.apply(Transformer(CFG, rngs=nnx.Rngs(0)), rank=RANK, **lora_kw)
    return make


def base_factory():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def tokens(seed: int = 0, batch: int = BATCH, seq: int = SEQ + 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (batch, seq), np.int32)


_FWD = nnx.jit(lambda m, t: m(t))  # one jit: models with equal graphdefs share a compile


def forward(plan, model, toks):
    with plan.activate():
        return np.asarray(_FWD(model, jnp.asarray(toks)))


def specs(tree) -> dict[str, tuple]:
    """Path -> PartitionSpec (padded with None to the array's rank) of every variable."""
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(tree)):
        x = v.get_value()
        spec = tuple(x.sharding.spec)
        out[path_str(path)] = spec + (None,) * (x.ndim - len(spec))
    return out


TOKS = tokens()[:, :-1]


def build(plan, make):
    """Create a model eagerly (cheap to compile here) and place it by the plan's rules."""
    with plan.activate():
        return lora.place(make(), plan)


@pytest.fixture(scope="module")
def base(plan):
    model = build(plan, base_factory)
    return model, forward(plan, model, TOKS)


@pytest.fixture(scope="module")
def run(plan):
    """A freshly applied LoRA model's outputs and shardings, then a few training steps."""
    model = build(plan, factory(alpha=32.0))
    fresh = {"out": forward(plan, model, TOKS), "specs": specs(model),
             "adapted": lora.adapted(model)}
    before = jax.tree.map(np.asarray, nnx.state(model))
    trainer = jaxpar.Trainer(model, optax.adam(1e-2), plan,
                             trainable=lora.trainable_filter("lora"))
    losses = [trainer.step(tokens(s))["loss"] for s in range(3)]
    return {"fresh": fresh, "before": before, "trainer": trainer, "losses": losses}


def test_fresh_lora_gives_exactly_base_outputs(base, run):
    np.testing.assert_array_equal(run["fresh"]["out"], base[1])
    assert len(run["fresh"]["adapted"]) == 7  # q, k, v, o, gate, up, down (stacked)


def test_adapter_shardings_follow_base_weights(run):
    sp = run["fresh"]["specs"]
    checked = 0
    for path, lp in run["fresh"]["adapted"]:
        kspec = sp[f"{path}/base/kernel"]
        spec = quant.projection_spec(lp.base)
        lead = len(kspec) - len(spec.kernel)
        by_letter = dict(zip(spec.kernel, kspec[lead:], strict=True))
        a_expect = kspec[:lead] + tuple(by_letter[c] for c in spec.in_letters) + (None,)
        b_expect = kspec[:lead] + (None,) + tuple(by_letter[c] for c in spec.out_letters)
        assert sp[f"{path}/lora_a"] == a_expect, path
        assert sp[f"{path}/lora_b"] == b_expect, path
        assert logical_names(lp.lora_a)[0] == "layers"
        assert logical_names(lp.lora_a)[-1] == "lora_rank"
        # the sharding is real: some dimension is split (fsdp on embed, tensor on heads/mlp)
        assert any(a_expect) and any(b_expect), path
        checked += 1
    assert checked == 7
    adapters = dict(run["fresh"]["adapted"])
    assert adapters["blocks/attn/wq"].lora_a.shape == (CFG.n_layers, CFG.d_model, RANK)
    assert adapters["blocks/attn/wq"].lora_b.shape == (CFG.n_layers, RANK, CFG.n_heads,
                                                        CFG.head_dim)
    assert adapters["blocks/attn/wo"].lora_a.shape == (CFG.n_layers, CFG.n_heads,
                                                        CFG.head_dim, RANK)
    assert sp["blocks/attn/wq/lora_a"] == (None, "fsdp", None)
    assert sp["blocks/attn/wq/lora_b"] == (None, None, "tensor", None)
    assert sp["blocks/attn/wo/lora_a"] == (None, "tensor", None, None)
    assert sp["blocks/attn/wo/lora_b"] == (None, None, "fsdp")


def test_target_matching_nothing_lists_paths(plan):
    def adapt(*targets):
        def make():
            model = base_factory()
            for t in targets:
                lora.apply(model, target=t)
            return model
        with plan.activate():
            return nnx.eval_shape(make)

    with pytest.raises(jaxpar.JaxparError, match=r"matches no projection.*blocks/attn/wq"):
        adapt("no_such_layer")
    assert [p for p, _ in lora.adapted(adapt("lm_head"))] == ["lm_head"]
    with pytest.raises(jaxpar.JaxparError, match="already adapted"):
        adapt("lm_head", "lm_head$")
    with pytest.raises(jaxpar.JaxparError, match="rank"):
        lora.LoraConfig(rank=0)
    with pytest.raises(jaxpar.JaxparError, match="base_dtype"):
        lora.LoraConfig(base_dtype="int4")


def test_training_changes_only_lora_params(run):
    trainer, before, losses = run["trainer"], run["before"], run["losses"]
    after = jax.tree.map(np.asarray, nnx.state(trainer.model))
    changed, unchanged = [], []
    for (path, b), (_, a) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after),
                                 strict=True):
        (unchanged if np.array_equal(b.get_value(), a.get_value()) else changed).append(
            (path_str(path), type(b)))
    assert changed and all(kind is nnx.LoRAParam for _, kind in changed), changed
    assert all(kind is not nnx.LoRAParam for _, kind in unchanged)
    assert {p.rsplit("/", 1)[1] for p, _ in changed} == {"lora_a", "lora_b"}
    assert len(changed) == 14
    assert losses[-1] < losses[0]


def test_optimizer_state_is_adapters_only(run):
    trainer = run["trainer"]
    adapters = lora.lora_state(trainer.model)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
    opt_leaves = jax.tree.leaves(trainer.state["opt_state"])
    moment_bytes = sum(x.nbytes for x in opt_leaves if x.ndim > 0)
    assert moment_bytes == 2 * adapter_bytes  # adam: mu and nu of the adapters, nothing else
    expected = jax.eval_shape(trainer.optimizer.init, adapters)
    assert sum(x.nbytes for x in opt_leaves) == sum(
        int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(expected))
    n_params = sum(x.size for x in jax.tree.leaves(trainer.state["params"]))
    assert n_params == lora.count_params(trainer.model, nnx.LoRAParam)
    # moments are sharded like the adapters they belong to
    mu = trainer.state["opt_state"][0].mu
    for (p, m), (_, a) in zip(nnx.to_flat_state(mu), nnx.to_flat_state(adapters), strict=True):
        assert m.get_value().sharding == a.get_value().sharding, path_str(p)


def test_frozen_base_gets_no_weight_gradients(plan, run):
    # Same LoRA model, trained two ways; XLA's cost analysis of the lowered step (no
    # compile). Training everything adds the weight-gradient matmuls of the frozen base
    # (2 * tokens * kernel size FLOPs each); the LoRA step has none of them and only
    # propagates activation gradients through the frozen weights.
    model = run["trainer"].model
    everything = jaxpar.Trainer(model, optax.adam(1e-2), plan,
                                trainable=lora.trainable_filter("all"))
    lora_flops = run["trainer"].lower(tokens()).cost_analysis()["flops"]
    all_flops = everything.lower(tokens()).cost_analysis()["flops"]
    n_tokens = BATCH * SEQ
    # lower bound: lm_head's and one layer's projections (a scan body may be counted once)
    kernels = sum(int(np.prod(m.base.kernel.shape[1:])) for _, m in lora.adapted(model))
    weight_grad_flops = 2 * n_tokens * (kernels + int(np.prod(model.lm_head.kernel.shape)))
    assert all_flops - lora_flops >= weight_grad_flops, (lora_flops, all_flops)


def test_merged_equals_unmerged(plan, base, run):
    model = run["trainer"].model
    unmerged = forward(plan, model, TOKS)
    assert not np.allclose(unmerged, base[1])  # the adapters did learn something
    merged_model = lora.merge(model, plan=plan)
    assert not lora.adapted(merged_model)
    np.testing.assert_allclose(forward(plan, merged_model, TOKS), unmerged,
                               atol=1e-4, rtol=1e-4)
    # the merged model has exactly the base model's structure, paths and shardings
    assert specs(merged_model) == specs(base[0])
    assert specs(merged_model)["blocks/attn/wq/kernel"] == (None, "fsdp", "tensor", None)


@pytest.fixture(scope="module")
def int8_model(plan):
    return build(plan, factory(base_dtype="int8"))


def test_int8_base_close_to_f32(plan, base, int8_model):
    got = forward(plan, int8_model, TOKS)
    rel = np.max(np.abs(got - base[1])) / np.max(np.abs(base[1]))
    assert 0 < rel < INT8_TOL, rel
    lp = dict(lora.adapted(int8_model))["blocks/mlp/w_up"]
    assert isinstance(lp.base, quant.QuantizedProjection)
    assert lp.base.kernel[...].dtype == jnp.int8
    assert lp.base.scale.shape == (CFG.n_layers, 1, CFG.d_ff)
    # the int8 kernels are sharded exactly like the float kernels they replace
    sp, base_sp = specs(int8_model), specs(base[0])
    for path, _ in lora.adapted(int8_model):
        assert sp[f"{path}/base/kernel"] == base_sp[f"{path}/kernel"], path
    assert sp["lm_head/kernel"] == base_sp["lm_head/kernel"]  # not adapted, still int8
    assert int8_model.lm_head.kernel[...].dtype == jnp.int8
    assert int8_model.embed[...].dtype == jnp.float32
    storage = quant.describe_storage(int8_model)
    n_proj = sum(int(np.prod(m.kernel.shape)) for _, m in quant.projections(base[0]))
    assert storage["int8"] == n_proj


def test_int8_base_merges(plan, int8_model):
    for _, m in lora.adapted(int8_model):
        m.lora_b.set_value(jnp.full(m.lora_b.shape, 0.05, jnp.float32))
    unmerged = forward(plan, int8_model, TOKS)
    merged = lora.merge(int8_model, plan=plan)
    assert merged.blocks.attn.wq.kernel[...].dtype == jnp.float32
    assert isinstance(merged.lm_head, quant.QuantizedProjection)  # never adapted
    np.testing.assert_allclose(forward(plan, merged, TOKS), unmerged, atol=1e-4, rtol=1e-4)


def test_save_and_load_adapters_alone(plan, run, tmp_path):
    src = run["trainer"].model
    expected = forward(plan, src, TOKS)
    path = lora.save_adapters(src, tmp_path / "adapters")
    assert any(p.is_file() for p in path.rglob("*"))
    dst = run["trainer"].model
    for _, m in lora.adapted(dst):  # wipe the adapters, then load them back
        m.lora_b.set_value(jnp.zeros_like(m.lora_b[...]))
        m.lora_a.set_value(jnp.zeros_like(m.lora_a[...]))
    lora.load_adapters(dst, path)
    for (p, a), (_, b) in zip(nnx.to_flat_state(lora.lora_state(src)),
                              nnx.to_flat_state(lora.lora_state(dst)), strict=True):
        np.testing.assert_array_equal(a[...], b[...], err_msg=path_str(p))
        assert a[...].sharding.is_equivalent_to(b[...].sharding, a[...].ndim)
    np.testing.assert_array_equal(forward(plan, dst, TOKS), expected)
    with plan.activate():
        other = nnx.eval_shape(lambda: lora.apply(UserModel(nnx.Rngs(0)), target=".", rank=2))
    with pytest.raises(jaxpar.JaxparError, match="cannot load LoRA adapters"):
        lora.load_adapters(other, path)


def test_trainable_filter_strings(plan):
    with plan.activate():
        model = nnx.eval_shape(factory())
    sel = lambda spec, on=True: {path_str(p) for p, _ in nnx.to_flat_state(
        nnx.state(model, lora.trainable_filter(spec, lora=on)))}
    assert sel("lora") == sel(None) == sel("auto")
    assert all(p.endswith(("lora_a", "lora_b")) for p in sel("lora")) and len(sel("lora")) == 14
    assert sel("all") == sel(None, on=False) and sel("lora") < sel("all")
    assert "embed" in sel("all")
    assert sel(r"norm|mlp/w_up/lora") == {"blocks/attn_norm/scale", "blocks/mlp_norm/scale",
                                          "final_norm/scale", "blocks/mlp/w_up/lora_a",
                                          "blocks/mlp/w_up/lora_b"}
    with pytest.raises(jaxpar.JaxparError, match="not a valid regular expression"):
        lora.trainable_filter("(unclosed")
    assert lora.select_trainable(model) is nnx.LoRAParam  # the model has adapters
    with pytest.raises(jaxpar.JaxparError, match="selects no parameter.*final_norm/scale"):
        lora.select_trainable(model, "no_such_param")
    with plan.activate():
        plain = nnx.eval_shape(base_factory)
    assert lora.select_trainable(plain) is nnx.Param
    with pytest.raises(jaxpar.JaxparError, match="selects no parameter"):
        lora.select_trainable(plain, "lora")


class UserModel(nnx.Module):
    """Not the reference model: a Linear with bias and an Einsum with a batched kernel dim."""

    def __init__(self, rngs: nnx.Rngs):
        init = lambda names: nnx.with_partitioning(nnx.initializers.normal(0.5), names)
        self.proj_in = nnx.Linear(16, 32, kernel_init=init(("embed", "mlp")), rngs=rngs)
        # per-head projection: "h" is in input, kernel and output
        self.per_head = nnx.Einsum("bhd,hde->bhe", (4, 8, 8), (4, 8),
                                   kernel_init=init(("heads", "head_dim", None)), rngs=rngs)
        self.out = nnx.Linear(32, 16, rngs=rngs)  # unannotated: replicated

    def __call__(self, x):
        h = jax.nn.gelu(self.proj_in(x)).reshape(x.shape[0], 4, 8)
        return self.out(self.per_head(h).reshape(x.shape[0], 32))


def test_user_model_lora_merge_and_low_precision(plan):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
    user = lambda: UserModel(nnx.Rngs(1))
    # adapters created inside init_sharded's factory: born sharded, no extra annotation
    model = jaxpar.init_sharded(lambda: lora.apply(user(), target=".", rank=2), plan)
    # the reference: the same weights without adapters (merging B = 0 adds exactly zero)
    ref_model = lora.merge(nnx.clone(model))
    assert not lora.adapted(ref_model) and lora.adapted(model)
    ref = forward(plan, ref_model, x)
    np.testing.assert_array_equal(forward(plan, model, x), ref)
    lp = dict(lora.adapted(model))["per_head"]
    assert lp.lora_a.shape == (4, 8, 2) and lp.lora_b.shape == (4, 2, 8)
    assert specs(model)["per_head/lora_a"] == ("tensor", None, None)
    assert specs(model)["proj_in/lora_b"] == (None, "tensor")
    for _, m in lora.adapted(model):  # non-zero B, then merge
        m.lora_b.set_value(jnp.full(m.lora_b.shape, 0.1, jnp.float32))
    unmerged = forward(plan, model, x)
    assert not np.allclose(unmerged, ref)
    merged = lora.merge(model, plan=plan)
    np.testing.assert_allclose(forward(plan, merged, x), unmerged, atol=1e-5, rtol=1e-5)
    for dtype, tol in (("int8", INT8_TOL), ("bfloat16", BF16_TOL)):
        low = build(plan, lambda d=dtype: quant.convert_frozen(user(), d))
        err = np.max(np.abs(forward(plan, low, x) - ref)) / np.max(np.abs(ref))
        assert 0 < err < tol, (dtype, err)
        assert specs(low)["proj_in/kernel"] == specs(ref_model)["proj_in/kernel"]
    assert isinstance(low.per_head, nnx.Einsum) and low.per_head.kernel.dtype == jnp.bfloat16


def test_dropout_is_random_in_training_and_off_in_eval():
    model = lora.apply(nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0))), target=".",
                       rank=4, dropout=0.5)
    for _, m in lora.adapted(model):
        m.lora_b.set_value(jnp.ones(m.lora_b.shape))
    x = jnp.ones((4, 16))
    train1 = model(x)
    train2 = model(x)  # each call advances the counter -> a new mask
    assert not np.allclose(train1, train2)
    state = lora.advance_dropout(nnx.state(model))
    counts = [v[...] for _, v in nnx.to_flat_state(state) if isinstance(v, lora.LoraDropoutCount)]
    assert counts and all(np.all(c == 3) for c in counts)
    model.eval()
    e1 = model(x)
    lora.advance_dropout(model)
    np.testing.assert_array_equal(model(x), e1)
    assert not np.allclose(e1, train1)


def test_apply_to_loaded_sharded_model(plan, base):
    # The fine-tuning flow: a sharded model holding trained weights gets adapters placed
    # by the plan (here a copy of `base` stands in for a restored checkpoint).
    model = build(plan, base_factory)
    nnx.update(model, jax.tree.map(lambda x: x * 1.0, nnx.state(base[0])))
    cfg = lora.LoraConfig(enabled=True, rank=RANK, alpha=32.0)  # as `run`: shares its compile
    with plan.activate():
        lora.apply_config(model, cfg, plan=plan)
    assert len(lora.adapted(model)) == 7
    sp = specs(model)
    assert sp["blocks/attn/wq/lora_a"] == (None, "fsdp", None)
    assert sp["blocks/mlp/w_down/lora_b"] == (None, None, "fsdp")
    np.testing.assert_array_equal(forward(plan, model, TOKS), base[1])
    assert lora.apply_config(model, lora.LoraConfig(enabled=False)) is model


def test_finetune_report_counts():
    cfg = lora.LoraConfig(rank=RANK)
    report = lora.finetune_report(base_factory, cfg)
    d, h, f, L = CFG.d_model, CFG.head_dim, CFG.d_ff, CFG.n_layers
    per_layer = (RANK * (d + CFG.n_heads * h)            # wq
                 + 2 * RANK * (d + CFG.n_kv_heads * h)    # wk, wv
                 + RANK * (CFG.n_heads * h + d)           # wo
                 + 3 * RANK * (d + f))                    # gate, up, down
    assert report.lora_trainable == L * per_layer
    assert report.full_trainable == report.total_params == CFG.param_count()
    assert report.lora_optimizer_bytes == 2 * 4 * report.lora_trainable + 4  # mu, nu, count
    assert report.full_optimizer_bytes == 2 * 4 * report.full_trainable + 4
    q = lora.finetune_report(base_factory, lora.LoraConfig(rank=RANK, base_dtype="int8"))
    assert q.lora_frozen_bytes < report.lora_frozen_bytes / 2
    assert report.lora_adapter_bytes == 4 * report.lora_trainable
    assert "trainable" in str(report)


def test_pipeline_layout_adapters_follow_stage_sharding(devices):
    # Abstract only: adapters of (repeat, stage)-stacked blocks carry both axes, and the
    # stage axis is sharded over the "stage" mesh axis like the weights they adapt.
    from jaxpar.parallel import pipeline as pl

    mesh = jaxpar.make_mesh({"stage": 2, "fsdp": 2, "tensor": 2})
    pp_plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                            d_ff=64, max_seq_len=32)
    make = lambda: lora.apply(Transformer(cfg, rngs=nnx.Rngs(0), pipeline=pl.Schedule(2, 2, 2)),
                              rank=RANK, base_dtype="int8")
    with pp_plan.activate():
        model = nnx.eval_shape(make)
        sh = jaxpar.state_shardings(pp_plan, nnx.state(model))
    flat = {path_str(p): v.get_value().spec for p, v in nnx.to_flat_state(sh)}
    assert dict(lora.adapted(model))["blocks/attn/wq"].lora_a.shape == (2, 2, 32, RANK)
    assert flat["blocks/attn/wq/lora_a"] == jax.sharding.PartitionSpec(None, "stage", "fsdp",
                                                                        None)
    assert flat["blocks/attn/wo/lora_b"] == jax.sharding.PartitionSpec(None, "stage", None,
                                                                        "fsdp")
    assert flat["blocks/attn/wq/base/kernel"][:2] == (None, "stage")
