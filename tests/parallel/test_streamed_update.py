"""The offloaded optimizer update streamed slab by slab: the slabs it takes, the same
update as the whole-tree one, optimizers that cannot stream found out, and, compiled for a
TPU by its own compiler, device memory that grows by a slab or two, not by the state."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis import targets
from jaxpar.analysis.hlo import memory_stats
from jaxpar.analysis.inspection import compile_step
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.parallel import streamed_update
from jaxpar.planner.prediction import predict
from jaxpar.training.optimizer import make_optimizer
from tests.helpers import small_config

TINY = TransformerConfig(vocab_size=96, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                         d_ff=64, max_seq_len=16)


def _params():
    return nnx.state(Transformer(TINY, rngs=nnx.Rngs(0)), nnx.Param)


def _shardings(params):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    return jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.P()), params)


def test_the_layer_stack_streams_a_layer_at_a_time_and_large_tensors_in_pieces():
    params = _params()
    leaves = jax.tree.leaves(params)
    slabs = streamed_update.plan_slabs(params, _shardings(params), [True] * len(leaves))
    stack, *pieces, rest = slabs
    assert stack.count == TINY.n_layers and set(stack.rows) == {1}
    assert {leaves[j].shape[0] for j in stack.leaves} == {TINY.n_layers}
    # The embedding and output head (96 x 32 each, smaller than a layer's 4 x 32 x 64
    # MLP alone) fit beside the final norm in the remainder, updated whole.
    assert not pieces and rest.count == 1
    assert sorted(stack.leaves + rest.leaves) == list(range(len(leaves)))
    two = streamed_update.plan_slabs(params, _shardings(params), [True] * len(leaves), 2)
    assert two[0].count == TINY.n_layers // 2 and set(two[0].rows) == {2}
    # A vocabulary larger than a layer: the embedding comes in pieces no larger.
    big = nnx.state(Transformer(TransformerConfig(**{**vars(TINY), "vocab_size": 8192}),
                                rngs=nnx.Rngs(0)), nnx.Param)
    slabs = streamed_update.plan_slabs(big, _shardings(big), [True] * len(leaves))
    layer = streamed_update.slab_bytes(slabs[:1], big, _shardings(big))
    assert len(slabs) == 4 and all(s.count > 1 for s in slabs[1:3])
    assert streamed_update.slab_bytes(slabs, big, _shardings(big)) <= layer


@pytest.mark.parametrize("name", ["adamw", "sgd"])  # lion: adamw's owners/per-slab path
def test_streamed_equals_whole_for_jaxpars_optimizers_with_clipping(name):
    cfg = small_config(f"train.optimizer={name}", "train.grad_clip=0.01").train
    opt = optax.with_extra_args_support(make_optimizer(cfg))
    params = _params()
    grads = jax.tree.map(lambda x: jnp.full_like(x, 3.0) * jnp.cos(jnp.arange(x.size)
                                                                    ).reshape(x.shape), params)
    state = opt.init(params)
    norm = optax.tree.norm(grads)

    def update(g, s, m):
        u, s = opt.update(g, s, m, global_norm=norm)
        m = optax.apply_updates(m, u)
        return m, s, jax.tree.map(lambda x: x.astype(jnp.bfloat16), m)

    want = update(grads, state, params)
    slabs = streamed_update.plan_slabs(params, _shardings(params),
                                       [True] * len(jax.tree.leaves(params)))
    owners = streamed_update.state_owners(opt, state, params)
    working = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    got = jax.jit(lambda g, s, m, p: streamed_update.streamed_update(
        update, g, s, m, p, owners=owners, slabs=slabs))(grads, state, params, working)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-6, atol=1e-7)
    assert streamed_update.is_elementwise(make_optimizer(cfg), params)


@pytest.mark.parametrize("optimizer", [
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),  # its own global norm
    optax.adafactor(1e-3),  # factored second moments
])
def test_optimizers_that_mix_tensors_are_found_out(optimizer):
    assert not streamed_update.is_elementwise(optimizer, _params())


def test_a_trainer_whose_optimizer_cannot_stream_says_so_and_still_trains_right():
    mesh = jaxpar.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    optimizer = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    runs = {}
    for fraction in (0.0, 1.0):
        plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", offload_optimizer=fraction)
        model = jaxpar.init_sharded(lambda: Transformer(TINY, rngs=nnx.Rngs(0)), plan)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = jaxpar.Trainer(model, optimizer, plan)
        said = [str(w.message) for w in caught if "mixes tensors" in str(w.message)]
        assert bool(said) == bool(fraction) and not t.streams_update
        batch = np.random.default_rng(0).integers(0, TINY.vocab_size, (4, 9)).astype(np.int32)
        runs[fraction] = [float(t.step(batch)["loss"]) for _ in range(3)]
    np.testing.assert_allclose(runs[1.0], runs[0.0], rtol=1e-6)


# --- compiled for a TPU -------------------------------------------------------------------
WIDE = ["model.vocab_size=2048", "model.d_model=1024", "model.n_layers=8",
        "model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=4096", "model.max_seq_len=128",
        "train.seq_len=64", "train.global_batch=2", "mesh.fsdp=1", "plan.remat=full"]
"""A model whose state (1.7 GiB in f32 with Adam) outgrows the TPU's on-chip memory, so
the compiler's figures are HBM's."""


MIXED = "plan.precision=params=float32,compute=bfloat16,output=float32"
MODES = {"plain": (), "offload": ("plan.offload_optimizer=1",),
         "mixed": (MIXED, "plan.offload_optimizer=1"),
         "host": (MIXED, "plan.offload_optimizer=1", "plan.host_update=true")}


@pytest.fixture(scope="module")
def wide_steps():
    target = targets.tpu_target("tpu-v5e:1x1")
    return {mode: compile_step(jaxpar.load_config(None, [*WIDE, *extra]), target)
            for mode, extra in MODES.items()}


def test_offloaded_state_comes_down_a_layer_at_a_time_on_a_tpu(wide_steps):
    plain, offload = (memory_stats(wide_steps[m].compiled) for m in ("plain", "offload"))
    moments = 2 * 8 * 4  # Adam's two f32 moments: the state offloaded (f32: no master)
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(
        wide_steps["plain"].run.trainer.state["params"]))
    layer = (params - 2 * 2048 * 1024 - 1024) / 8 * moments / 8
    assert offload["host_argument_bytes"] == pytest.approx(params * moments / 8, rel=1e-3)
    assert offload["temp_bytes"] - plain["temp_bytes"] <= 2 * layer
    # Before, the update brought all of it down: 1.15 GiB against a 128 MiB layer.
    assert offload["host_argument_bytes"] > 8 * layer
    assert wide_steps["offload"].run.trainer.streams_update


@pytest.mark.parametrize("mode", ["offload", "mixed"])
def test_the_planner_prices_the_streamed_update_as_the_tpu_compiler_does(wide_steps, mode):
    step = wide_steps[mode]
    got = memory_stats(step.compiled)
    want = predict(step.run.config, 1, backend="tpu")["memory"]
    assert want["argument_bytes"] + want["temp_bytes"] == pytest.approx(
        got["argument_bytes"] + got["temp_bytes"], rel=0.10)
    assert want["host_bytes"] == pytest.approx(got["host_argument_bytes"], rel=0.01)


def test_a_host_update_keeps_the_state_off_the_device_too(wide_steps):
    """Updated on the host, slab by slab, the device holds what the device update holds
    (the slabs pass through it on the TPU, sliced there) and at most two slabs besides
    (staging copies); before, the whole state came down."""
    mixed, host = (memory_stats(wide_steps[m].compiled) for m in ("mixed", "host"))
    assert host["host_argument_bytes"] == mixed["host_argument_bytes"]
    slabs = predict(wide_steps["mixed"].run.config, 1, backend="tpu")["memory"][
        "offload_transient_bytes"]
    assert host["temp_bytes"] <= mixed["temp_bytes"] + slabs


@pytest.mark.parametrize("precision", ["p=f32,c=f32,o=f32", "p=f32,c=bf16,o=f32"])
def test_on_cpu_the_offloaded_step_holds_at_most_two_slabs_more(devices, precision):
    """XLA:CPU keeps host and device memory in one RAM and drops the copies between them,
    so the offloaded step's temporaries stay within two slabs of the plain step's (the
    planner's transient), never the whole state. (Each step built from shapes: the Trainer's
    own step for the global batch, nothing initialised.)"""
    temp = {}
    for name, extra in (("plain", ()), ("offload", ("plan.offload_optimizer=1",))):
        config = small_config("mesh.fsdp=4", "mesh.tensor=2", f"plan.precision={precision}",
                              *extra)
        temp[name] = memory_stats(compile_step(config).compiled)["temp_bytes"]
    slabs = predict(small_config("mesh.fsdp=4", "mesh.tensor=2",
                                 f"plan.precision={precision}", "plan.offload_optimizer=1"),
                    8, backend="tpu")["memory"]["offload_transient_bytes"]
    assert temp["offload"] - temp["plain"] <= slabs
