"""Where parameters live without devices: per-device elements of a partition spec, the
base / ZeRO / compute layouts of each tensor under data, FSDP, tensor, context and expert
splits (checked against sizes worked out by hand), and a bad mesh refused."""

import math

import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.models import TransformerConfig
from jaxpar.planner.layout import layout, local_elems
from jaxpar.planner.model import from_transformer
from tests.planner.cases import TINY, TINY_PARAMS


@pytest.mark.parametrize(("shape", "spec", "elems"), [
    ((8, 6, 4), P(), 8 * 6 * 4),
    ((8, 6, 4), P("a"), 4 * 6 * 4),
    ((8, 6, 4), P("a", None, ("b", "c")), 4 * 6 * 1),  # dims past the spec are whole
    ((8, 6), P(("a", "b"), "c"), 2 * 3),
])
def test_local_elements_divide_each_dimension_by_its_axes(shape, spec, elems):
    assert local_elems(shape, spec, {"a": 2, "b": 2, "c": 2}) == elems


def _by_path(lay):
    return {p.tensor.path: p for p in lay.placed}


def test_data_parallel_replicates_and_zero_shards_over_every_device():
    spec = from_transformer(TINY)
    plain = layout(spec, {"data": 8}, "dp", 0)
    assert plain.dp_axes == ("data",) and plain.dp == 8 and plain.tp_axes == ()
    assert plain.total("base") == plain.total("compute") == TINY_PARAMS
    # Every dimension ZeRO can split divides by 8 here: optimizer state is 1/8 per device.
    assert plain.total("zero") == TINY_PARAMS // 8
    assert all(p.store_dp_axes == () and p.zero_axes == ("data",) for p in plain.placed)
    stage3 = layout(spec, {"data": 8}, "dp", 3)
    assert all(p.store_dp_axes == ("data",) for p in stage3.placed)  # gathered to compute
    assert stage3.total("compute") == TINY_PARAMS


def test_fsdp_and_tensor_splits_of_one_weight():
    lay = layout(from_transformer(TINY), {"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp", 0)
    assert lay.dp_axes == ("data", "fsdp") and lay.dp == 4 and lay.tp_axes == ("tensor",)
    wq = _by_path(lay)["blocks/attn/wq/kernel"]
    full = 2 * 64 * 4 * 16  # (layers, embed, heads, head_dim)
    assert wq.base == full // 4  # stored over fsdp x tensor
    assert wq.compute == full // 2  # gathered over fsdp for the matmul, still over tensor
    assert wq.zero == full // 8  # ZeRO adds the data axis
    assert (wq.store_dp_axes, wq.base_dp_axes, wq.zero_axes) == (("fsdp",), ("fsdp",),
                                                                ("data",))
    assert lay.total("base") == sum(p.base for p in lay.placed)


def test_context_axis_splits_the_sequence_not_the_batch():
    lay = layout(from_transformer(TINY), {"data": 2, "context": 4}, "fsdp_tp", 0)
    assert lay.dp_axes == ("data",) and lay.cp_axes == ("context",) and lay.dp == 2


def test_expert_axis_owns_the_experts_it_splits():
    cfg = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=256, n_experts=4, experts_per_token=2, expert_d_ff=64)
    lay = layout(from_transformer(cfg), {"data": 2, "expert": 4}, "fsdp_tp", 3)
    assert lay.dp_axes == ("data", "expert") and lay.dp == 8
    placed = _by_path(lay)
    gate = placed["blocks/mlp/w_gate/kernel"]
    full = math.prod(gate.tensor.shape)  # (layers, experts, embed, mlp)
    # Each device keeps 1/4 of the experts and computes with exactly those: no gather over
    # the expert axis, and ZeRO-3 shards the rest over data only.
    assert gate.owned_axes == ("expert",)
    assert gate.base == gate.compute == full // 4 and gate.zero == full // 8
    assert gate.store_dp_axes == ("data",)
    wq = placed["blocks/attn/wq/kernel"]  # a dense weight: gathered over both
    assert wq.owned_axes == () and wq.store_dp_axes == ("data", "expert")


def test_bad_mesh_sizes_are_refused():
    with pytest.raises(jaxpar.JaxparError, match="mesh sizes must be positive.*'data': 0"):
        layout(from_transformer(TINY), {"data": 0, "tensor": 2}, "fsdp_tp", 0)
