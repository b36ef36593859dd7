"""The reference decoder trained under the 1F1B schedules through the Trainer: equal to the
unpipelined model on one device over three steps, composed with FSDP, tensor and sequence
parallelism, ZeRO-3, remat and gradient accumulation, with LoRA, and checkpoints that
restore on one device and under another schedule's layout."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis import hlo
from jaxpar.checkpoint.checkpointer import Checkpointer
from jaxpar.errors import JaxparError
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.parallel import pipeline as pl
from jaxpar.training.trainable import trainable_filter

CFG = TransformerConfig(vocab_size=128, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)
BATCH, SEQ, STEPS, LR = 16, 16, 3, 0.5
S4D2 = (("stage", 4), ("data", 2))
S2F2T2 = (("stage", 2), ("fsdp", 2), ("tensor", 2))
COMPOSED = dict(zero_stage=3, remat="full", microbatches=2, sequence_parallel=True)


def batches() -> list[np.ndarray]:
    keys = jax.random.split(jax.random.key(7), STEPS)
    return [np.asarray(jax.random.randint(k, (BATCH, SEQ + 1), 0, CFG.vocab_size))
            for k in keys]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def layers_layout(trainer: jaxpar.Trainer, params=None) -> dict:
    """The trainer's weights (or ``params`` laid out like them) as flat ``path -> array``
    in the plain ``(layers, ...)`` layout."""
    schedule = trainer.pipeline_schedule
    params = trainer.state["params"] if params is None else params
    if schedule is not None:
        params = pl.from_pipeline_layout(params, schedule.layers_per_stage)
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}


def train(trainer: jaxpar.Trainer, steps: int = STEPS) -> tuple[list[float], list[float]]:
    """Losses and gradient norms of ``steps`` steps."""
    out = [trainer.step(b) for b in batches()[:steps]]
    return [float(m["loss"]) for m in out], [float(m["grad_norm"]) for m in out]


def reference() -> tuple[list[float], dict, dict, list[float]]:
    """The unpipelined model on one device, plain SGD: losses, first weights, first
    gradients, gradient norms."""
    return reference_run()[1]


@functools.cache
def reference_run() -> tuple[jaxpar.Trainer, tuple[list[float], dict, dict, list[float]]]:
    """The one-device trainer (trained: a checkpoint's restore overwrites its state) and
    :func:`reference`'s figures."""
    mesh = jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1])
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp")
    model = jaxpar.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan)
    trainer = jaxpar.Trainer(model, optax.sgd(LR), plan)
    first = layers_layout(trainer)
    grads = layers_layout(trainer, trainer.gradients(batches()[0]))
    losses, norms = train(trainer)
    return trainer, (losses, first, grads, norms)


def pipelined_trainer(axes: tuple, schedule: pl.Schedule, optimizer=None, **knobs
                      ) -> jaxpar.Trainer:
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(dict(axes)), "fsdp_tp", **knobs)
    model = jaxpar.init_sharded(
        lambda: Transformer(CFG, rngs=nnx.Rngs(0), pipeline=schedule), plan)
    return jaxpar.Trainer(model, optimizer or optax.sgd(LR), plan)


@pytest.fixture(scope="module")
def s4d2_1f1b(devices) -> jaxpar.Trainer:
    """Plain 1F1B, two layers a stage, on stage 4 x data 2: built once for the test that
    reads its compiled step (lowering reads no weight) and the checkpoint test, which alone
    steps it."""
    return pipelined_trainer(S4D2, pl.Schedule(4, 4, 1, "1f1b", 2))


