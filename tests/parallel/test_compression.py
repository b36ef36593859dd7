"""plan.compress_gradients=sign: one-bit data-parallel gradient averaging with error
feedback, against the plain data-parallel run and read from the compiled step."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis.hlo import collective_table
from jaxpar.checkpoint.checkpointer import Checkpointer
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.parallel.compression import pack_signs, unpack_signs
from jaxpar.sharding.partitioning import abstract_sharded
from jaxpar.sharding.rules import Rules

CFG = TransformerConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)
MESH = {"data": 2, "fsdp": 4}


def batches(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, CFG.vocab_size, (16, 17)).astype(np.int32) for _ in range(n)]


def trainer(mode: str = "none", warmup: int = 0, **knobs) -> jaxpar.Trainer:
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(MESH), "fsdp_tp", compress_gradients=mode,
                                   compress_warmup=warmup, **knobs)
    model = jaxpar.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan)
    return jaxpar.Trainer(model, optax.adam(1e-2), plan)


def test_signs_pack_eight_to_a_byte_and_back():
    x = np.random.default_rng(1).normal(size=(3, 7, 5)).astype(np.float32)
    packed = pack_signs(x)
    assert packed.dtype == np.uint8 and packed.shape == (14,)  # 105 bits -> 14 bytes
    np.testing.assert_array_equal(np.asarray(unpack_signs(packed, x.shape)),
                                  np.where(x >= 0, 1.0, -1.0))


@functools.cache
def plain_losses() -> list[float]:
    step = trainer()
    return [float(step.step(b)["loss"]) for b in batches(3)]


def test_warm_up_steps_are_exact(devices):
    step = trainer("sign", warmup=10)
    got = [float(step.step(b)["loss"]) for b in batches(3)]
    np.testing.assert_allclose(got, plain_losses(), rtol=1e-6)


@pytest.fixture(scope="module")
def plain_and_packed(devices):
    """The plain and the sign-compressed trainers, built once for the two tests below:
    test_the_step_sends_signs_not_gradients lowers them (shapes only, whatever they have
    trained), test_compressed_training_learns_and_keeps_its_error trains them (the only
    test that steps them)."""
    return trainer(), trainer("sign")


def test_the_step_sends_signs_not_gradients(plain_and_packed):
    """The compressed reduction all-gathers uint8 signs (and a float per 256 values) over
    data: under 20% of the bytes the plain step all-reduces over the data axes for its
    gradients (which it reduces over fsdp first)."""
    plain, packed = plain_and_packed
    batch = batches(1)[0]
    text = packed.lower(batch).compile().as_text()
    gathers = [line for line in text.splitlines() if " all-gather(" in line and "u8[" in line]
    assert gathers
    rows = {(r["kind"], tuple(r["axes"])): r["bytes_per_device"]
            for r in collective_table(text, packed.plan.mesh)}
    plain_rows = collective_table(plain.lower(batch).compile().as_text(), plain.plan.mesh)
    reduced = sum(r["bytes_per_device"] for r in plain_rows
                  if r["kind"] == "all-reduce" and "data" in r["axes"])
    assert rows[("all-gather", ("data",))] < 0.2 * reduced


def test_compressed_training_learns_and_keeps_its_error(plain_and_packed):
    """Ten Adam steps on one batch: the loss falls at least 60% as far as uncompressed;
    the error buffers (one per data device) are not zero."""
    batch = batches(1)[0]
    plain, packed = plain_and_packed
    want = [float(plain.step(batch)["loss"]) for _ in range(10)]
    got = [float(packed.step(batch)["loss"]) for _ in range(10)]
    assert got[0] - got[-1] > 0.6 * (want[0] - want[-1]) > 0
    error = packed.state["grad_error"]["blocks"]["mlp"]["w_up"]["kernel"].get_value()
    assert error.shape[0] == 2 and float(np.abs(np.asarray(error)).max()) > 0


def test_bf16_compute_runs_both_branches(devices):
    """With bf16 compute (the exact warm-up's average taken in float32: XLA:CPU aborts on
    a bf16 all-reduce inside the shard_map), a warm-up step and a compressed step run."""
    from jaxpar.sharding.precision import Policy

    step = trainer("sign", warmup=1, precision=Policy.parse("p=f32,c=bf16,o=f32"))
    losses = [float(step.step(b)["loss"]) for b in batches(2)]
    assert all(np.isfinite(losses))


def test_resume_with_the_error_buffers_is_exact(devices, tmp_path):
    """Saved after two steps (the error buffers not zero) and restored into a new trainer,
    the next two steps' losses are the uninterrupted run's, bit for bit."""
    data = batches(4)
    whole = trainer("sign")
    want = [float(whole.step(b)["loss"]) for b in data[:2]]
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(whole, force=True)
    error = whole.state["grad_error"]["blocks"]["mlp"]["w_up"]["kernel"].get_value()
    assert float(np.abs(np.asarray(error)).max()) > 0
    want += [float(whole.step(b)["loss"]) for b in data[2:]]
    resumed = trainer("sign")
    with Checkpointer(tmp_path) as ckpt:
        ckpt.restore(resumed)
    got = [float(resumed.step(b)["loss"]) for b in data[2:]]
    assert got == want[2:]


@pytest.mark.parametrize("axes,knobs,message", [
    ({"fsdp": 8}, {}, "give the mesh data >= 2"),
    (MESH, {"zero_stage": 1}, "needs plan.zero_stage=0 and plan.microbatches=1"),
    ({"data": 8}, {"param_rules": Rules([("embed", "data"), *jaxpar.Plan.from_preset(
        jaxpar.make_mesh({"data": 8}), "dp").param_rules.rules])},
     "needs the weights whole over the data axis; the rules split"),
])
def test_plans_it_cannot_run_get_one_line(devices, axes, knobs, message):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), "fsdp", compress_gradients="sign")
    plan = dataclasses.replace(plan, **knobs)
    model = abstract_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan)  # shapes
    with pytest.raises(jaxpar.JaxparError, match=message):
        jaxpar.Trainer(model, optax.adam(1e-2), plan)
