import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.models import Transformer
from jaxpar.sharding.partitioning import linen_shardings, param_table
from tests.helpers import SMALL

# (mesh, preset) -> expected PartitionSpec of a few weights.
CASES = {
    "dp": ({"data": 8}, "dp", P(None, None, None, None), P(None, None, None)),
    "fsdp": ({"data": 1, "fsdp": 8}, "fsdp", P(None, "fsdp", None, None), P(None, None, "fsdp")),
    "tp": ({"data": 2, "tensor": 4}, "tp", P(None, None, "tensor", None),
           P(None, "tensor", None)),
    "fsdp_tp": ({"data": 1, "fsdp": 4, "tensor": 2}, "fsdp_tp",
                P(None, "fsdp", "tensor", None), P(None, "tensor", "fsdp")),
}


@pytest.mark.parametrize("name", CASES)
def test_every_weight_is_split_as_its_rules_say(devices, name):
    axes, preset, wq_spec, down_spec = CASES[name]
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), preset)
    model = jaxpar.init_sharded(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)), plan)
    state = nnx.state(model)
    wq = state["blocks"]["attn"]["wq"]["kernel"].get_value()
    down = state["blocks"]["mlp"]["w_down"]["kernel"].get_value()
    assert wq.sharding.spec == wq_spec
    assert down.sharding.spec == down_spec
    # Every array's per-device shard shape is what its PartitionSpec implies.
    for row, (_, var) in zip(param_table(plan, state), nnx.to_flat_state(state), strict=True):
        value = var.get_value()
        assert value.sharding.spec == row["spec"], row["path"]
        for shard in value.addressable_shards:
            assert shard.data.shape == row["shard_shape"], row["path"]


def test_init_sharded_matches_unsharded_init(devices):
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}))
    sharded = nnx.state(jaxpar.init_sharded(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)), plan))
    with plan.activate():
        plain = nnx.state(Transformer(SMALL, rngs=nnx.Rngs(0)))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain), strict=True):
        # Same random numbers; jit may fuse the scaling differently (1 ulp).
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)


def test_linen_logical_partitioning(devices):
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                             ("embed", "mlp")), (16, 32))
            return x @ w

    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}))
    module, x = Dense(), np.ones((8, 16), np.float32)
    abstract = jax.eval_shape(module.init, jax.random.key(0), x)
    shardings = linen_shardings(plan, abstract)
    variables = jax.jit(module.init, out_shardings=shardings)(jax.random.key(0), x)
    w = variables["params"]["w"].value
    assert w.sharding.spec == P("fsdp", "tensor")
    assert w.addressable_shards[0].data.shape == (4, 16)
