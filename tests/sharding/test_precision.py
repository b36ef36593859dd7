"""Precision policies and dynamic loss scaling."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.config.assembly import build_trainer
from jaxpar.sharding.precision import DynamicLossScale, Policy
from tests.helpers import loader, small_config


def test_policy_strings():
    long = Policy.parse("params=float32,compute=bfloat16,output=float32")
    assert long == Policy.parse("p=f32,c=bf16,o=f32")
    assert long.mixed and not long.needs_loss_scaling
    assert Policy.parse("c=f16").needs_loss_scaling
    assert str(long) == "params=float32,compute=bfloat16,output=float32"
    with pytest.raises(jaxpar.JaxparError, match="bad precision policy part 'compute=fp8'"):
        Policy.parse("compute=fp8")


def test_bf16_training_tracks_f32():
    def run(policy):
        t = build_trainer(small_config("mesh.data=8", f"plan.precision={policy}",
                                                    "train.lr=1e-2"))
        return t, [t.step(loader().batch(i))["loss"] for i in range(8)]

    t32, f32 = run("p=f32,c=f32,o=f32")
    tbf, bf16 = run("p=f32,c=bf16,o=f32")
    np.testing.assert_allclose(bf16, f32, rtol=2e-2)
    assert bf16[-1] < bf16[0] - 0.2  # it learns
    # f32 master weights, bf16 working copy.
    assert tbf.state["master"]["embed"].get_value().dtype == jnp.float32
    assert tbf.state["params"]["embed"].get_value().dtype == jnp.bfloat16


class Poisoned(nnx.Module):
    """A tiny regression model whose loss overflows float16 on a marked batch."""

    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(0.1), ("embed", "mlp"))
        self.layer = nnx.Linear(8, 8, kernel_init=init, use_bias=False, rngs=rngs)


def poisoned_loss(model, batch):
    dtype = model.layer.kernel[...].dtype
    # Token 255 in the first position marks a batch whose activations overflow float16.
    boost = jnp.where(batch[0, 0] == 255, 6e4, 1.0).astype(dtype)
    x = batch[:, :8].astype(dtype) / 256.0 * boost
    return jnp.mean(model.layer(x).astype(jnp.float32) ** 2)


def test_fp16_overflow_skips_exactly_that_step_and_recovers(devices):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 8}),
                                   precision=Policy.parse("p=f32,c=f16,o=f32"))
    model = jaxpar.init_sharded(lambda: Poisoned(nnx.Rngs(0)), plan)
    trainer = jaxpar.Trainer(model, optax.sgd(0.1), plan, loss_fn=poisoned_loss)
    batches = [np.full((8, 9), 7 + i, np.int32) for i in range(5)]
    batches[2][0, 0] = 255
    scale0 = float(trainer.state["loss_scale"]["scale"])
    history, masters = [], []
    for b in batches:
        masters.append(np.asarray(trainer.state["master"]["layer"]["kernel"].get_value()))
        history.append(trainer.step(b))
    assert [m["skipped"] for m in history] == [0, 0, 1, 0, 0]
    assert [m["loss_scale"] for m in history] == [scale0, scale0, scale0, scale0 / 2, scale0 / 2]
    after_skip = np.asarray(trainer.state["master"]["layer"]["kernel"].get_value())
    np.testing.assert_array_equal(masters[3], masters[2])  # the skipped step changed nothing
    assert not np.array_equal(after_skip, masters[3])       # and training resumed
    assert trainer.step_count == 5


def test_loss_scale_grows_after_period():
    ls = DynamicLossScale(initial=4.0, period=2)
    s = ls.init()
    s = ls.adjust(s, jnp.asarray(True))
    s = ls.adjust(s, jnp.asarray(True))
    assert float(s["scale"]) == 8.0 and int(s["good_steps"]) == 0
    s = ls.adjust(s, jnp.asarray(False))
    assert float(s["scale"]) == 4.0
