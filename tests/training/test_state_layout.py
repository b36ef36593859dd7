"""Where a Trainer's state lives under each ZeRO stage (jaxpar.training.state_layout):
the weights, the optimizer state, and the gradients and update the step makes."""

import jax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import Transformer
from jaxpar.training.optimizer import make_optimizer
from jaxpar.training.state_layout import state_layout
from tests.helpers import SMALL, small_config


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_splits_what_it_says_over_data(devices, stage):
    """ZeRO-1 splits the optimizer state (and so the update) over ``data``, ZeRO-2 the
    gradients too, ZeRO-3 the weights as well; below, each stays as the rules place it."""
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 4, "tensor": 2}), "fsdp_tp",
                                   zero_stage=stage)
    model = jaxpar.init_sharded(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)), plan)
    params, frozen = nnx.state(model, nnx.Param), nnx.state(model, ...)
    layout = state_layout(plan, params, frozen, make_optimizer(small_config().train),
                          plan.precision, stores_copy=False, loss_scaled=False)

    def over_data(tree) -> bool:
        sharding = tree["blocks"]["mlp"]["w_up"]["kernel"]
        return "data" in str(getattr(sharding, "value", sharding).spec)

    assert over_data(layout.update) == (stage >= 1)
    assert over_data(layout.grads) == (stage >= 2)
    assert over_data(layout.state["params"]) == (stage >= 3)
    assert layout.state["step"] == plan.replicated
    assert jax.tree.structure(layout.grads) == jax.tree.structure(layout.update)
