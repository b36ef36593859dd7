"""Paths as text: JAX key paths and NNX graph paths both become ``a/b/0``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from jaxpar.sharding.paths import key_str, path_str


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Box:
    weight: jax.Array


def test_each_kind_of_jax_key_gives_its_name_or_index():
    assert key_str(DictKey("embed")) == "embed"
    assert key_str(DictKey(3)) == "3"
    assert key_str(SequenceKey(2)) == "2"
    assert key_str(GetAttrKey("weight")) == "weight"
    assert key_str(FlattenedIndexKey(5)) == "5"
    # NNX paths hold plain strings and ints.
    assert key_str("kernel") == "kernel" and key_str(0) == "0"


def test_key_paths_of_a_pytree_are_joined_with_slashes():
    tree = {"a": [1, (2, Box(jnp.ones(2)))], "b": {"c": 4}}
    got = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert got == ["a/0", "a/1/0", "a/1/1/weight", "b/c"]


def test_nnx_state_paths_are_joined_with_slashes():
    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
                           nnx.Linear(3, 1, use_bias=False, rngs=nnx.Rngs(0)))
    got = sorted(path_str(p) for p, _ in nnx.to_flat_state(nnx.state(model)))
    assert got == ["layers/0/bias", "layers/0/kernel", "layers/1/kernel"]
    assert path_str(()) == ""
    assert path_str(("layers", 0, "kernel")) == "layers/0/kernel"
