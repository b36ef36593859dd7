"""The Plan: its knobs (declared once with ``knob()``, checked by ``check_knob``), its rules
and shardings, and the context that makes it current (``activate``, ``current_plan``,
``constrain``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.sharding.plan import (
    Knob,
    Plan,
    batch_names,
    check_knob,
    constrain,
    current_plan,
    knob,
    knobs,
)
from jaxpar.sharding.precision import Policy
from jaxpar.sharding.rules import Rules

KNOB_NAMES = ["precision", "zero_stage", "remat", "remat_blocks", "scan_blocks", "microbatches",
              "annotations", "layouts", "sequence_parallel", "context_attention",
              "context_balance", "offload_optimizer", "host_update", "update_chunk",
              "offload_params", "quantize", "quantize_target",
              "quantize_exclude", "quantize_gather", "quantize_reduce", "hpz", "vocab_over_fsdp",
              "compress_gradients", "compress_warmup", "weight_copy", "grad_dtype"]
ACT_RULES = Rules([("batch", "data"), ("seq", None), ("embed", "tensor")])
PARAM_RULES = Rules([("embed", "tensor"), ("mlp", "data")])


@pytest.fixture(scope="module")
def mesh(devices):
    return jaxpar.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


@pytest.fixture(scope="module")
def small(devices):
    """A plan with hand-written rules on a data=4 x tensor=2 mesh."""
    return Plan(jaxpar.make_mesh({"data": 4, "tensor": 2}), PARAM_RULES, ACT_RULES)


# --- knobs ----------------------------------------------------------------------------------


def test_knob_problem_says_what_is_allowed():
    assert Knob(choices=(1, 2)).problem(2) is None
    assert Knob(choices=(1, 2)).problem(3) == "choose one of [1, 2]"
    even = Knob(check=lambda v: v % 2 == 0, valid="must be even")
    assert even.problem(4) is None and even.problem(3) == "must be even"
    assert Knob().problem(object()) is None


def test_knob_is_a_field_with_a_default_and_what_it_allows():
    @dataclasses.dataclass(frozen=True)
    class Demo:
        level: int = knob(2, choices=(1, 2, 3))

    (field,) = dataclasses.fields(Demo)
    assert Demo().level == 2
    assert field.metadata["knob"] == Knob(choices=(1, 2, 3))


def test_knobs_are_every_plan_field_but_the_mesh_and_rules():
    assert [f.name for f in knobs()] == KNOB_NAMES
    others = [f.name for f in dataclasses.fields(Plan) if f.name not in KNOB_NAMES]
    assert others == ["mesh", "param_rules", "act_rules"]
    assert all(isinstance(f.metadata["knob"], Knob) for f in knobs())


def test_check_knob_parses_precision_text():
    policy = check_knob("precision", "p=f32,c=bf16,o=f32")
    assert (policy.params, policy.compute, policy.output) == (jnp.float32, jnp.bfloat16,
                                                              jnp.float32)
    given = Policy(compute=jnp.float16)
    assert check_knob("precision", given) is given
    assert check_knob("zero_stage", 3) == 3
    assert check_knob("layouts", "auto") == "auto" and check_knob("layouts", []) == []


@pytest.mark.parametrize("name,value,key,message", [
    ("precision", "c=fp8", "plan.precision",
     "plan.precision: bad precision policy part 'c=fp8'"),
    ("zero_stage", 4, None, "zero_stage=4: choose one of [0, 1, 2, 3]"),
    ("remat", "sometimes", "plan.remat",
     "plan.remat='sometimes': choose one of ['dots_saveable', 'dots_with_no_batch_dims"),
    ("microbatches", 0, "plan.microbatches", "plan.microbatches=0: must be at least 1"),
    ("layouts", "blocks", None, "layouts='blocks': give a list of [target, [names]] pairs"),
    ("context_attention", "star", None,
     "context_attention='star': choose one of ['allgather', 'ring']"),
])
def test_check_knob_names_the_key_the_value_and_what_is_valid(name, value, key, message):
    with pytest.raises(jaxpar.JaxparError) as err:
        check_knob(name, value, key)
    assert str(err.value).startswith(message), str(err.value)


# --- building a plan --------------------------------------------------------------------------


def test_post_init_checks_and_normalises_the_knobs(mesh):
    plan = Plan.from_preset(mesh, "dp", precision="c=bf16",
                            annotations=[["kernel$", ["embed", "mlp"]]],
                            layouts=[["type:Block", ["batch", "seq", "embed"]]])
    assert plan.precision.compute == jnp.bfloat16 and plan.precision.params == jnp.float32
    assert plan.annotations == (("kernel$", ("embed", "mlp")),)
    assert plan.layouts == (("type:Block", ("batch", "seq", "embed")),)
    hash((plan.annotations, plan.layouts))
    assert Plan.from_preset(mesh, "dp").layouts == "auto"
    assert Plan.from_preset(mesh, "dp", layouts=()).layouts == ()
    with pytest.raises(jaxpar.JaxparError, match=r"^zero_stage=4: choose one of"):
        Plan.from_preset(mesh, "dp", zero_stage=4)
    with pytest.raises(jaxpar.JaxparError, match=r"plan.annotations entries must be"):
        Plan.from_preset(mesh, "dp", annotations=[["kernel$"]])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.zero_stage = 1


def test_replace_checks_the_new_values(mesh):
    plan = Plan.from_preset(mesh, "fsdp_tp")
    changed = plan.replace(zero_stage=2, remat="full")
    assert (changed.zero_stage, changed.remat, plan.zero_stage) == (2, "full", 0)
    with pytest.raises(jaxpar.JaxparError, match="microbatches=-1"):
        plan.replace(microbatches=-1)


def test_sequence_parallel_splits_the_residual_stream_over_tensor(mesh):
    plan = Plan.from_preset(mesh, "fsdp_tp")
    sp = plan.replace(sequence_parallel=True)
    names = ("batch", "residual_seq", "embed")
    assert plan.act_spec(names) == P(("data", "fsdp"), None, None)
    assert sp.act_spec(names) == P(("data", "fsdp"), "tensor", None)
    assert sp.act_rules.rules[0] == ("residual_seq", ("context", "tensor"))
    # Changing another knob keeps one copy of the rule.
    again = sp.replace(zero_stage=1)
    assert again.act_rules.rules.count(("residual_seq", ("context", "tensor"))) == 1
    assert "sequence parallel" in sp.describe() and "sequence parallel" not in plan.describe()
    # Turning it off again takes the rule out: the plan equals one never sequence parallel.
    off = sp.replace(sequence_parallel=False)
    assert off.act_spec(names) == P(("data", "fsdp"), None, None)
    assert off.act_rules == plan.act_rules


@pytest.mark.parametrize("knobs, message", [
    ({"microbatches": "2"}, "microbatches='2': must be int, not str"),
    ({"zero_stage": True}, "zero_stage=True: must be int, not bool"),
    ({"sequence_parallel": "no"}, "sequence_parallel='no': must be bool, not str"),
    ({"context_balance": 1}, "context_balance=1: must be bool, not int"),
    ({"layouts": 3}, "layouts=3: must be tuple or str, not int"),
])
def test_knobs_of_the_wrong_type_are_refused_by_name(mesh, knobs, message):
    # A truthy string would otherwise switch sequence parallelism on, and True be stage 1.
    with pytest.raises(jaxpar.JaxparError) as err:
        Plan.from_preset(mesh, "fsdp_tp", **knobs)
    assert str(err.value) == message


def test_from_preset_takes_the_preset_rules_and_strictness(mesh):
    plan = Plan.from_preset(mesh)  # fsdp_tp
    assert plan.param_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert plan.act_spec(("batch", "seq", "embed")) == P(("data", "fsdp"), None, None)
    # 3 does not divide over tensor=2: replicated, or an error naming the path when strict.
    assert plan.param_spec(("mlp",), shape=(3,)) == P(None)
    strict = Plan.from_preset(mesh, strict=True, zero_stage=1)
    assert strict.zero_stage == 1
    with pytest.raises(jaxpar.JaxparError, match=r"\('mlp', size 3\) of blocks/w_up is not "
                                                 r"divisible"):
        strict.param_spec(("mlp",), shape=(3,), path="blocks/w_up")
    with pytest.raises(jaxpar.JaxparError, match="unknown rules preset 'zero9'"):
        Plan.from_preset(mesh, "zero9")


# --- shardings -------------------------------------------------------------------------------


def test_specs_and_shardings_follow_the_two_rule_sets(small):
    mesh = small.mesh
    # embed is split over tensor both ways; mlp only as a weight, batch only as an activation.
    assert small.param_spec(("embed", "mlp")) == P("tensor", "data")
    assert small.act_spec(("batch", "seq", "embed")) == P("data", None, "tensor")
    assert small.sharding(P("data")) == NamedSharding(mesh, P("data"))
    assert small.replicated == NamedSharding(mesh, P())
    assert small.batch_sharding(3) == NamedSharding(mesh, P("data", None, None))
    assert small.batch_sharding() == NamedSharding(mesh, P("data", None))
    assert not small.explicit


@pytest.mark.parametrize("axes,preset,dp_axes,dp_size", [
    ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp", ("data", "fsdp"), 4),
    ({"data": 2, "fsdp": 2, "tensor": 2}, "dp", ("data", "fsdp", "tensor"), 8),
    ({"data": 2, "tensor": 4}, "tp", ("data",), 2),
    ({"tensor": 8}, "fsdp_tp", (), 1),
])
def test_data_parallel_axes_and_size(devices, axes, preset, dp_axes, dp_size):
    plan = Plan.from_preset(jaxpar.make_mesh(axes), preset)
    assert plan.data_parallel_axes == dp_axes
    assert plan.data_parallel_size == dp_size


def test_batch_names():
    assert batch_names(0) == ()
    assert batch_names(1) == ("batch",)
    assert batch_names(3) == ("batch", None, None)


def test_describe_is_one_line_with_the_knobs(devices):
    plan = Plan.from_preset(jaxpar.make_mesh({"data": 4, "tensor": 2}), zero_stage=2,
                            remat="full", microbatches=4, precision="c=bf16")
    text = plan.describe()
    assert "\n" not in text
    assert text.startswith("mesh data=4 x tensor=2")
    for part in ("zero 2", "precision params=float32,compute=bfloat16,output=float32",
                 "remat full", "microbatches 4"):
        assert part in text, (part, text)
    assert "context attention" not in text and "(explicit)" not in text
    ring = Plan.from_preset(jaxpar.make_mesh({"data": 4, "context": 2}, explicit=True),
                            context_attention="ring")
    assert ring.describe().endswith(", context attention ring")
    assert "(explicit)" in ring.describe() and ring.explicit


# --- the current plan and constrain ------------------------------------------------------------


def test_current_plan_follows_nested_activations(small, mesh):
    other = Plan.from_preset(mesh)
    assert current_plan() is None
    with small.activate() as active:
        assert active is small and current_plan() is small
        with other.activate():
            assert current_plan() is other
        assert current_plan() is small
    assert current_plan() is None
    with pytest.raises(RuntimeError, match="boom"), small.activate():
        raise RuntimeError("boom")
    assert current_plan() is None


def test_mesh_context_sets_jax_mesh_only_when_asked(small):
    assert jax.sharding.get_abstract_mesh().empty
    with small.activate():
        assert jax.sharding.get_abstract_mesh().empty
    with small.activate(mesh_context=True):
        assert jax.sharding.get_abstract_mesh().axis_names == small.mesh.axis_names
        assert dict(jax.sharding.get_abstract_mesh().shape) == dict(small.mesh.shape)
    assert jax.sharding.get_abstract_mesh().empty


def test_variables_are_not_sharded_eagerly_under_a_plan(small):
    # Logical names are not mesh axes: Flax alone would try to shard by them.
    init = nnx.with_partitioning(nnx.initializers.ones, ("embed", "mlp"))
    with small.activate(mesh_context=True):
        layer = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
    assert layer.kernel.get_value().sharding.is_fully_replicated
    assert layer.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")
    with pytest.raises(ValueError, match="embed"), jax.set_mesh(small.mesh):
        nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))


def test_constrain_does_nothing_without_a_plan():
    x = jnp.ones((4, 3))
    assert constrain(x, ("batch", "embed")) is x


def test_constrain_places_activations_by_the_activation_rules(small):
    x = jnp.arange(8 * 3 * 4, dtype=jnp.float32).reshape(8, 3, 4)
    f = jax.jit(lambda v: constrain(v * 2, ("batch", "seq", "embed")))
    with small.activate():
        y = f(x)
        # 3 rows do not split 4 ways: batch falls through to replicated.
        z = jax.jit(lambda v: constrain(v, ("batch", "seq", "embed")))(jnp.ones((3, 3, 4)))
    assert y.sharding == NamedSharding(small.mesh, P("data", None, "tensor"))
    np.testing.assert_array_equal(y, 2 * np.asarray(x))
    assert z.sharding == NamedSharding(small.mesh, P(None, None, "tensor"))


def test_constrain_under_strict_rules_names_the_activation(small):
    strict = small.replace(act_rules=ACT_RULES.with_strict())
    with pytest.raises(jaxpar.JaxparError, match=r"dimension 0 \('batch', size 3\) of "
                                                 r"activation is not divisible by mesh axes "
                                                 r"\('data',\)"), strict.activate():
        jax.jit(lambda v: constrain(v, ("batch",)))(jnp.ones((3,)))


def test_constrain_reshards_on_an_explicit_mesh(devices):
    mesh = jaxpar.make_mesh({"data": 4, "tensor": 2}, explicit=True)
    plan = Plan(mesh, PARAM_RULES, ACT_RULES)
    assert plan.explicit
    with plan.activate(mesh_context=True):
        y = jax.jit(lambda v: constrain(v + 1, ("batch", "embed")))(jnp.zeros((8, 4)))
        assert jax.typeof(y).sharding.spec == P("data", "tensor")
    assert y.sharding == NamedSharding(mesh, P("data", "tensor"))
    np.testing.assert_array_equal(y, np.ones((8, 4)))


def test_weight_copy_in_step_refuses_offloaded_state():
    mesh = jaxpar.make_mesh({"data": 8})
    with pytest.raises(jaxpar.JaxparError, match="weight_copy=in_step does not combine"):
        Plan(mesh, PARAM_RULES, ACT_RULES, weight_copy="in_step", offload_params=True)
    assert Plan(mesh, PARAM_RULES, ACT_RULES).stores_weight_copy is False  # ZeRO-0: cast
    assert Plan(mesh, PARAM_RULES, ACT_RULES, zero_stage=1).stores_weight_copy
    assert Plan(mesh, PARAM_RULES, ACT_RULES, zero_stage=3,
                offload_optimizer=0.5).stores_weight_copy