# Plain 1F1B on stage 4 x data 2 is the checkpoint test's run below (its two steps'
# weights, restored on one device, give the one-device run's third loss); interleaved 1F1B
# there is the LoRA test's (equal to the circular schedule's), and both schedules, with
# everything composed, are here.
@pytest.mark.parametrize("axes,schedule,knobs", [
    (S2F2T2, pl.Schedule(2, 4, 1, "1f1b", 4), COMPOSED),
    (S2F2T2, pl.Schedule(2, 2, 2, "interleaved_1f1b", 2), COMPOSED),
], ids=["stage2-fsdp2-tensor2-1f1b-composed", "stage2-fsdp2-tensor2-interleaved-composed"])
def test_schedules_train_like_the_unpipelined_model(devices, axes, schedule, knobs):
    """Eight layers on the stages (two or four a stage, in one chunk or two): every
    gradient of the first step, and the losses and gradient norms of three SGD steps,
    equal the one-device run's within 1e-5."""
    ref_losses, ref_first, ref_grads, ref_norms = reference()
    trainer = pipelined_trainer(axes, schedule, **knobs)
    first = layers_layout(trainer)
    # The same seed gives the same weights: bit for bit under XLA's default CPU code
    # generation; the tests' (tests/conftest.py: classic emitters, no LLVM optimisation)
    # rounds a few elements of the stacked program's initialisers one float32 ulp apart.
    for path, value in ref_first.items():
        np.testing.assert_allclose(first[path], value, rtol=2.5e-7, atol=0)
    grads = layers_layout(trainer, trainer.gradients(batches()[0]))
    assert max(rel(grads[k], ref_grads[k]) for k in ref_grads) < 1e-5
    losses, norms = train(trainer)
    assert max(rel(a, b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5
    assert max(rel(a, b) for a, b in zip(norms, ref_norms, strict=True)) < 1e-5
    wq = trainer.state["params"]["blocks"]["attn"]["wq"]["kernel"].get_value()
    assert wq.sharding.spec[1] == "stage"  # each device holds its own stages' layers


def test_activations_move_by_collective_permute_and_weights_stay(s4d2_1f1b):
    """Stage to stage the step sends activations and their gradients (collective-permutes
    over ``stage``) and never gathers a weight: the other collectives are the gradient
    all-reduces over ``data`` and the small sums over ``stage`` of the loss and of the
    embedding's and head's gradients (each stage holds a replica of those)."""
    trainer = s4d2_1f1b
    text = trainer.lower(batches()[0]).compile().as_text()
    table = {(r["kind"], tuple(r["axes"])): r for r in
             hlo.collective_table(text, trainer.plan.mesh)}
    assert table[("collective-permute", ("stage",))]["count"] >= 2
    assert {kind for kind, _ in table} <= {"collective-permute", "all-reduce"}
    assert {frozenset(axes) for kind, axes in table if kind == "all-reduce"} <= {
        frozenset({"stage"}), frozenset({"data"}), frozenset({"stage", "data"})}
    # The data axis is split by hand in the schedule: its gradient sum runs once a step,
    # not once a tick.
    data = table[("all-reduce", ("data",))]
    assert data["executions"] == data["count"]


def test_lora_under_1f1b_equals_lora_under_circular(devices):
    """LoRA adapters on every layer, trained under interleaved 1F1B and under the circular
    schedule (jax.grad of a pipelined forward) on the same layout, two steps on one batch:
    equal losses, falling, and only the adapters train."""
    def run(kind: str) -> tuple[list[float], jaxpar.Trainer]:
        schedule = pl.Schedule(4, 4, 2, kind)
        plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(dict(S4D2)), "fsdp_tp")
        model = jaxpar.init_sharded(lambda: jaxpar.lora.apply(
            Transformer(CFG, rngs=nnx.Rngs(0), pipeline=schedule), rank=4, rngs=1), plan)
        trainer = jaxpar.Trainer(model, optax.adam(1e-2), plan,
                                 trainable=trainable_filter(lora=True))
        batch = batches()[0]
        return [float(trainer.step(batch)["loss"]) for _ in range(2)], trainer

    circular, _ = run("circular")
    scheduled, trainer = run("interleaved_1f1b")
    assert max(rel(a, b) for a, b in zip(scheduled, circular, strict=True)) < 1e-5
    assert scheduled[1] < scheduled[0]
    assert all("lora" in "/".join(map(str, k)) for k, _ in
               nnx.to_flat_state(trainer.state["params"]))


def test_checkpoint_of_a_1f1b_run_restores_on_one_device_and_on_a_circular_layout(
        s4d2_1f1b, tmp_path):
    """Saved after two 1F1B steps (two layers a stage), restored into the unpipelined
    one-device model and into the circular layout (layer 4r + s at [r, s], so every layer
    moves): the same weights, and the third step's loss equals the uninterrupted run's."""
    single, (ref_losses, *_) = reference_run()
    saved = s4d2_1f1b
    train(saved, 2)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(saved, force=True)
    weights = layers_layout(saved)
    circular = pipelined_trainer(S4D2, pl.Schedule(4, 4, 2, "circular"))
    for trainer in (single, circular):
        with Checkpointer(tmp_path) as ckpt:
            assert ckpt.restore(trainer)["step"] == 2
    # Evaluation runs the forward pipeline alone (no schedule, no backward): the same loss.
    assert rel(saved.eval_loss(batches()[2]), single.eval_loss(batches()[2])) < 1e-5
    for trainer in (single, circular):
        restored = layers_layout(trainer)
        for path, value in weights.items():
            np.testing.assert_array_equal(restored[path], value)
        third = float(trainer.step(batches()[2])["loss"])
        assert rel(third, ref_losses[2]) < 1e-5


def test_a_1f1b_model_without_its_mesh_gets_one_line(devices):
    # Refused before any weight is read: the model's shapes suffice.
    model = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0),
                                               pipeline=pl.Schedule(4, 4, 1, "1f1b", 2)))
    tokens = batches()[0]
    with pytest.raises(JaxparError, match="schedule 1f1b runs under a plan whose mesh has "
                                          "stage=4"):
        model.next_token_loss(tokens)
