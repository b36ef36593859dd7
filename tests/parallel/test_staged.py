"""Pipeline stages for models written the way users write them (tests/user_models.py): every
schedule against the 1-device run of the same weights and batches, the stage axis in the
compiled program, 1F1B's flat memory, the plan's remat inside the stages, refusals."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.errors import JaxparError
from jaxpar.parallel.staged import StagedModel, StageSplit, stage_model
from jaxpar.sharding.partitioning import abstract_sharded
from tests.user_models import (
    LLAMA_ANNOTATIONS,
    NANOGPT_ANNOTATIONS,
    VOCAB,
    LlamaLike,
    MhaLM,
    NanoGPT,
    ScanLM,
    nanogpt_loss,
)

LLAMA_SPLIT = StageSplit(embed=lambda m, tokens: m.embed_tokens(tokens), blocks="layers",
                         head=lambda m, h: m.lm_head(m.norm(h)))
"""How :class:`LlamaLike` divides (``pipeline.split`` in a config names it)."""

SCAN_SPLIT = StageSplit(embed=lambda m, tokens: m.embed(tokens),
                        head=lambda m, h: m.head(h))  # blocks: found (the nnx.vmap stack)

NANOGPT_SPLIT = StageSplit(embed=lambda m, t: m.wte(t) + m.wpe(jnp.arange(t.shape[1])),
                           blocks="h", head=lambda m, h: m.wte.attend(m.ln_f(h)))
"""nanoGPT's parts; its head is tied (``wte.attend``), so the head's weights hold the
embedding too."""

TOKENS = np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, VOCAB))
STEPS = 3


def _llama() -> LlamaLike:
    return LlamaLike(d=32, heads=4, kv_heads=2, ff=64, layers=4, rngs=nnx.Rngs(0))


def _scan() -> ScanLM:
    return ScanLM(d=32, ff=64, layers=4, rngs=nnx.Rngs(0))


def _plan(stages: int, remat: str = "none", **mesh) -> jaxpar.Plan:
    if stages == 1:
        mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    else:
        mesh = jaxpar.make_mesh({"stage": stages, "fsdp": 8 // stages, **mesh})
    return jaxpar.Plan.from_preset(mesh, "fsdp", annotations=LLAMA_ANNOTATIONS, remat=remat)


def _trainer(build, split, stages=1, kind="", microbatches=0, remat="none"):
    plan = _plan(stages, remat)

    def make():
        model = build()
        if stages == 1:
            return model
        return stage_model(model, split, stages=stages, schedule=kind,
                           microbatches=microbatches)

    return jaxpar.Trainer(jaxpar.init_sharded(make, plan), optax.adam(1e-2), plan)


@functools.cache
def _llama_staged(kind: str) -> jaxpar.Trainer:
    """LlamaLike on 2 stages by ``kind``, one microbatch a stage, built once for the module:
    test_every_schedule_on_a_layer_list_equals_one_device trains the gpipe one (the only
    test that steps it); the others lower it, which reads shapes only."""
    return _trainer(_llama, LLAMA_SPLIT, stages=2, kind=kind)


def _losses(trainer) -> np.ndarray:
    return np.array([float(trainer.step(TOKENS)["loss"]) for _ in range(STEPS)])


def _nanogpt() -> NanoGPT:
    model = NanoGPT(d=32, heads=4, layers=4, dropout=0.0, rngs=nnx.Rngs(0))
    for _, module in nnx.iter_modules(model):  # no dropout: no random streams to carry
        if isinstance(module, nnx.Dropout):
            module.rngs = None
    return model


@pytest.fixture(scope="module")
def llama_base():
    return _losses(_trainer(_llama, None))


# 1F1B and interleaved 1F1B on a layer list against one device: nanoGPT's (its blocks
# are the list ``h``) in test_1f1b_with_tensor_parallel_stages_trains_like_one_device, with
# tensor-parallel stages besides; LlamaLike by 1F1B in tests/checkpoint/test_structure.py.
@pytest.mark.parametrize("kind", ["gpipe", "circular"])
def test_every_schedule_on_a_layer_list_equals_one_device(kind, llama_base):
    trainer = (_llama_staged(kind) if kind == "gpipe" else
               _trainer(_llama, LLAMA_SPLIT, stages=2, kind=kind))
    schedule = trainer.pipeline_schedule
    assert (schedule.kind, schedule.stages, schedule.layers) == (kind, 2, 4)
    np.testing.assert_allclose(_losses(trainer), llama_base, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def nanogpt_base():
    """nanoGPT's losses on one device (its own loss function)."""
    one = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1]),
                                  "fsdp_tp", annotations=NANOGPT_ANNOTATIONS)
    return _losses(jaxpar.Trainer(jaxpar.init_sharded(_nanogpt, one), optax.adam(1e-2), one,
                                  loss_fn=nanogpt_loss))


