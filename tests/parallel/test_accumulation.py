"""Gradient accumulation with the data-parallel reduction once a step
(jaxpar.parallel.accumulation): the same training as one device, one all-reduce over
``data`` in the compiled step where GSPMD ran one a microbatch, and the planner's count of
every reduction, looped or not, against the compiled program's."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis import targets
from jaxpar.analysis.hlo import collective_table
from jaxpar.analysis.inspection import compile_step, step_report
from jaxpar.models import Transformer
from jaxpar.parallel import accumulation
from jaxpar.training.optimizer import make_optimizer
from tests.helpers import SMALL, loader, one_device, small_config

STEPS = 3


def _trainer(mesh_axes: dict[str, int], microbatches: int, devices=None) -> jaxpar.Trainer:
    mesh = jaxpar.make_mesh(mesh_axes, devices=devices)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp").replace(microbatches=microbatches)
    model = jaxpar.init_sharded(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)), plan)
    return jaxpar.Trainer(model, make_optimizer(small_config().train), plan)


def _weights(trainer: jaxpar.Trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]


def _runs(hlo: str, mesh) -> dict[tuple[str, tuple[str, ...]], int]:
    return {(r["kind"], tuple(r["axes"])): r["executions"] for r in collective_table(hlo, mesh)}


def test_data_x_fsdp_x_tensor_accumulated_by_hand_trains_as_one_device(devices):
    """Two microbatches on data 2 x fsdp 2 x tensor 2: the losses and weights of one
    device's unaccumulated steps, and in the compiled step one all-reduce over ``data``
    (after the loop) where FSDP's reductions still run at each microbatch."""
    data = loader()
    reference = _trainer({"data": 1}, 1, devices=one_device())
    trainer = _trainer({"data": 2, "fsdp": 2, "tensor": 2}, 2)
    assert accumulation.local_axes(trainer.plan, 16, 2, trainer.state["frozen"]) == ("data",)
    for i in range(STEPS):
        a, b = reference.step(data.batch(i)), trainer.step(data.batch(i))
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for want, got in zip(_weights(reference), _weights(trainer), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    runs = _runs(trainer.lower(data.batch(0)).compile().as_text(), trainer.plan.mesh)
    assert runs[("all-reduce", ("data",))] == 1
    looped = sum(n for (kind, axes), n in runs.items()
                 if kind in ("all-reduce", "reduce-scatter") and axes == ("fsdp",))
    assert looped >= 2 * SMALL.n_layers  # each microbatch's layers, reduced over fsdp


# (overrides, the axes reduced once a step): accumulated by hand over data, or not where
# ZeRO-2 keeps only its gradient shard (every microbatch reduces, as GSPMD places it).
CASES = {
    "dp_microbatches4": ("mesh.data=8 plan.rules=dp plan.microbatches=4", {"data"}),
    "data2_fsdp4_microbatches2": ("mesh.data=2 mesh.fsdp=4 plan.microbatches=2", {"data"}),
    "zero2_data4_tensor2_microbatches2": (
        "mesh.data=4 mesh.tensor=2 plan.zero_stage=2 plan.microbatches=2", set()),
}


@pytest.mark.parametrize("name", CASES)
def test_the_planner_counts_each_reduction_as_the_step_runs_it(devices, name):
    """Per kind and axes, the bytes a device receives in the compiled step (each HLO
    instruction times its loop's trips) within 1% of the planner's, reductions inside the
    accumulation loop counted at every microbatch and those after it once (configs/tiny.yaml:
    at its width XLA:CPU runs FSDP's collectives as the planner lists them)."""
    overrides, once = CASES[name]
    step = compile_step(jaxpar.load_config("configs/tiny.yaml", overrides.split()))
    rows = step_report(step)["comparison"]["collectives"]
    reductions = [r for r in rows if r["kind"] in ("all-reduce", "reduce-scatter")
                  and r["wire_bytes_per_step"] and r["wire_bytes_per_step"] > 64 << 10]
    assert reductions
    for r in reductions:
        assert r["step_ratio"] == pytest.approx(1.0, abs=0.01), r
        if set(r["axes"]) & {"data"}:
            assert (r["executions"] == 1) == bool(once), r


def test_zero2_sums_each_microbatch_into_its_gradient_shard(devices):
    """ZeRO-2 on data 4 x tensor 2, two microbatches: the accumulation loop carries each
    weight's f32 gradient sum as its ZeRO shard (the gradients' layout, split over
    ``data`` as well), the layout the planner counts; the step's weights stay whole over
    ``data``."""
    step = compile_step(jaxpar.load_config("configs/tiny.yaml", [
        "mesh.data=4", "mesh.tensor=2", "plan.zero_stage=2", "plan.microbatches=2"]))
    trainer = step.run.trainer
    params = jax.tree.leaves(trainer.state["params"])
    shards = [s.shard_shape(p.shape) for p, s in
              zip(params, jax.tree.leaves(trainer.grad_shardings), strict=True)]
    stored = [p.sharding.shard_shape(p.shape) for p in params]
    loops = [line.split(" while(")[0] for line in step.compiled.as_text().splitlines()
             if " while(" in line]
    carried = {m for line in loops for m in re.findall(r"f32\[([0-9,]+)\]", line)}
    split = [(a, b) for a, b in zip(shards, stored, strict=True) if a != b]
    assert split  # the weights ZeRO-2 splits further
    for shard, _ in split:
        assert ",".join(map(str, shard)) in carried, shard


@pytest.mark.skipif(targets.tpu_compiler_missing() is not None, reason="no libtpu")
def test_splash_attention_runs_inside_the_loop_on_a_tpu():
    """On the TPU compiler, bf16 with splash attention (a shard_map of its own, nested in
    the loop's over ``data``): the gradients reduced once a step, in bf16, as the planner
    counts them."""
    config = jaxpar.load_config("configs/tiny.yaml", [
        "mesh.data=4", "plan.microbatches=2", "model.attention=splash", "model.head_dim=128",
        "model.n_heads=2", "model.n_kv_heads=1",
        "plan.precision=params=float32,compute=bfloat16,output=float32"])
    step = compile_step(config, targets.tpu_target("tpu-v5e:2x2"))
    assert "splash" in step.compiled.as_text()
    rows = [r for r in step_report(step)["comparison"]["collectives"]
            if r["kind"] == "all-reduce" and r["axes"] == ["data"]]
    assert len(rows) == 1 and rows[0]["executions"] == rows[0]["count"]  # none in a loop
    assert rows[0]["step_ratio"] == pytest.approx(1.0, abs=0.01)
