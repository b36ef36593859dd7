"""Module surgery: one step down a graph path, and replacing a module found by its path."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.tree_util import DictKey

import jaxpar
from jaxpar.adapters.surgery import get_child, replace_module, set_child
from jaxpar.sharding.paths import path_str


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.head = nnx.Linear(3, 2, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(3, 3, rngs=rngs), nnx.Linear(3, 3, rngs=rngs)])
        self.named = nnx.Dict({"up": nnx.Linear(3, 3, rngs=rngs)})

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.named["up"](x))


def zero_linear(n_in: int, n_out: int) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))


def test_get_child_by_attribute_index_dict_key_and_key_object():
    model = Model(nnx.Rngs(0))
    assert get_child(model, "head") is model.head
    assert get_child(model.blocks, 1) is model.blocks[1]
    assert get_child(model.named, "up") is model.named["up"]
    assert get_child({"up": model.head}, DictKey("up")) is model.head
    assert get_child(model, DictKey("blocks")) is model.blocks


def test_set_child_by_attribute_index_and_key():
    model = Model(nnx.Rngs(0))
    new = [zero_linear(3, 2), zero_linear(3, 3), zero_linear(3, 3), zero_linear(3, 3)]
    set_child(model, "head", new[0])
    set_child(model.blocks, 0, new[1])
    set_child(model.named, "up", new[2])
    plain = {"a": 1}
    set_child(plain, DictKey("a"), new[3])
    assert model.head is new[0] and model.blocks[0] is new[1] and model.named["up"] is new[2]
    assert plain == {"a": new[3]}


def test_replace_module_at_every_path_nnx_reports():
    model = Model(nnx.Rngs(0))
    x = jnp.ones((2, 3))
    paths = {path_str(p): tuple(p) for p, m in nnx.iter_graph(model)
             if isinstance(m, nnx.Linear)}
    assert set(paths) == {"head", "blocks/0", "blocks/1", "named/up"}
    # A zero kernel in the middle leaves only the biases flowing on.
    replace_module(model, paths["blocks/1"], zero_linear(3, 3))
    bias = np.asarray(model.blocks[1].bias[...])
    up, head = model.named["up"], model.head
    want = (bias @ np.asarray(up.kernel[...]) + np.asarray(up.bias[...])) @ np.asarray(
        head.kernel[...]) + np.asarray(head.bias[...])
    np.testing.assert_allclose(model(x), np.broadcast_to(want, (2, 2)), rtol=1e-5, atol=1e-6)
    replace_module(model, paths["named/up"], zero_linear(3, 3))
    replace_module(model, paths["head"], zero_linear(3, 2))
    np.testing.assert_array_equal(model(x), 0.0)
    # The graph sees the new modules at the old paths.
    now = {path_str(p): m for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Linear)}
    assert now["head"] is model.head and now["named/up"] is model.named["up"]
    assert np.all(np.asarray(nnx.state(model)["blocks"][1]["kernel"].get_value()) == 0)


def test_the_root_cannot_be_replaced():
    with pytest.raises(jaxpar.JaxparError, match="cannot replace the root module"):
        replace_module(Model(nnx.Rngs(0)), (), zero_linear(3, 3))

