"""Mixture-of-experts models in training: expert parallelism and the features around it.

The reference decoder with ``model.n_experts`` trained on meshes with an ``expert`` axis
equals the same model on one device (no token is dropped at this capacity); the compiled
step exchanges tokens all-to-all over ``expert`` and never gathers the expert dimension of
a weight; ZeRO, LoRA on the experts and checkpoint resharding keep working. (The CLI's
run on expert 4 x fsdp 2 and its router metrics: docs/guides/long-context-moe.md.)
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.adapters import lora
from jaxpar.analysis.hlo import collective_table, group_axes, parse_collectives
from jaxpar.checkpoint.checkpointer import Checkpointer
from jaxpar.checkpoint.reshard import flat_paths
from jaxpar.models import Transformer
from jaxpar.training.optimizer import make_optimizer
from tests.helpers import SMALL, loader, small_config

MOE = dataclasses.replace(SMALL, n_experts=4, experts_per_token=2, expert_d_ff=24,
                          expert_capacity=2.0)
"""Capacity 2.0 with 4 experts and top-2: every expert can take every token of a sequence,
so nothing is dropped and the sharded run must equal one device exactly. The expert width
24 (12 under 2-way tensor parallelism) appears in no other tensor."""
STEPS = 2


def build(axes: dict, *, zero: int = 0, devices=None, adapters: bool = False) -> jaxpar.Trainer:
    mesh = jaxpar.make_mesh(axes, devices=devices)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", zero_stage=zero)

    def make():
        model = Transformer(MOE, rngs=nnx.Rngs(0))
        if adapters:
            lora.apply(model, rank=2, alpha=4.0, rngs=nnx.Rngs(1))
        return model

    model = jaxpar.init_sharded(make, plan)
    trainable = nnx.LoRAParam if adapters else nnx.Param
    return jaxpar.Trainer(model, make_optimizer(small_config().train), plan,
                          trainable=trainable)


@pytest.fixture(scope="module")
def batches():
    return [loader().batch(i) for i in range(STEPS)]


@pytest.fixture(scope="module")
def one_device(batches):
    trainer = build({"data": 1}, devices=jax.devices()[:1])
    return trainer, [trainer.step(b) for b in batches]


def _assert_same_metrics(got: list[dict], ref: list[dict]) -> None:
    for mine, theirs in zip(got, ref, strict=True):
        assert set(mine) == set(theirs)
        for key in ("loss", "grad_norm", "moe_load_balance", "moe_router_z", "moe_aux_loss"):
            np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-5, err_msg=key)
        assert mine["moe_dropped"] == 0.0


@pytest.mark.parametrize("axes, zero", [
    ({"expert": 4, "fsdp": 2}, 0),
    ({"data": 2, "expert": 2, "tensor": 2}, 1),
])
def test_expert_parallel_training_equals_one_device(batches, one_device, axes, zero, capfd,
                                                    fresh_compile):
    trainer = build(axes, zero=zero)
    w_gate = trainer.state["params"]["blocks"]["mlp"]["w_gate"]["kernel"]
    assert w_gate.sharding.spec[1] == "expert"  # (layers, expert, embed, mlp)
    capfd.readouterr()
    got = [trainer.step(b) for b in batches]
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    _assert_same_metrics(got, one_device[1])
    # The router's statistics are the model's, not constants: balanced-ish, not uniform.
    assert 1.0 < got[0]["moe_load_balance"] < MOE.n_experts / MOE.experts_per_token
    hlo = trainer.lower(batches[0]).compile().as_text()
    table = collective_table(hlo, trainer.plan.mesh)
    kinds = {(r["kind"], tuple(r["axes"])) for r in table}
    assert ("all-to-all", ("expert",)) in kinds, kinds
    assert not _expert_dimension_gathers(hlo, trainer.plan.mesh)


def _expert_dimension_gathers(hlo: str, mesh) -> list[str]:
    """All-gathers over the expert axis that assemble the expert dimension of an expert
    weight (or of the experts' hidden activations): the gathered dimension has all
    ``n_experts`` entries and the result carries the expert width."""
    found = []
    for c in parse_collectives(hlo):
        if c.kind != "all-gather" or "expert" not in group_axes(c.groups, mesh):
            continue
        shape = [int(d) for d in re.search(r"\[([\d,]+)\]", c.line).group(1).split(",")]
        gathered = int(re.search(r"dimensions=\{(\d+)", c.line).group(1))
        if shape[gathered] == MOE.n_experts and {24, 12} & set(shape):
            found.append(c.line)
    return found


def test_lora_on_experts_trains_per_expert_adapters(batches):
    trainer = build({"expert": 4, "fsdp": 2}, adapters=True)
    ref = build({"data": 1}, devices=jax.devices()[:1], adapters=True)
    adapters = {p: v for p, v in flat_paths(trainer.state["params"]).items() if "lora" in p}
    # One adapter per expert: A (layers, expert, embed, rank), B (layers, expert, rank, mlp).
    assert adapters["blocks/mlp/w_gate/lora_a"].shape == (2, 4, 64, 2)
    assert adapters["blocks/mlp/w_gate/lora_b"].shape == (2, 4, 2, 24)
    assert adapters["blocks/mlp/w_gate/lora_a"].sharding.spec[1] == "expert"
    got = [trainer.step(b) for b in batches]
    _assert_same_metrics(got, [ref.step(b) for b in batches])
    # The trained expert adapters change the model, and merging them keeps its logits.
    model = trainer.model
    delta = np.asarray(model.blocks.mlp.w_down.weight_delta())
    assert np.abs(delta).max() > 0  # B moved from zero: the experts' adapters trained
    tokens = np.asarray(batches[0])[:2, :-1]
    with trainer.plan.activate():
        before = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
        merged = lora.merge(model, plan=trainer.plan)
        after = np.asarray(nnx.jit(lambda m, t: m(t))(merged, tokens))
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)


def test_checkpoint_reshards_between_expert_layouts(tmp_path, batches, one_device):
    source = build({"expert": 4, "fsdp": 2})
    source.step(batches[0])
    with Checkpointer(tmp_path / "ckpt", every=1) as ckpt:
        ckpt.save(source)
    want = {p: np.asarray(v) for p, v in flat_paths(source.state).items()}
    # The one-device target is the one_device fixture's trainer (its steps are taken: the
    # restore overwrites its state and step count, so the loss below proves the restore).
    for target in (build({"expert": 2, "tensor": 2}, devices=jax.devices()[:4]),
                   one_device[0]):
        with Checkpointer(tmp_path / "ckpt") as ckpt:
            ckpt.restore(target)
        got = {p: np.asarray(v) for p, v in flat_paths(target.state).items()}
        assert got.keys() == want.keys()
        for path, value in want.items():
            np.testing.assert_array_equal(got[path], value, err_msg=path)
        # and it trains on as the one-device run did
        np.testing.assert_allclose(target.step(batches[1])["loss"], one_device[1][1]["loss"],
                                   rtol=1e-5)