@pytest.mark.parametrize("kind, axes", [("1f1b", {"fsdp": 2, "tensor": 2}),
                                        ("interleaved_1f1b", {"tensor": 4})],
                         ids=["stage2-fsdp2-tensor2-1f1b", "stage2-tensor4-interleaved"])
def test_1f1b_with_tensor_parallel_stages_trains_like_one_device(kind, axes, nanogpt_base):
    """nanoGPT's fused c_attn split over ``tensor`` makes GSPMD reshard by
    collective-permutes inside each stage's work; stages running different work reached
    different ones and XLA aborted. The stages now run in lockstep."""
    base = nanogpt_base
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"stage": 2, **axes}), "fsdp_tp",
                                   annotations=NANOGPT_ANNOTATIONS)
    staged = jaxpar.init_sharded(
        lambda: stage_model(_nanogpt(), NANOGPT_SPLIT, stages=2, schedule=kind), plan)
    np.testing.assert_allclose(_losses(jaxpar.Trainer(staged, optax.adam(1e-2), plan)), base,
                               rtol=1e-5)


def test_a_scanned_stack_pipelines_by_1f1b_like_one_device():
    base = _losses(_trainer(_scan, None))
    np.testing.assert_allclose(_losses(_trainer(_scan, SCAN_SPLIT, 2, "1f1b")), base,
                               rtol=0, atol=1e-5)


def test_the_stage_axis_holds_the_blocks_and_activations_move_between_stages():
    trainer = _llama_staged("1f1b")
    model = trainer.model
    assert isinstance(model, StagedModel) and len(model.model.layers) == 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model.blocks)):
        assert leaf.sharding.spec[:2] == (None, "stage"), (path, leaf.sharding.spec)
    # Each stage holds its own layers: half of every block weight per device.
    kernel = model.blocks.mlp.up_proj.kernel.get_value()
    assert kernel.addressable_shards[0].data.size * 2 * 4 == kernel.size
    hlo = trainer.lower(TOKENS).compile().as_text()
    assert "collective-permute" in hlo


