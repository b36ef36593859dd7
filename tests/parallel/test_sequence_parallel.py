"""Megatron sequence parallelism (``Plan(sequence_parallel=True)``): a layout only.

The residual stream between blocks is split along the sequence over the tensor axis, so
each tensor-parallel all-reduce of a block becomes a reduce-scatter (into the split
residual) and an all-gather (before the next column-parallel matmul), with the same
numbers. Checked in the compiled HLO and against the run without it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.analysis.hlo import collective_table, count_collectives, count_reduce_scatters
from tests.helpers import block_forward_hlo, loader, make_trainer


def _block_hlo(capfd, sequence_parallel: bool) -> tuple[str, jaxpar.Plan]:
    """Compiled forward of one decoder block under Megatron TP over 4 devices."""
    mesh = jaxpar.make_mesh({"data": 2, "tensor": 4})
    plan = jaxpar.Plan.from_preset(mesh, "tp", sequence_parallel=sequence_parallel)
    capfd.readouterr()
    hlo = block_forward_hlo(plan)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    return hlo, plan


def test_block_all_reduces_become_reduce_scatter_and_all_gather(capfd, fresh_compile):
    plain, _ = _block_hlo(capfd, False)
    assert count_collectives(plain) == {"all-reduce": 2}
    assert count_reduce_scatters(plain) == 0
    hlo, plan = _block_hlo(capfd, True)
    assert plan.act_spec(("batch", "residual_seq", "embed")) == jax.sharding.PartitionSpec(
        "data", "tensor", None)
    counts = count_collectives(hlo)
    # Attention and MLP: each all-reduce turns into a reduce-scatter onto the split
    # residual plus an all-gather of the normed input before the next matmul.
    assert count_reduce_scatters(hlo) == 2, hlo
    assert counts["all-gather"] == 2 and counts.get("all-to-all", 0) == 0, counts
    assert counts["all-reduce"] + counts.get("reduce-scatter", 0) == 2, counts
    assert {tuple(r["axes"]) for r in collective_table(hlo, plan.mesh)} == {("tensor",)}


@pytest.fixture(scope="module")
def losses_by_layout():
    """Three steps on one device, on data 2 x tensor 4, and the same with sequence
    parallelism."""
    batches = [loader().batch(i) for i in range(3)]
    out = {}
    for name, axes, sp in [("one", {"data": 1}, False), ("tp", {"data": 2, "tensor": 4}, False),
                           ("tp_sp", {"data": 2, "tensor": 4}, True)]:
        devices = jax.devices()[:1] if name == "one" else None
        trainer = make_trainer(axes, devices=devices)
        if sp:
            trainer = jaxpar.Trainer(trainer.model, trainer.optimizer,
                                     trainer.plan.replace(sequence_parallel=True))
        out[name] = (trainer, [trainer.step(b)["loss"] for b in batches])
    return out


def test_losses_equal_with_and_without_sequence_parallelism(losses_by_layout):
    one = losses_by_layout["one"][1]
    np.testing.assert_allclose(losses_by_layout["tp"][1], one, rtol=1e-5)
    np.testing.assert_allclose(losses_by_layout["tp_sp"][1], one, rtol=1e-5)
    assert losses_by_layout["tp_sp"][0].plan.sequence_parallel


def test_training_step_uses_reduce_scatter_over_tensor(losses_by_layout):
    plain = losses_by_layout["tp"][0].lower(loader().batch(0)).compile().as_text()
    trainer = losses_by_layout["tp_sp"][0]
    hlo = trainer.lower(loader().batch(0)).compile().as_text()
    kinds = {(r["kind"], tuple(r["axes"])) for r in collective_table(hlo, trainer.plan.mesh)}
    assert ("all-gather", ("tensor",)) in kinds
    assert count_reduce_scatters(hlo) > count_reduce_scatters(plain)
