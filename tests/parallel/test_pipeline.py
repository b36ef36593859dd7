"""Pipeline parallelism: schedules, layout conversion, exactness against the unpipelined
model, the collectives XLA emits, and where the stage weights live."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxpar
from jaxpar.analysis import hlo as jinspect
from jaxpar.errors import JaxparError
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.parallel import pipeline as pl
from jaxpar.sharding import remat as remat_lib
from jaxpar.sharding.precision import Policy
from jaxpar.training.trainer import lm_loss

CFG = TransformerConfig(vocab_size=128, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)
BATCH, SEQ = 16, 16
MESH_SR = {"stage": 2, "data": 4}
MESH_3D = {"data": 2, "tensor": 2, "stage": 2}
MESH_S4 = {"stage": 4, "fsdp": 2}


def _tokens(batch: int = BATCH) -> jax.Array:
    return jax.random.randint(jax.random.key(1), (batch, SEQ + 1), 0, CFG.vocab_size)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _max_grad_rel(grads, ref_grads) -> float:
    got, want = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
    return max(_rel(a, b) for a, b in zip(got, want, strict=True))


def _loss_of(graphdef):
    return lambda state, tokens: lm_loss(nnx.merge(graphdef, state), tokens)


@functools.cache
def _reference():
    """Unpipelined model (no plan, one device): graphdef, state, loss and gradients."""
    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0))))
        state = jax.jit(lambda: nnx.state(Transformer(CFG, rngs=nnx.Rngs(0))))()
    loss, grads = jax.jit(jax.value_and_grad(_loss_of(graphdef)))(state, _tokens())
    return graphdef, state, loss, grads


def _plan(axes: dict[str, int]) -> jaxpar.Plan:
    return jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), "fsdp_tp")


def _pipelined_model(schedule: pl.Schedule, plan: jaxpar.Plan) -> Transformer:
    return jaxpar.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0), pipeline=schedule),
                               plan)


@functools.cache
def _graphdef(stages: int, microbatches: int, repeats: int) -> nnx.GraphDef:
    schedule = pl.Schedule(stages, microbatches, repeats)
    with nnx.use_eager_sharding(False):
        return nnx.graphdef(nnx.eval_shape(
            lambda: Transformer(CFG, rngs=nnx.Rngs(0), pipeline=schedule)))


@functools.cache
def _run(stages: int, microbatches: int, repeats: int, axes: tuple):
    """Pipelined loss and gradients (in the layers layout) plus the optimized HLO."""
    plan = _plan(dict(axes))
    graphdef = _graphdef(stages, microbatches, repeats)
    # The reference model's very weights, converted to the (repeat, stage) layout and placed.
    state = pl.to_pipeline_layout(_reference()[1], stages)
    with plan.activate():
        state = jax.device_put(state, jaxpar.state_shardings(plan, state))
        step = jax.jit(jax.value_and_grad(_loss_of(graphdef)))
        compiled = step.lower(state, _tokens()).compile()
        loss, grads = compiled(state, _tokens())
    return loss, pl.from_pipeline_layout(grads), compiled.as_text(), plan, state


# --- schedule arithmetic ------------------------------------------------------------------
def test_bubble_fraction_values():
    assert pl.bubble_fraction(4, 4, 1) == pytest.approx(3 / 7)
    assert pl.bubble_fraction(4, 8, 1) == pytest.approx(3 / 11)
    assert pl.bubble_fraction(4, 4, 2) == pytest.approx(3 / 11)
    assert pl.bubble_fraction(1, 5, 3) == 0.0
    # More repeats shrink the bubble for fixed S and M.
    assert pl.bubble_fraction(4, 4, 4) < pl.bubble_fraction(4, 4, 2) < pl.bubble_fraction(4, 4)
    assert pl.Schedule(2, 4, 2).iterations == 9
    line = pl.describe_schedule(2, 4, 2)
    assert "S=2" in line and "M=4" in line and "R=2" in line and "11.1%" in line


def test_schedule_validation():
    with pytest.raises(JaxparError, match="microbatches >= stages"):
        pl.Schedule(4, 2, 2)
    with pytest.raises(JaxparError, match="positive"):
        pl.Schedule(0, 2)
    pl.Schedule(4, 2, 1)  # GPipe with fewer microbatches than stages is fine
    assert pl.Schedule.for_model(8, 2) == pl.Schedule(2, 2, 4)
    assert pl.Schedule.for_model(8, 4, microbatches=8, repeats=2) == pl.Schedule(4, 8, 2)
    with pytest.raises(JaxparError, match="not divisible"):
        pl.Schedule.for_model(6, 4)
    with pytest.raises(JaxparError, match="stages x repeats x layers_per_stage"):
        pl.Schedule.for_model(8, 2, repeats=3)
    # Two repeats of two layers a stage; 1F1B and GPipe take a stage's layers in one chunk.
    assert pl.Schedule.for_model(8, 2, repeats=2) == pl.Schedule(2, 2, 2, "circular", 2)
    assert pl.Schedule.for_model(8, 2, kind="1f1b") == pl.Schedule(2, 2, 1, "1f1b", 4)
    with pytest.raises(JaxparError, match="schedule=1f1b runs one chunk per stage"):
        pl.Schedule(2, 2, 2, "1f1b")
    with pytest.raises(JaxparError, match="interleaved_1f1b needs microbatches divisible"):
        pl.Schedule(4, 6, 2, "interleaved_1f1b")
    with pytest.raises(JaxparError, match="pipeline.schedule='zb': choose one of"):
        pl.Schedule(2, 2, 1, "zb")
    with pytest.raises(JaxparError, match="n_layers=4"), nnx.use_eager_sharding(False):
        Transformer(CFG, rngs=nnx.Rngs(0), pipeline=pl.Schedule(2, 2, 1))


def test_layout_round_trip_is_a_reshape():
    graphdef, state, _, _ = _reference()
    staged = pl.to_pipeline_layout(state, stages=2)
    flat = dict(nnx.to_flat_state(staged))
    wq = flat[("blocks", "attn", "wq", "kernel")]
    assert wq.get_value().shape == (2, 2, 32, 4, 8)
    assert jaxpar.logical_names(wq) == ("repeat", "stage", "embed", "heads", "head_dim")
    layers = dict(nnx.to_flat_state(state))[("blocks", "attn", "wq", "kernel")].get_value()
    np.testing.assert_array_equal(wq.get_value()[1, 0], layers[2])  # layer r*S + s
    np.testing.assert_array_equal(wq.get_value()[0, 1], layers[1])
    # Unstacked variables are untouched; the inverse restores names and values exactly.
    assert flat[("embed",)].get_value().shape == (CFG.vocab_size, CFG.d_model)
    back = dict(nnx.to_flat_state(pl.from_pipeline_layout(staged)))
    for path, var in nnx.to_flat_state(state):
        np.testing.assert_array_equal(back[path].get_value(), var.get_value())
        assert jaxpar.logical_names(back[path]) == jaxpar.logical_names(var)
    with pytest.raises(JaxparError, match="not a multiple"):
        pl.to_pipeline_layout(state, stages=3)


# --- the bare transform on a toy layer ----------------------------------------------------
def _toy_layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"]) + h


@pytest.mark.parametrize("stages,microbatches,repeats,mesh_stage", [
    (4, 2, 1, 2),   # fewer microbatches than stages; two stages per device
    (2, 3, 3, 2),   # circular, buffered, M not a multiple of S
])
def test_pipeline_transform_matches_sequential(stages, microbatches, repeats, mesh_stage):
    d, data = 8, 8 // mesh_stage
    batch = microbatches * data * 2
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w": 0.5 * jax.random.normal(k1, (repeats, stages, d, d)),
              "b": 0.1 * jax.random.normal(k2, (repeats, stages, d))}
    x = jax.random.normal(k3, (batch, d))

    def sequential(params, x):
        for layer in range(repeats * stages):
            r, s = divmod(layer, stages)
            x = _toy_layer(jax.tree.map(lambda a, r=r, s=s: a[r, s], params), x)
        return jnp.sum(x ** 2)

    def piped(params, x):
        y = pl.pipeline(_toy_layer, params, x, microbatches=microbatches,
                        act_names=("batch", "embed"))
        return jnp.sum(y ** 2)

    want, want_g = jax.jit(jax.value_and_grad(sequential, argnums=(0, 1)))(params, x)
    plan = _plan({"stage": mesh_stage, "data": data})
    params = jax.device_put(params, NamedSharding(plan.mesh, PartitionSpec(None, "stage")))
    with plan.activate():
        got, got_g = jax.jit(jax.value_and_grad(piped, argnums=(0, 1)))(params, x)
    assert _rel(got, want) < 1e-5
    assert _max_grad_rel(got_g, want_g) < 1e-5


def test_pipeline_rejects_bad_batch():
    params = {"w": jnp.zeros((1, 2, 4, 4)), "b": jnp.zeros((1, 2, 4))}
    with pytest.raises(JaxparError, match="divisible by pipeline.microbatches"):
        pl.pipeline(_toy_layer, params, jnp.zeros((6, 4)), microbatches=4,
                    act_names=("batch", "embed"))


# --- the reference model: exact against the unpipelined one ------------------------------
@pytest.mark.parametrize("stages,microbatches,repeats,axes", [
    (4, 4, 1, MESH_S4),   # GPipe, M = S, four stages, composed with FSDP (fsdp=2)
    (2, 4, 2, MESH_SR),   # circular, buffered (M > S)
    (2, 2, 2, MESH_3D),   # circular, M = S, 3D mesh data=2 x tensor=2 x stage=2
], ids=["S4M4R1-fsdp2", "S2M4R2", "S2M2R2-3d"])
def test_pipelined_transformer_equals_unpipelined(stages, microbatches, repeats, axes):
    _, _, ref_loss, ref_grads = _reference()
    loss, grads, _, _, _ = _run(stages, microbatches, repeats, tuple(axes.items()))
    assert _rel(loss, ref_loss) < 1e-5
    assert _max_grad_rel(grads, ref_grads) < 1e-5


@pytest.mark.parametrize("axes", [MESH_SR, MESH_3D], ids=["stage2-data4", "3d"])
def test_stage_shift_is_collective_permute_and_weights_stay(axes):
    schedule = (2, 4, 2) if axes is MESH_SR else (2, 2, 2)
    _, _, hlo, plan, _ = _run(*schedule, tuple(axes.items()))
    table = jinspect.collective_table(hlo, plan.mesh)
    permutes = [r for r in table if r["kind"] == "collective-permute"]
    assert permutes and all(r["axes"] == ["stage"] for r in permutes), table
    # fsdp=1: no weight is ever gathered, least of all a whole stage's layers.
    assert not [r for r in table if r["kind"] == "all-gather"], table
    # What crosses the stage axis is activations (microbatches of the residual stream),
    # less in all than the weights of even one stage.
    _, _, _, _, state = _run(*schedule, tuple(axes.items()))
    one_stage = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(state["blocks"])) // 2
    stage_bytes = sum(r["bytes_per_device"] for r in table if "stage" in r["axes"])
    assert 0 < stage_bytes <= 2 * BATCH * SEQ * CFG.d_model * 4 < one_stage, table


@pytest.mark.parametrize("stages,microbatches,repeats,axes", [
    (4, 4, 1, MESH_S4), (2, 2, 2, MESH_3D)], ids=["stage4-fsdp2", "3d"])
def test_each_device_holds_only_its_stages(stages, microbatches, repeats, axes):
    _, _, _, plan, state = _run(stages, microbatches, repeats, tuple(axes.items()))
    per_device = stages // plan.mesh.shape["stage"]
    coords = {d.id: dict(zip(plan.mesh.axis_names, np.argwhere(plan.mesh.devices == d)[0],
                             strict=True)) for d in plan.mesh.devices.flat}
    checked = 0
    for path, var in nnx.to_flat_state(state["blocks"]):
        value = var.get_value()
        assert value.shape[:2] == (repeats, stages)
        assert value.sharding.spec[1] == "stage", (path, value.sharding.spec)
        full = np.asarray(value)
        for shard in value.addressable_shards:
            st = coords[shard.device.id]["stage"]
            assert shard.data.shape[:2] == (repeats, per_device)
            assert shard.index[1] == slice(st * per_device, (st + 1) * per_device)
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
            checked += 1
    assert checked == 9 * plan.mesh.size


# --- composition: remat, precision, gradient accumulation, the Trainer --------------------
def _lm_loss(block_fn=None, dtype=jnp.float32):
    """Next-token loss calling the model with an explicit block wrapper and compute dtype."""
    def loss(model, tokens):
        logits = model(tokens[:, :-1], block_fn=block_fn, dtype=dtype).astype(jnp.float32)
        labels = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))
    return loss


def test_trainer_with_remat_and_gradient_accumulation_is_exact_on_3d_mesh():
    import optax

    _, ref_state, ref_loss, ref_grads = _reference()
    # Trainer's gradient accumulation (2 chunks of 8 rows), each chunk a 2-microbatch
    # circular pipeline, every block rematerialised.
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH_3D), "fsdp_tp", microbatches=2,
                                   remat="full")
    model = _pipelined_model(pl.Schedule(2, 2, 2), plan)
    # Same seed, same weights as the unpipelined model, restacked.
    want = dict(nnx.to_flat_state(pl.to_pipeline_layout(ref_state, 2)))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        np.testing.assert_allclose(np.asarray(var.get_value()), want[path].get_value(),
                                   rtol=1e-6, atol=1e-8)
    trainer = jaxpar.Trainer(model, optax.adam(3e-3), plan,
                             loss_fn=_lm_loss(remat_lib.block_wrapper("full")))
    batch = np.asarray(_tokens())
    first = trainer.step(batch)
    second = trainer.step(batch)
    assert _rel(first["loss"], ref_loss) < 1e-5
    assert _rel(first["grad_norm"], optax.tree.norm(ref_grads)) < 1e-5
    assert second["loss"] < first["loss"]
    wq = trainer.state["params"]["blocks"]["attn"]["wq"]["kernel"].get_value()
    assert wq.shape == (2, 2, 32, 4, 8) and wq.sharding.spec[1] == "stage"


def test_bf16_compute_through_trainer_tracks_f32():
    import optax

    _, _, ref_loss, _ = _reference()
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH_SR), "fsdp_tp",
                                   precision=Policy.parse("params=f32,compute=bf16"))
    model = _pipelined_model(pl.Schedule(2, 4, 2), plan)
    trainer = jaxpar.Trainer(model, optax.adam(3e-3), plan,
                             loss_fn=_lm_loss(dtype=jnp.bfloat16))
    # f32 master weights, cast to bf16 in the step (plan.weight_copy: no copy stored).
    assert not trainer.stores_copy and trainer.master_key == "params"
    assert trainer.state["params"]["blocks"]["mlp"]["w_up"]["kernel"].dtype == jnp.float32
    batch = np.asarray(_tokens())
    first = trainer.step(batch)
    second = trainer.step(batch)
    assert _rel(first["loss"], ref_loss) < 2e-2
    assert second["loss"] < first["loss"]
