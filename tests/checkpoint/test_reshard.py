"""Matching saved arrays to a target layout: ``a/b/c`` paths of a pytree and back, what to
read for each target path (its sharding kept), the reshapes between plain stacked layers
``(L, ...)`` and the pipeline's ``(L // S, S, ...)``, and one error listing every path
that does not fit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.checkpoint.reshard import flat_paths, flatten_dict, match, nest
from jaxpar.errors import JaxparError


def test_flat_paths_of_nested_containers_in_flattening_order():
    tree = {"params": {"w": 1, "b": [2, (3, 4)]}, "step": 5}
    flat = flat_paths(tree)
    assert list(flat.items()) == [("params/b/0", 2), ("params/b/1/0", 3),
                                  ("params/b/1/1", 4), ("params/w", 1), ("step", 5)]


def test_flat_paths_drop_a_variables_value_leaf():
    class Two(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
            self.count = nnx.BatchStat(jnp.zeros(()))

    flat = flat_paths(nnx.state(Two()))
    assert sorted(flat) == ["count", "dense/bias", "dense/kernel"]
    assert flat["dense/kernel"].shape == (2, 3)
    assert list(flat_paths({"value": 7})) == ["value"]  # a lone leaf keeps its name


def test_nest_and_flatten_dict_are_inverse():
    flat = {"a/b/c": 1, "a/b/d": 2, "a/e": 3, "f": 4}
    nested = nest(flat)
    assert nested == {"a": {"b": {"c": 1, "d": 2}, "e": 3}, "f": 4}
    assert flatten_dict(nested) == flat
    assert flatten_dict(5) == {"": 5}


def _abstract(shape, sharding=None, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def test_equal_shapes_are_read_as_they_are_wanted(devices):
    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices)
    sharded = NamedSharding(mesh, P("fsdp", None))
    target = {"params/w": _abstract((16, 3), sharded, jnp.bfloat16),
              "step": np.zeros((), np.int32)}
    abstract, fixes = match({"params/w": (16, 3), "step": ()}, target, "checkpoint 4")
    assert fixes == {}
    assert abstract["params/w"].shape == (16, 3) and abstract["params/w"].dtype == jnp.bfloat16
    assert abstract["params/w"].sharding == sharded
    assert abstract["step"].shape == () and abstract["step"].sharding is None


@pytest.mark.parametrize("have, want, stages", [
    ((4, 8, 6), (2, 2, 8, 6), (1, 2)),   # plain -> pipeline over 2 stages
    ((2, 2, 8, 6), (4, 8, 6), (2, 1)),   # pipeline -> plain
    ((1, 4, 8, 6), (2, 2, 8, 6), (4, 2)),  # 4 stages -> 2 stages
])
def test_stacked_layers_are_reshaped_between_layouts(devices, have, want, stages):
    mesh = jax.make_mesh((2, 4), ("stage", "fsdp"), devices=devices,
                         axis_types=(AxisType.Auto,) * 2)  # as jaxpar's meshes default to
    spec = P(None, "stage", "fsdp", None) if len(want) == 4 else P(None, "fsdp", None)
    target_sharding = NamedSharding(mesh, spec)
    abstract, fixes = match({"blocks/w": have}, {"blocks/w": _abstract(want, target_sharding)},
                            "ckpt", stages=stages)
    read = abstract["blocks/w"]
    assert read.shape == have
    # What is read keeps the target's sharding of the dimensions after the layer ones.
    lead = 2 if len(have) == 4 else 1
    assert tuple(read.sharding.spec)[:lead] == (None,) * lead
    assert tuple(read.sharding.spec)[lead:] == ("fsdp", None)
    x = np.arange(np.prod(have), dtype=np.float32).reshape(have)
    out = fixes["blocks/w"](jax.device_put(x, read.sharding))
    np.testing.assert_array_equal(np.asarray(out), x.reshape(want))  # layer i stays layer i
    assert out.sharding == target_sharding


def test_every_mismatch_is_listed_weights_first():
    saved = {"params/a": (2, 3), "params/b": (4,), "opt_state/mu/a": (2, 3),
             "params/gone": (1,)}
    target = {"params/a": _abstract((2, 5)), "params/b": _abstract((4,)),
              "opt_state/mu/a": _abstract((2, 5)), "params/new": _abstract((7,))}
    with pytest.raises(JaxparError) as err:
        match(saved, target, "checkpoint /x/3")
    assert str(err.value) == (
        "checkpoint /x/3 does not match the config: shape mismatch at params/a: checkpoint "
        "(2, 3), expected (2, 5), opt_state/mu/a: checkpoint (2, 3), expected (2, 5); "
        "missing from the checkpoint: params/new; in the checkpoint but not in this model: "
        "params/gone")


def test_long_lists_are_cut_after_ten():
    saved = {f"p{i}": (1,) for i in range(13)}
    target = {f"p{i}": _abstract((2,)) for i in range(13)}
    with pytest.raises(JaxparError, match=r"p9: checkpoint \(1,\), expected \(2,\) and 3 "
                                          r"more$"):
        match(saved, target, "ckpt")


@pytest.mark.parametrize("have, want, stages", [
    ((4, 8, 6), (2, 2, 8, 5), (1, 2)),   # the layer dims fit, the rest does not
    ((6, 8), (2, 2, 8), (1, 2)),         # 6 layers cannot be 2 x 2
    ((4, 8), (2, 2, 8), (1, 1)),         # no stages named: no conversion
    ((4, 8), (2, 3, 8), (1, 2)),         # the second dim is not the stage count
])
def test_other_differences_are_errors(have, want, stages):
    with pytest.raises(JaxparError, match=r"shape mismatch at w: checkpoint"):
        match({"w": have}, {"w": _abstract(want)}, "ckpt", stages=stages)


@pytest.mark.parametrize("diloco_in", ["checkpoint", "config"])
def test_diloco_on_one_side_only_is_named_not_listed(diloco_in):
    """A run resumed with diloco.sync_every toggled: one line naming the knob instead of
    every state path of the replicas."""
    plain = {"params/a": (2,), "opt_state/mu/a": (2,)}
    diloco = {"anchor/a": (2,), "momentum/a": (2,), "replicas/params/a": (2, 2),
              "replicas/opt_state/mu/a": (2, 2)}
    saved, target = (diloco, plain) if diloco_in == "checkpoint" else (plain, diloco)
    with pytest.raises(JaxparError) as err:
        match(saved, {k: _abstract(v) for k, v in target.items()}, "checkpoint /x/3")
    assert "resume with the diloco.sync_every the run was saved with" in str(err.value)
    assert "replicas/params" not in str(err.value)
