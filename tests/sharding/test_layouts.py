"""Pinned module outputs and weights (``constrain_outputs``), and the layouts a plan pins by
default (``repeated_blocks``, ``auto_layouts``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.models import Transformer
from jaxpar.sharding.layouts import (
    BLOCK_OUTPUT,
    auto_layouts,
    constrain_outputs,
    pinned,
    repeated_blocks,
)
from jaxpar.sharding.plan import Plan
from jaxpar.sharding.rules import Rules
from tests import user_models as um
from tests.helpers import SMALL
from tests.sharding.test_user_models import BSE

ACT_RULES = Rules([("batch", "data"), ("seq", None), ("embed", "tensor"), ("vocab", "tensor")])


class TwoOutputs(nnx.Module):
    """Returns a sequence of vectors (3-D) and a pooled batch of vectors (2-D)."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        y = self.lin(x)
        return y, y.sum(1)


class Inner(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


class Block(nnx.Module):
    """A block that itself holds a list of two like modules."""

    def __init__(self, rngs: nnx.Rngs):
        self.parts = nnx.List([Inner(rngs), Inner(rngs)])

    def __call__(self, x):
        for part in self.parts:
            x = part(x)
        return x


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, named_embed: bool = True):
        init = nnx.initializers.normal()
        if named_embed:
            init = nnx.with_partitioning(init, ("vocab", "embed"))
        self.embed = nnx.Embed(16, 4, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.single = nnx.List([Inner(rngs)])  # one of a kind: not repeated
        self.extra = nnx.List([nnx.Param(jnp.ones(3))])
        self.out = TwoOutputs(rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(self.single[0](x))


def make_net(**kw) -> Net:
    with nnx.use_eager_sharding(False):
        return Net(nnx.Rngs(0), **kw)


@pytest.fixture(scope="module")
def plan(devices):
    mesh = jaxpar.make_mesh({"data": 4, "tensor": 2})
    return Plan(mesh, Rules([]), ACT_RULES)


TOKENS = np.arange(24).reshape(8, 3) % 16


# --- constrain_outputs ------------------------------------------------------------------------


def test_layout_targets_are_checked(devices):
    model = um.LlamaLike(rngs=nnx.Rngs(0))
    with pytest.raises(jaxpar.JaxparError, match="matches no module"):
        jaxpar.constrain_outputs(model, [("type:NoSuchLayer", BSE)])
    jaxpar.constrain_outputs(model, [("type:LlamaDecoderLayer", BSE)])
    assert isinstance(model.layers[0], um.LlamaDecoderLayer)  # class, attributes, paths kept
    assert model.layers[0].self_attn.kv_heads == 2
    out = model(jnp.zeros((2, 8), jnp.int32))  # no plan: constraints do nothing
    assert out.shape == (2, 8, um.VOCAB)


def test_pinned_outputs_take_the_activation_rules_sharding(plan):
    net = make_net()
    ref = net(TOKENS)
    assert constrain_outputs(net, [(TwoOutputs, BLOCK_OUTPUT)]) is net
    graphdef, state = nnx.split(net)
    with plan.activate():
        seq, pooled = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, TOKENS)
    # A 3-D output is (batch, seq, embed), a 2-D one (batch,) with the rest unnamed.
    assert seq.sharding == NamedSharding(plan.mesh, P("data", None, "tensor"))
    assert pooled.sharding == NamedSharding(plan.mesh, P("data"))
    np.testing.assert_allclose(seq, ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled, ref[1], rtol=1e-5, atol=1e-6)


def test_pinned_modules_compute_the_same_outside_a_plan():
    net = make_net()
    ref = net(TOKENS)
    constrain_outputs(net, [("type:Block", BSE), (r"^single/0$", ("batch",))])
    assert type(net.blocks[0]).__name__ == "Block" and isinstance(net.blocks[0], Block)
    assert type(net.blocks[0]) is not Block
    for got, want in zip(net(TOKENS), ref, strict=True):
        np.testing.assert_array_equal(got, want)
    assert {path: names for path, names, _ in pinned(net)} == {
        "blocks/0": BSE, "blocks/1": BSE, "single/0": ("batch",)}


def test_first_matching_target_wins_and_pinning_again_replaces_the_names():
    net = make_net()
    constrain_outputs(net, [(r"^blocks/0$", ("batch",)), ("type:Block", BSE)])
    assert pinned(net) == [("blocks/0", ("batch",), ()), ("blocks/1", BSE, ())]
    constrain_outputs(net, [(Block, ("batch", "seq"))])
    assert pinned(net) == [("blocks/0", ("batch", "seq"), ()), ("blocks/1", ("batch", "seq"), ())]
    # The new class derives from the user's class directly, not from the earlier pin.
    assert type(net.blocks[0]).__mro__[1] is Block


def test_a_weight_regex_pins_the_weight_while_its_module_runs(plan):
    net = make_net()
    constrain_outputs(net, [(r"embed/embedding$", ("vocab", None))])
    assert pinned(net) == [("embed", None, (("embedding", ("vocab", None)),))]
    graphdef, state = nnx.split(net)
    with plan.activate():
        text = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, TOKENS).as_text()
    constraints = [line for line in text.splitlines() if "sharding_constraint" in line]
    assert len(constraints) == 1, constraints
    assert '[{"tensor"}, {}]> : tensor<16x4xf32>' in constraints[0]
    # Run eagerly under the plan, the table is put back as it was after the call.
    before = net.embed.embedding.get_value()
    with plan.activate():
        net(TOKENS)
    assert net.embed.embedding.get_value() is before