def _temp_bytes(kind: str, microbatches: int) -> int:
    trainer = (_llama_staged(kind) if microbatches == 2 else  # 2: one a stage, the default
               _trainer(_llama, LLAMA_SPLIT, 2, kind, microbatches))
    batch = np.tile(TOKENS, (microbatches // 2, 1))
    return trainer.lower(batch).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_memory_stays_flat_in_microbatches_while_gpipe_grows():
    """Microbatches of 4 rows: 2 and 8 of them (batch 8 and 32)."""
    gpipe = [_temp_bytes("gpipe", m) for m in (2, 8)]
    one_f = [_temp_bytes("1f1b", m) for m in (2, 8)]
    print({"gpipe": gpipe, "1f1b": one_f})
    assert gpipe[1] > 1.5 * gpipe[0]
    assert one_f[1] < 1.25 * one_f[0]


def test_the_plans_remat_policy_reaches_the_blocks_inside_the_stages():
    trainers = {"none": _llama_staged("gpipe"),
                "full": _trainer(_llama, LLAMA_SPLIT, 2, "gpipe", remat="full")}
    temp = {remat: t.lower(TOKENS).compile().memory_analysis().temp_size_in_bytes
            for remat, t in trainers.items()}
    assert temp["full"] < temp["none"], temp


@nnx.use_eager_sharding(False)
def test_unstaged_gives_the_model_back_computing_the_same():
    staged = stage_model(_llama(), LLAMA_SPLIT, stages=2, schedule="gpipe")
    original = staged.unstaged()
    assert isinstance(original, LlamaLike) and len(original.layers) == 4
    np.testing.assert_allclose(original(TOKENS), _llama()(TOKENS), rtol=0, atol=1e-6)
    scan = stage_model(_scan(), SCAN_SPLIT, stages=2).unstaged()
    np.testing.assert_allclose(scan(TOKENS), _scan()(TOKENS), rtol=0, atol=1e-6)


@pytest.mark.parametrize("build, split, stages, message", [
    (_llama, LLAMA_SPLIT, 3, "model.n_layers=4 is not divisible by 3 pipeline stages"),
    (_llama, StageSplit(embed=None, head=None, blocks="decoder"), 2,
     "StageSplit(blocks='decoder'): LlamaLike has no attribute at that path"),
    (_llama, StageSplit(embed=None, head=None, blocks="norm"), 2,
     "StageSplit(blocks='norm') is a RMSNorm"),
    (lambda: MhaLM(layers=2, rngs=nnx.Rngs(0)), StageSplit(embed=None, head=None), 2,
     "the blocks at 'blocks' hold random streams (dropout)"),
    (lambda: None, {"embed": None, "head": None}, 2, "jaxpar.stage_model: split is a dict, not a "
     "jaxpar.StageSplit: pass StageSplit(embed=..., head=..., blocks=...) (StageSplit(**split) "
     "from this dict)"),
    (lambda: {"layers": []}, LLAMA_SPLIT, 2, "jaxpar.stage_model: model is a dict, not an "
     "NNX module"),
])
@nnx.use_eager_sharding(False)
def test_a_model_that_cannot_be_staged_is_refused_in_one_line(build, split, stages, message):
    with pytest.raises(JaxparError, match=re.escape(message)):
        stage_model(build(), split, stages=stages)


def test_stages_without_a_split_or_on_an_explicit_mesh_are_refused():
    plan = _plan(2)  # the Trainer refuses the model's shapes: nothing initialised
    with pytest.raises(JaxparError, match="divide it with jaxpar.stage_model"):
        jaxpar.Trainer(abstract_sharded(_llama, plan), optax.sgd(0.1), plan)
    mesh = jaxpar.make_mesh({"stage": 2, "fsdp": 4}, explicit=True)
    explicit = jaxpar.Plan.from_preset(mesh, "fsdp", annotations=LLAMA_ANNOTATIONS)
    staged = stage_model(_llama(), LLAMA_SPLIT, stages=2)
    with pytest.raises(JaxparError, match="pipeline stages on an explicit-sharding mesh"):
        jaxpar.Trainer(staged, optax.sgd(0.1), explicit)


def test_a_config_divides_a_factory_model_by_pipeline_split(devices):
    cfg = jaxpar.load_config(None, [
        "model.factory=tests.user_models:llama_like", f"model.vocab_size={VOCAB}",
        "model.kwargs={d: 32, heads: 4, kv_heads: 2, ff: 64, layers: 4}",
        "pipeline.split=tests.parallel.test_staged:LLAMA_SPLIT", "pipeline.schedule=1f1b",
        "mesh.data=1", "mesh.stage=2", "mesh.fsdp=4", "train.global_batch=8",
        "train.seq_len=16", "plan.rules=fsdp"])
    run = jaxpar.assemble(cfg, devices, abstract=True)  # shapes: nothing initialised
    assert isinstance(run.trainer.structure, StagedModel)  # (model: weights, not shapes)
    assert (run.schedule.kind, run.schedule.layers, run.schedule.microbatches) == ("1f1b", 4, 2)
