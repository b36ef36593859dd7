"""Context parallelism in training: the sequence split over the ``context`` mesh axis.

The reference decoder trained on meshes with a context axis (all-gather and ring attention,
alone and with fsdp and tensor axes, balanced and natural sequence order) gives the losses
and gradient norms of the same model on one device; per-device activation memory at a long
sequence falls about as 1/c (c=4 against one device).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis.hlo import count_collectives
from jaxpar.models import Transformer
from jaxpar.sharding.partitioning import abstract_sharded
from jaxpar.training.optimizer import make_optimizer
from tests.helpers import SMALL, loader, make_trainer, small_config

STEPS = 2


@pytest.fixture(scope="module")
def batches():
    return [loader().batch(i) for i in range(STEPS)]


@pytest.fixture(scope="module")
def one_device(batches):
    trainer = make_trainer({"data": 1}, devices=jax.devices()[:1])
    return [trainer.step(b) for b in batches]


@pytest.mark.parametrize("axes, kind, balance", [
    ({"data": 4, "context": 2}, "allgather", True),
    ({"data": 2, "context": 4}, "ring", True),
    ({"context": 4, "tensor": 2}, "ring", False),
    ({"fsdp": 2, "context": 2, "tensor": 2}, "allgather", True),
    ({"fsdp": 2, "context": 2, "tensor": 2}, "ring", True),
])
def test_context_parallel_training_equals_one_device(batches, one_device, axes, kind, balance,
                                                      capfd, fresh_compile):
    trainer = make_trainer(axes)
    trainer = jaxpar.Trainer(trainer.model, trainer.optimizer, trainer.plan.replace(
        context_attention=kind, context_balance=balance))
    capfd.readouterr()
    got = [trainer.step(b) for b in batches]
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    for mine, ref in zip(got, one_device, strict=True):
        np.testing.assert_allclose(mine["loss"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(mine["grad_norm"], ref["grad_norm"], rtol=1e-5)
    hlo = trainer.lower(batches[0]).compile().as_text()
    counts = count_collectives(hlo)
    # Ring attention passes K/V blocks around the context axis (c - 1 permutes of K, V
    # and positions per layer, forward and backward); the all-gather kind gathers them.
    # Either may permute the hidden states once into and out of the balanced order.
    if kind == "ring":
        assert counts["collective-permute"] > 4, counts
    else:
        assert counts["all-gather"] > 0 and counts["collective-permute"] <= 2, counts


def _temp_bytes(axes: dict, n_devices: int, kind: str = "allgather") -> int:
    """Per-device temporary memory of a compiled training step at sequence 2048 (the
    Trainer built from the model's shapes: nothing initialised)."""
    cfg = dataclasses.replace(SMALL, n_layers=1, max_seq_len=2048, attention="xla")
    mesh = jaxpar.make_mesh(axes, devices=jax.devices()[:n_devices])
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", context_attention=kind)
    model = abstract_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), plan)
    trainer = jaxpar.Trainer(model, make_optimizer(small_config().train), plan)
    batch = np.zeros((1, 2049), np.int32)
    return trainer.lower(batch).compile().memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module")
def one_device_temp_bytes():
    """The one-device figure both kinds compare against (compiled once)."""
    return _temp_bytes({"data": 1}, 1)


@pytest.mark.parametrize("kind", ["allgather", "ring"])
def test_activation_memory_per_device_falls_as_one_over_c(kind, one_device_temp_bytes):
    one = one_device_temp_bytes
    four = _temp_bytes({"context": 4}, 4, kind)
    assert four < 0.35 * one, (one, four)