@pytest.mark.parametrize("layouts,match", [
    ([("type:Nope", BSE)], r"layout target 'type:Nope' matches no module; module types: "
                           r"\[.*'Block'.*\]"),
    ([(r"no_such_path$", BSE)], r"layout target 'no_such_path\$' matches no module"),
    ([(42, BSE)], r"layout target 42 must be a module class, 'type:Name' or a path regex"),
    ([(r"blocks(", BSE)], r"layout pattern 'blocks\(' is not a valid regex"),
    ([(r"extra/0$", ("batch",))], r"layout 'extra/0\$' matches extra/0, which is not an "
                                  r"attribute of a module"),
    ([(Block,)], r"layout entries must be \(pattern, logical names\) pairs"),
])
def test_bad_layouts_name_the_target(layouts, match):
    with pytest.raises(jaxpar.JaxparError, match=match):
        constrain_outputs(make_net(), layouts)


# --- what "auto" pins --------------------------------------------------------------------------


def test_repeated_blocks_are_the_outermost_lists_of_one_class():
    net = make_net()
    # blocks/0 and blocks/1 hold lists of two Inners too; those are inside a repeated
    # block and not listed. single/0 is alone in its list.
    assert [path for path, _ in repeated_blocks(net)] == ["blocks/0", "blocks/1"]
    assert repeated_blocks(net)[0][1] is net.blocks[0]


def test_a_stack_over_layers_is_one_repeated_block():
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)))
    assert [path for path, _ in repeated_blocks(model)] == ["blocks"]
    assert auto_layouts(model) == []  # jaxpar's own model places its activations itself


def test_auto_layouts_pin_blocks_and_named_embedding_tables():
    assert auto_layouts(make_net()) == [("^blocks/0$", BLOCK_OUTPUT), ("^blocks/1$", BLOCK_OUTPUT),
                                        ("^embed/embedding$", ("vocab", "embed"))]
    # A table without names is left alone.
    assert auto_layouts(make_net(named_embed=False)) == [("^blocks/0$", BLOCK_OUTPUT),
                                                         ("^blocks/1$", BLOCK_OUTPUT)]
    with nnx.use_eager_sharding(False):
        mha = um.MhaLM(rngs=nnx.Rngs(0))
    assert auto_layouts(mha) == [("^blocks/0$", BLOCK_OUTPUT), ("^blocks/1$", BLOCK_OUTPUT),
                                 ("^embed/embedding$", ("vocab", "embed"))]
