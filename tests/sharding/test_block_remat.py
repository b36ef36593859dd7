"""The plan's remat policy on models jaxpar did not write: their repeated blocks run under
it (compiled temporaries shrink as on the reference model, offload policies put buffers in
host memory, compiled for a TPU), training equals one device without remat, and a model it
cannot reach gets one line. Also optimizer offload, DiLoCo and ZeRO++ on the same models
(docs/guides/models.md's table). Dropout under remat: tests/sharding/test_scanned.py
(mask_dropout)."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis import targets
from jaxpar.analysis.hlo import collective_table, matmul_flops, memory_stats
from jaxpar.analysis.inspection import compile_step
from jaxpar.errors import JaxparError
from jaxpar.sharding.block_remat import remat_blocks
from jaxpar.training.diloco import DiLoCo
from tests import user_models as um

MODELS = {
    # name: (factory, plan knobs, explicit mesh, loss takes a dict batch)
    "list": (lambda: um.LlamaLike(layers=3, ff=256, rngs=nnx.Rngs(0)),
             {"annotations": um.LLAMA_ANNOTATIONS}, False),
    "scan": (lambda: um.ScanLM(layers=3, ff=256, rngs=nnx.Rngs(0)), {}, False),
    "explicit": (lambda: um.ExplicitBlocksLM(ff=256, rngs=nnx.Rngs(0)), {}, True),
    "linen": (lambda: jaxpar.from_linen(um.LinenLlamaForCausalLM(), np.zeros((2, 8), np.int32)),
              {"annotations": um.LINEN_LLAMA_ANNOTATIONS}, False),
}


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, um.VOCAB, (8, 33)).astype(np.int32)


def trainer(model: str, remat: str, sharded: bool = True) -> jaxpar.Trainer:
    factory, knobs, explicit = MODELS[model]
    axes = {"fsdp": 4, "tensor": 2} if sharded else {"data": 1}
    mesh = jaxpar.make_mesh(axes, devices=None if sharded else jax.devices()[:1],
                            explicit=explicit)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", remat=remat, **knobs)
    return jaxpar.Trainer(jaxpar.init_sharded(factory, plan), optax.adam(1e-2), plan)


@functools.cache
def single_device_losses(model: str) -> tuple[float, ...]:
    """Three steps of the model on one device without remat (shared by the tests that
    hold a sharded run to it)."""
    single = trainer(model, "none", sharded=False)
    return tuple(float(single.step(tokens(i))["loss"]) for i in range(3))


@pytest.mark.parametrize("model", ["scan", "explicit"])  # a list: tests/sharding/test_scanned.py
def test_remat_reaches_the_blocks_and_training_equals_one_device(devices, model):
    full = trainer(model, "full")
    blocks = remat_blocks(full.model)
    assert blocks and all(type(m).__name__ == type(blocks[0][1]).__name__ for _, m in blocks)
    compiled = {name: t.lower(tokens()).compile()
                for name, t in (("full", full), ("none", trainer(model, "none")))}
    flops = {k: matmul_flops(c.as_text())["flops"] for k, c in compiled.items()}
    assert flops["full"] > flops["none"], flops  # the blocks' forward runs again
    temp = {k: memory_stats(c)["temp_bytes"] for k, c in compiled.items()}
    assert temp["full"] < temp["none"], temp  # what they saved is recomputed
    losses = [full.step(tokens(i))["loss"] for i in range(3)]
    np.testing.assert_allclose(losses, single_device_losses(model), rtol=1e-5)


def test_a_model_without_repeated_blocks_is_told_how_to_name_them(devices):
    mesh = jaxpar.make_mesh({"fsdp": 8}, explicit=True)
    with pytest.raises(JaxparError, match="no repeated blocks .* plan.remat_blocks") as err:
        plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", remat="full")
        jaxpar.init_sharded(lambda: um.ExplicitLM(rngs=nnx.Rngs(0)), plan)
    assert "\n" not in str(err.value)
    with pytest.raises(JaxparError, match="no module's path matches"):
        plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", remat="full", remat_blocks="^nope$")
        jaxpar.init_sharded(lambda: um.ExplicitBlocksLM(rngs=nnx.Rngs(0)), plan)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", remat="full", remat_blocks=r"^blocks/1$")
    model = jaxpar.init_sharded(lambda: um.ExplicitBlocksLM(rngs=nnx.Rngs(0)), plan)
    assert [p for p, _ in remat_blocks(model, r"^blocks/1$")] == ["blocks/1"]
    assert type(model.blocks[1]) is not type(model.blocks[0])


def test_a_linen_model_is_told_to_use_nn_remat(devices):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 8}), "fsdp", remat="full")
    with pytest.raises(JaxparError, match="cannot reach inside a linen model: .*nn.remat"):
        jaxpar.init_sharded(lambda: jaxpar.from_linen(
            um.LinenGPT(), np.zeros((2, 8), np.int32)), plan)


def test_offload_policies_put_a_user_models_activations_in_host_memory_on_a_tpu():
    annotations = json.dumps([[p, list(n)] for p, n in um.LLAMA_ANNOTATIONS])
    host = {}
    for remat in ("none", "offload_dots", "offload:layer_input"):
        config = jaxpar.load_config(None, [
            "model.factory=tests.user_models:llama_like", f"plan.annotations={annotations}",
            "mesh.fsdp=4", "mesh.data=1", "train.global_batch=8", "train.seq_len=128",
            f"plan.remat={remat}"])
        step = compile_step(config, targets.tpu_target("tpu-v5e:2x2"))
        host[remat] = (memory_stats(step.compiled)["host_temp_bytes"],
                       step.compiled.as_text().count("S(5)"))
    assert host["none"] == (0, 0)
    assert all(b > 0 and n > 0 for b, n in (host["offload_dots"], host["offload:layer_input"]))
    assert host["offload:layer_input"][0] < host["offload_dots"][0]  # one input a layer


def test_offloading_names_the_model_never_marks_is_warned(devices):
    """``offload:layer_input`` finds every block's input (the wrapper names it);
    ``offload:mlp_hidden`` names an activation LlamaLike never marks: one line says the
    policy does nothing for it, once, as the step is built."""
    import warnings

    from jaxpar.errors import JaxparWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", JaxparWarning)
        trainer("list", "offload:layer_input").lower(tokens())
    t = trainer("list", "offload:layer_input,mlp_hidden")
    with pytest.warns(JaxparWarning, match=r"LlamaLike marks no activation mlp_hidden "
                      r"\(jax.ad_checkpoint.checkpoint_name\)") as said:
        t.lower(tokens())
        t.lower(tokens())
    assert len(said) == 1


@pytest.mark.parametrize("model,host", [("scan", True), ("explicit", False),
                                        ("explicit", True), ("linen", True)])
def test_optimizer_offload_on_a_users_model_equals_one_device(devices, model, host):
    """All optimizer state in host memory, updated slab by slab on the device or on the
    host: the same losses as one device keeping it on the device."""
    factory, knobs, explicit = MODELS[model]
    mesh = jaxpar.make_mesh({"fsdp": 4, "tensor": 2}, explicit=explicit)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", offload_optimizer=1.0,
                                   host_update=host, **knobs)
    t = jaxpar.Trainer(jaxpar.init_sharded(factory, plan), optax.adam(1e-2), plan)
    assert t.streams_update
    assert all(x.sharding.memory_kind == "pinned_host"
               for x in jax.tree.leaves(t.state["opt_state"]) if x.ndim)
    losses = [t.step(tokens(i))["loss"] for i in range(3)]
    np.testing.assert_allclose(losses, single_device_losses(model), rtol=1e-5)


@pytest.mark.parametrize("model", ["list", "scan"])
def test_diloco_on_a_users_model_meets_like_synchronous_training(devices, model):
    """Two replicas over data, H = 1, outer SGD at lr 1: synchronous training, to float
    rounding; the anchor's loss reads back."""
    factory, knobs, _ = MODELS[model]
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}),
                                   "fsdp_tp", **knobs)

    def fresh():
        return jaxpar.Trainer(jaxpar.init_sharded(factory, plan), optax.sgd(0.1), plan)

    run, sync = DiLoCo(fresh(), sync_every=1, outer_lr=1.0, outer_momentum=0.0), fresh()
    got = [float(run.step(tokens(i))["loss"]) for i in range(3)]
    np.testing.assert_allclose(got, [float(sync.step(tokens(i))["loss"]) for i in range(3)],
                               rtol=1e-5)
    np.testing.assert_allclose(run.eval_loss(tokens(0)), sync.eval_loss(tokens(0)), rtol=1e-5)


