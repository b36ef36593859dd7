"""Logical names on variables: reading them (``logical_names``), attaching them by path
(``annotate``), and finding large parameters that have none (``unnamed_parameters``)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import jaxpar
from jaxpar.sharding.annotations import (
    AnnotationWarning,
    annotate,
    logical_names,
    pairs,
    unnamed_parameters,
    variables,
)
from tests import user_models as um


class Toy(nnx.Module):
    """Parameters of known sizes (139 elements in all), a non-parameter variable, and a
    Linear inside a list."""

    def __init__(self):
        self.big = nnx.Param(jnp.ones((10, 10)))
        self.mid = nnx.Param(jnp.ones((5, 4)))
        self.tiny = nnx.Param(jnp.ones((1,)))
        self.stat = nnx.BatchStat(jnp.ones((30, 30)))
        self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
        self.blocks = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])


def param(shape, **metadata) -> nnx.Param:
    with nnx.use_eager_sharding(False):
        return nnx.Param(jnp.ones(shape), **metadata)


# --- reading names -------------------------------------------------------------------------


def test_logical_names_reads_tuples_lists_and_partition_specs():
    assert logical_names(param((2, 3), out_sharding=("embed", "mlp"))) == ("embed", "mlp")
    assert logical_names(param((2, 3), out_sharding=["embed", None])) == ("embed", None)
    # PartitionSpec entries, a multi-axis entry included, come back as a tuple of entries.
    spec = PartitionSpec(("data", "fsdp"), None)
    assert logical_names(param((2, 3), out_sharding=spec)) == (("data", "fsdp"), None)
    assert logical_names(param((2, 3), out_sharding=())) == ()
    assert logical_names(param((2, 3))) is None
    var = param((2, 3))
    var.set_metadata(out_sharding="embed")  # a bare string is not a list of names
    assert logical_names(var) is None


def test_logical_names_pads_to_the_rank_and_refuses_too_many():
    var = param((2, 3, 4), out_sharding=("embed", "heads"))
    assert logical_names(var, 3) == ("embed", "heads", None)
    assert logical_names(var, 2) == ("embed", "heads")
    with pytest.raises(jaxpar.JaxparError, match=r"\('embed', 'heads'\) have more entries than "
                                                 r"the variable's 1 dimensions"):
        logical_names(var, 1)


# --- pairs and the list of variables ---------------------------------------------------------


def test_pairs_makes_yaml_lists_hashable():
    got = pairs([["q$", ["embed", ["heads", "kv_heads"]]], ("bias$", None), ["x", "embed"]],
                "plan.annotations")
    assert got == (("q$", ("embed", ("heads", "kv_heads"))), ("bias$", None), ("x", "embed"))
    hash(got)
    assert pairs(None, "x") == ()


@pytest.mark.parametrize("item", [["only_a_pattern"], "q$", ("a", ("b",), "c")])
def test_pairs_refuses_entries_that_are_not_pairs(item):
    with pytest.raises(jaxpar.JaxparError, match=r"plan\.layouts entries must be \(pattern, "
                                                 r"logical names\) pairs, got"):
        pairs([item], "plan.layouts")


def test_variables_lists_every_variable_by_path():
    got = [(path, type(var).__name__) for path, var in variables(Toy())]
    assert sorted(got) == [("big", "Param"), ("blocks/0/bias", "Param"),
                           ("blocks/0/kernel", "Param"), ("lin/bias", "Param"),
                           ("lin/kernel", "Param"), ("mid", "Param"), ("stat", "BatchStat"),
                           ("tiny", "Param")]


# --- annotate --------------------------------------------------------------------------------


def test_annotate_reports_unused_patterns_and_unnamed_arrays(devices):
    model = um.LlamaLike(rngs=nnx.Rngs(0))
    with pytest.warns(AnnotationWarning, match="matched no variable"):
        jaxpar.annotate(model, [(r"q_proj/kernel$", ("embed", "heads")), (r"nope$", ("x",))])
    assert jaxpar.logical_names(model.layers[0].self_attn.q_proj.kernel) == ("embed", "heads")
    with pytest.raises(jaxpar.JaxparError, match="rank 2"):
        jaxpar.annotate(model, [(r"gate_proj/kernel$", ("embed", "mlp", "heads"))])


def test_first_matching_pattern_wins_and_none_means_replicated():
    model = Toy()
    model.mid.set_metadata(out_sharding=("old", "names"))
    out = annotate(model, [(r"big$", ["embed", "mlp"]), (r"lin/kernel$", None),
                           (r"lin", ("vocab",)), (r"^mid$", ())], warn=False)
    assert out is model
    names = {path: logical_names(var) for path, var in variables(model)}
    assert names == {"big": ("embed", "mlp"), "lin/kernel": (), "lin/bias": ("vocab",),
                     "mid": (), "tiny": None, "stat": None, "blocks/0/kernel": None,
                     "blocks/0/bias": None}


def test_annotate_works_on_an_abstract_model_and_names_what_is_left():
    model = nnx.eval_shape(Toy)
    with pytest.warns(AnnotationWarning) as caught:
        annotate(model, [(r"big$", ("embed", "mlp")), (r"mid$", ("embed",)), (r"lin/", ())])
    assert logical_names(model.big) == ("embed", "mlp")
    assert isinstance(model.big.get_value(), jax.ShapeDtypeStruct)  # still abstract
    (warning,) = caught
    # blocks/0 holds 6 of 139 elements (over 1%); tiny (1 element) is not worth naming.
    assert str(warning.message) == ("jaxpar.annotate: large parameters without logical names "
                                    "(they will be replicated): blocks/0/kernel (2, 2), "
                                    "blocks/0/bias (2,)")


def test_no_warning_when_everything_is_named_or_warn_is_off():
    with warnings.catch_warnings():
        warnings.simplefilter("error", AnnotationWarning)
        annotate(Toy(), [(r".", ())])
        annotate(Toy(), [(r"nothing_matches_this", ("x",))], warn=False)


@pytest.mark.parametrize("rules,match", [
    ([(r"big(", ("embed",))], r"annotation pattern 'big\(' is not a valid regex"),
    ([(r"big$", "embed")], r"annotation 'big\$': names must be a sequence .* got the string "
                           r"'embed'"),
    ([(r"big$",)], r"annotation entries must be \(pattern, logical names\) pairs"),
    ([(r"tiny$", ("a", "b"))], r"annotation 'tiny\$' gives tiny \(rank 1\) 2 names"),
])
def test_bad_annotations_name_the_pattern(rules, match):
    with pytest.raises(jaxpar.JaxparError, match=match):
        annotate(Toy(), rules, warn=False)


# --- unnamed_parameters -----------------------------------------------------------------------


def test_unnamed_parameters_largest_first_above_the_share():
    model = Toy()
    # 139 parameter elements; at 10% only big (100) and mid (20) are listed.
    assert unnamed_parameters(model, 0.1) == [("big", (10, 10)), ("mid", (5, 4))]
    # At 1% (1.39 elements) every parameter but the one-element one, largest first; the
    # BatchStat is not a parameter.
    assert unnamed_parameters(model) == [("big", (10, 10)), ("mid", (5, 4)),
                                         ("lin/kernel", (3, 3)), ("blocks/0/kernel", (2, 2)),
                                         ("lin/bias", (3,)), ("blocks/0/bias", (2,))]
    annotate(model, [(r"big$", ()), (r"mid$", ("embed",))], warn=False)
    assert unnamed_parameters(model, 0.1) == []
