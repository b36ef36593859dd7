"""A run assembled from its config: ``package.module:function`` specs imported, the mesh,
plan and pipeline schedule the config describes, the built-in or the user's model, the
loss, and the whole assembly (LoRA, trainable filter, config checked first)."""

import collections
import os.path

import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.checkpoint.reshard import flat_paths
from jaxpar.config.assembly import (
    assemble,
    build_mesh,
    build_plan,
    build_trainer,
    import_object,
    loss_function,
    model_factory,
    pipeline_schedule,
)
from jaxpar.errors import JaxparError
from jaxpar.models.transformer import Transformer
from jaxpar.training.objective import lm_loss
from tests import user_models
from tests.helpers import loader, small_config

TINY = ["model.vocab_size=256", "model.d_model=16", "model.n_layers=2", "model.d_ff=32",
        "model.n_heads=2", "model.n_kv_heads=1", "model.max_seq_len=16", "train.seq_len=8",
        "train.global_batch=2", "mesh.data=1", "mesh.fsdp=-1"]

LLAMA_SIZES = "{d: 8, heads: 2, kv_heads: 1, ff: 16, layers: 1}"


def plain_factory(width: int = 3):
    """A ``model.factory`` without an ``rngs`` parameter."""
    return nnx.Linear(width, 2, rngs=nnx.Rngs(0))


def test_import_object_reads_both_spellings():
    assert import_object("os.path:join", "train.loss") is os.path.join
    assert import_object("os.path.join", "train.loss") is os.path.join
    nested = import_object("collections:OrderedDict.fromkeys", "k")  # an attribute path
    assert nested == collections.OrderedDict.fromkeys
    assert import_object("tests.user_models:llama_like", "k") is user_models.llama_like


@pytest.mark.parametrize("spec, message", [
    ("nodots", "model.factory='nodots' must look like package.module:function"),
    ("pkg.mod:", "model.factory='pkg.mod:' must look like package.module:function"),
    ("no_such_module_xyz:f", "model.factory='no_such_module_xyz:f': cannot import "
                             "'no_such_module_xyz' (No module named"),
    ("os.path:no_such_fn", "model.factory='os.path:no_such_fn': module 'os.path' has no "
                           "'no_such_fn'"),
    ("os:path.nope", "model.factory='os:path.nope': module 'os' has no 'path.nope'"),
    ("math:pi", "model.factory='math:pi' is not callable"),
])
def test_import_object_names_the_key_and_what_is_wrong(spec, message):
    with pytest.raises(JaxparError) as err:
        import_object(spec, "model.factory")
    assert str(err.value).startswith(message), str(err.value)


def test_mesh_and_plan_follow_the_config(devices):
    cfg = jaxpar.load_config(None, [*TINY, "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2",
                                    "plan.zero_stage=1", "plan.rules=fsdp_tp",
                                    "plan.remat=full"])
    mesh = build_mesh(cfg, devices[:4])
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 1, "expert": 1, "context": 1,
                                "tensor": 2}
    assert set(mesh.devices.flat) == set(devices[:4])
    plan = build_plan(cfg, mesh)
    assert plan.mesh is mesh and plan.zero_stage == 1 and plan.remat == "full"
    # The free axis takes what the devices leave.
    free = jaxpar.load_config(None, [*TINY, "mesh.data=2", "mesh.fsdp=-1"])
    assert dict(build_mesh(free, devices).shape)["fsdp"] == 4
    assert dict(build_mesh(free, devices[:2]).shape)["fsdp"] == 1


def test_pipeline_schedule_only_with_stages(devices):
    cfg = jaxpar.load_config(None, [*TINY, "model.n_layers=4", "mesh.data=1", "mesh.fsdp=1",
                                    "mesh.stage=2", "pipeline.microbatches=4"])
    schedule = pipeline_schedule(cfg, build_mesh(cfg, devices[:2]))
    assert (schedule.stages, schedule.repeats, schedule.microbatches) == (2, 2, 4)
    flat = jaxpar.load_config(None, TINY)
    assert pipeline_schedule(flat, build_mesh(flat, devices[:2])) is None
    # A model.factory model's schedule is decided by its blocks (tests/parallel/test_staged.py)
    factory = jaxpar.load_config(None, [*TINY, "mesh.fsdp=1", "mesh.stage=2",
                                        "model.factory=tests.user_models:llama_like"])
    assert pipeline_schedule(factory, build_mesh(factory, devices[:2])) is None