def test_zeropp_on_a_users_model_moves_int8_and_tracks_the_plain_run(devices):
    """qwZ and qgZ on a user's NNX model under ZeRO-3 over fsdp 8: the weights' gathers
    and the gradients' reductions carry int8 (fewer bytes than the plain step's), and three
    steps' losses stay within 1% of it."""
    factory, knobs, _ = MODELS["list"]
    runs = {}
    for name, zeropp in (("plain", {}), ("int8", {"quantize_gather": "int8",
                                                  "quantize_reduce": "int8"})):
        plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 8}), "fsdp", zero_stage=3,
                                       **knobs, **zeropp)
        t = jaxpar.Trainer(jaxpar.init_sharded(factory, plan), optax.adam(1e-2), plan)
        table = collective_table(t.lower(tokens()).compile().as_text(), plan.mesh)
        moved = sum(r["bytes_per_device"] for r in table)
        runs[name] = (moved, [float(t.step(tokens(i))["loss"]) for i in range(3)], table)
    (plain, want, _), (quant, got, table) = runs["plain"], runs["int8"]
    assert any(r["kind"] == "all-to-all" for r in table)  # qgZ's int8 exchange
    assert quant < 0.6 * plain
    np.testing.assert_allclose(got, want, rtol=1e-2)
