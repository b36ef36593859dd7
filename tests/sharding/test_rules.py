import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import JaxparError, Rules, make_mesh
from jaxpar.sharding.rules import PRESETS, axes_entry, entry_axes, preset


@pytest.fixture(scope="module")
def mesh(devices):
    return make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def test_first_free_rule_wins_and_fallback(mesh):
    rules = Rules([("mlp", "tensor"), ("embed", "tensor"), ("embed", "fsdp"), ("batch", "data")])
    # mlp takes tensor first (rule order, not dimension order); embed falls back to fsdp.
    assert rules.spec(("embed", "mlp"), mesh) == P("fsdp", "tensor")
    assert rules.spec(("embed",), mesh) == P("tensor")


def test_multi_axis_target_and_none(mesh):
    rules = Rules([("batch", ("data", "fsdp")), ("seq", None), ("embed", "fsdp")])
    # batch takes data and fsdp, so embed finds fsdp taken and stays replicated.
    assert rules.spec(("batch", "seq", "embed"), mesh) == P(("data", "fsdp"), None, None)
    assert rules.spec((None, "embed"), mesh) == P(None, "fsdp")


def test_size_one_axes_are_dropped(devices):
    mesh = make_mesh({"data": 8})
    rules = Rules([("batch", ("data", "fsdp")), ("embed", "fsdp"), ("embed", "data")])
    assert rules.spec(("batch",), mesh) == P("data")
    # embed's first rule targets only size-1 axes, so the fallback rule applies.
    assert rules.spec(("embed",), mesh) == P("data")


def test_unknown_logical_name_names_it_and_path(mesh):
    rules = Rules([("embed", "fsdp")])
    with pytest.raises(JaxparError, match=r"logical axis 'hiddn' of blocks/w has no rule"):
        rules.spec(("embed", "hiddn"), mesh, path="blocks/w")


def test_indivisible_dimension_falls_through_unless_strict(mesh):
    rules = Rules([("heads", "tensor"), ("heads", "fsdp")])
    # 3 heads do not split over tensor=2, nor over fsdp=2: both rules are passed over.
    assert rules.spec(("heads",), mesh, shape=(3,)) == P(None)
    assert rules.spec(("heads",), mesh, shape=(4,)) == P("tensor")
    # The fallthrough is recorded where explain() can show it.
    text = rules.explain(("heads",), mesh, shape=(3,))
    assert "rule 0 skipped: 3 not divisible by tensor=2" in text
    assert "rule 1 skipped" in text and "replicated" in text
    with pytest.raises(JaxparError, match=r"dimension 0 \('heads', size 3\) of attn/wq is not "
                                          r"divisible by mesh axes \('tensor',\)"):
        rules.with_strict().spec(("heads",), mesh, shape=(3,), path="attn/wq")


def test_gqa_kv_heads_fewer_than_tensor_axis_are_replicated(devices):
    mesh = make_mesh({"tensor": 8})
    params, _ = preset("tp")
    # Megatron's answer: KV projections replicated, query heads still split.
    assert params.spec(("embed", "kv_heads", "head_dim"), mesh, shape=(64, 4, 8)) == P(
        None, None, None)
    assert params.spec(("embed", "heads", "head_dim"), mesh, shape=(64, 8, 8)) == P(
        None, "tensor", None)
    with pytest.raises(JaxparError, match="not divisible"):
        preset("tp", strict=True)[0].spec(("embed", "kv_heads"), mesh, shape=(64, 4))


def test_short_specs_leave_trailing_dimensions_unnamed(mesh):
    params, _ = preset("fsdp_tp")
    # nnx.MultiHeadAttention gives its 3-D kernels two names.
    assert params.spec(("embed", "heads"), mesh, shape=(64, 8, 8)) == P("fsdp", "tensor", None)
    with pytest.raises(JaxparError, match="2 dimensions"):
        params.spec(("embed", "mlp", "heads"), mesh, shape=(4, 4))


def test_mesh_axis_names_and_aliases_are_direct_targets(mesh):
    params, _ = preset("fsdp_tp")
    # A model annotated with mesh-axis names or PartitionSpec entries, as in Flax's guides.
    assert params.spec(("fsdp", "tp"), mesh, shape=(8, 8)) == P("fsdp", "tensor")
    assert params.spec((("dp", "fsdp"), None), mesh, shape=(8, 8)) == P(("data", "fsdp"), None)
    assert params.spec(P(None, "mp"), mesh, shape=(8, 8)) == P(None, "tensor")
    # A direct axis is placed first; a logical name that wants it falls back.
    assert Rules([("mlp", "tensor"), ("mlp", None)]).spec(("mlp", "tp"), mesh, shape=(8, 8)) == \
        P(None, "tensor")
    assert "mesh axes named directly" in params.explain(("tp",), mesh)
    assert Rules([("mlp", "tp"), ("batch", ("dp", "fsdp"))]).spec(("batch", "mlp"), mesh) == P(
        ("data", "fsdp"), "tensor")
    with pytest.raises(JaxparError, match="used twice"):
        params.spec(("tp", "tensor"), mesh, shape=(8, 8))
    with pytest.raises(JaxparError, match=r"mesh axis 'pod' in \('pod',\)"):
        params.spec((("pod",),), mesh, shape=(8,))
    with pytest.raises(JaxparError, match="not divisible by mesh axes"):
        params.spec(("tp",), mesh, shape=(3,))


def test_rules_may_not_name_missing_mesh_axes(mesh):
    with pytest.raises(JaxparError, match="'model'"):
        Rules([("embed", "model")]).spec(("embed",), mesh)


def test_explain_says_which_rule_fired(mesh):
    rules = Rules([("batch", ("data", "fsdp")), ("embed", "fsdp"), ("embed", None)])
    text = rules.explain(("batch", "embed"), mesh)
    assert "batch: dataxfsdp (rule 0)" in text
    assert "embed: replicated (rule 2 replicates it)" in text


def test_presets(mesh):
    assert set(PRESETS) >= {"dp", "fsdp", "tp", "fsdp_tp"}
    params, acts = preset("fsdp_tp")
    assert params.spec(("embed", "mlp"), mesh) == P("fsdp", "tensor")
    assert acts.spec(("batch", "seq", "embed"), mesh) == P(("data", "fsdp"), None, None)
    dp_params, dp_acts = preset("dp")
    assert dp_params.spec(("embed", "mlp"), mesh) == P(None, None)
    assert dp_acts.spec(("batch",), mesh) == P(("data", "fsdp", "tensor"))
    with pytest.raises(JaxparError, match="unknown rules preset"):
        preset("zero9")


def test_partition_spec_entries_and_axes_convert_both_ways():
    for entry, axes in ((None, ()), ("fsdp", ("fsdp",)), (("data", "fsdp"), ("data", "fsdp"))):
        assert entry_axes(entry) == axes
        assert axes_entry(axes) == entry