def test_built_in_model_from_the_config():
    cfg = jaxpar.load_config(None, TINY)
    model = nnx.eval_shape(model_factory(cfg))  # shapes are enough here
    assert isinstance(model, Transformer)
    assert model.config == cfg.model.transformer()
    assert model.embed.get_value().shape == (256, 16)
    assert model.blocks.mlp.w_up.kernel.get_value().shape == (2, 16, 32)


def test_user_factory_gets_kwargs_and_rngs():
    cfg = jaxpar.load_config(None, [*TINY, "model.factory=tests.user_models:llama_like",
                                    f"model.kwargs={LLAMA_SIZES}"])
    model = model_factory(cfg)()
    assert type(model).__name__ == "LlamaLike"
    assert model.embed_tokens.embedding.get_value().shape == (user_models.VOCAB, 8)
    assert model.layers[0].mlp.up_proj.kernel.get_value().shape == (8, 16)
    # The seed is train.seed: the same config builds the same weights, another seed not.
    again = model_factory(cfg)()
    other = model_factory(jaxpar.load_config(None, [
        *TINY, "model.factory=tests.user_models:llama_like", "train.seed=1",
        f"model.kwargs={LLAMA_SIZES}"]))()
    first = np.asarray(model.lm_head.kernel.get_value())
    assert np.array_equal(first, np.asarray(again.lm_head.kernel.get_value()))
    assert not np.array_equal(first, np.asarray(other.lm_head.kernel.get_value()))


def test_factory_without_rngs_and_factories_that_fail():
    plain = jaxpar.load_config(None, [*TINY, "model.factory=tests.config.test_assembly:"
                                             "plain_factory", "model.kwargs={width: 5}"])
    assert model_factory(plain)().kernel.get_value().shape == (5, 2)
    bad_kwargs = jaxpar.load_config(None, [*TINY, "model.factory=tests.user_models:llama_like",
                                           "model.kwargs={depth: 3, d: 8}"])
    with pytest.raises(JaxparError, match=r"model.factory='tests.user_models:llama_like' "
                                          r"rejected model.kwargs \['d', 'depth'\]: .*depth"):
        model_factory(bad_kwargs)()
    not_a_module = jaxpar.load_config(None, [*TINY, "model.factory=collections:OrderedDict"])
    with pytest.raises(JaxparError, match=r"model.factory='collections:OrderedDict' returned "
                                          r"a OrderedDict, not a Flax NNX module"):
        model_factory(not_a_module)()
    missing = jaxpar.load_config(None, [*TINY, "model.factory=tests.user_models:nope"])
    with pytest.raises(JaxparError, match="module 'tests.user_models' has no 'nope'"):
        model_factory(missing)


def test_loss_function():
    assert loss_function(jaxpar.load_config(None, TINY)) is lm_loss
    cfg = jaxpar.load_config(None, [*TINY, "train.loss=tests.user_models:next_token_loss"])
    assert loss_function(cfg) is user_models.next_token_loss
    with pytest.raises(JaxparError, match="train.loss='tests.user_models:VOCAB' is not "
                                          "callable"):
        loss_function(jaxpar.load_config(None, [*TINY, "train.loss=tests.user_models:VOCAB"]))


def test_assemble_with_lora_trains_the_adapters_only(devices):
    cfg = jaxpar.load_config(None, [*TINY, "lora.enabled=true", "lora.rank=2",
                                    "lora.target=attn/wq$"])
    built = assemble(cfg, devices[:2])
    assert built.schedule is None and built.config is cfg
    assert dict(built.plan.mesh.shape)["fsdp"] == 2
    trained = flat_paths(built.trainer.state["params"])
    assert sorted(trained) == ["blocks/attn/wq/lora_a", "blocks/attn/wq/lora_b"]
    frozen = flat_paths(built.trainer.state["frozen"])
    assert "blocks/attn/wq/base/kernel" in frozen and "embed" in frozen
    assert built.trainer.loss_fn is lm_loss


def test_assemble_checks_the_config_for_the_devices_first(devices):
    cfg = jaxpar.load_config(None, [*TINY, "train.global_batch=4"])
    with pytest.raises(JaxparError, match=r"train.global_batch=4 is not divisible by the "
                                          r"data-parallel size 3"):
        assemble(cfg, devices[:3])


def test_from_config_builds_what_the_config_says(devices):
    cfg = small_config("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    trainer = build_trainer(cfg)
    assert dict(trainer.plan.mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1,
                                              "context": 1, "tensor": 2}
    m = trainer.step(loader().batch(0))
    assert np.isfinite(m["loss"]) and m["step"] == 1
    assert isinstance(trainer.model, jaxpar.models.Transformer)

