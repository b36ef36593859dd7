"""Reading optimized HLO (jaxpar.analysis.hlo): collectives, their replica groups and bytes,
and matmul FLOPs, checked on hand-written HLO text and on programs compiled for the 8
simulated devices, against counts worked out by hand from the shardings chosen."""

from collections import Counter
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.analysis.hlo import (
    collective_table,
    count_collectives,
    count_reduce_scatters,
    flops,
    group_axes,
    matmul_flops,
    memory_stats,
    parse_collectives,
)

# One collective of each kind, with the replica groups written in each of the forms XLA
# prints: explicit lists, iota ([G,S]<=[N], with a transpose), Shardy's mesh form with
# device ids, source-target pairs; plus an async start/done pair and a fusion that only
# uses collective results (neither the done nor the fusion is a collective).
SNIPPET = """\
HloModule demo, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[4,4], p1: bf16[4,32]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = bf16[4,32]{1,0} parameter(1)
  %all-reduce.1 = f32[4,4]{1,0} all-reduce(%p0), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %all-gather.2 = bf16[16,32]{1,0} all-gather(%p1), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %reduce-scatter.3 = f32[1,4]{1,0} reduce-scatter(%all-reduce.1), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add
  %collective-permute.4 = f32[4,4]{1,0} collective-permute(%p0), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %all-gather-start.5 = (f32[1,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%reduce-scatter.3), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %all-gather-done.5 = f32[8,4]{1,0} all-gather-done(%all-gather-start.5)
  %fusion.6 = f32[4,4]{1,0} fusion(%all-reduce.1, %collective-permute.4), kind=kLoop, calls=%add
  ROOT %all-to-all.7 = f32[4,4]{1,0} all-to-all(%fusion.6), channel_id=6, replica_groups=mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'x'}, dimensions={0}
}
"""  # noqa: E501


def loop_free(rows: list[dict]) -> list[dict]:
    """A loop-free program's collective table, checked to run each instruction once a step
    and returned without the per-step columns."""
    for r in rows:
        assert (r["executions"], r["bytes_per_step"]) == (r["count"], r["bytes_per_device"])
    return [{k: r[k] for k in ("kind", "axes", "count", "bytes_per_device")} for r in rows]


def mesh_2x4(devices) -> Mesh:
    """Devices 0..7 as a 2 x 4 mesh, axes ``a`` (rows) and ``b`` (columns)."""
    return Mesh(np.array(devices).reshape(2, 4), ("a", "b"))


def test_parse_collectives_reads_every_group_form():
    got = parse_collectives(SNIPPET)
    assert [c.kind for c in got] == ["all-reduce", "all-gather", "reduce-scatter",
                                     "collective-permute", "all-gather", "all-to-all"]
    # Result bytes per device: f32 4x4, bf16 16x32, f32 1x4, f32 4x4, the start's second
    # (result) buffer f32 8x4, f32 4x4.
    assert [c.bytes for c in got] == [64, 1024, 16, 64, 128, 64]
    columns = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert got[0].groups == columns
    assert got[1].groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert got[2].groups == columns  # arange(8) as 2x4, transposed, read as 4 groups of 2
    assert got[3].groups == [[0, 1], [1, 0]]
    assert got[4].groups == [list(range(8))]
    # Mesh x=2, y=4 over device ids arange(8).reshape(4, 2).T = [[0,2,4,6],[1,3,5,7]]:
    # a group varies x at fixed y, so it holds the two ids of one column.
    assert got[5].groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert got[0].line.startswith("%all-reduce.1 = f32[4,4]")
    assert count_collectives(SNIPPET) == Counter({"all-gather": 2, "all-reduce": 1,
                                                  "reduce-scatter": 1,
                                                  "collective-permute": 1, "all-to-all": 1})


def test_text_without_collectives_counts_nothing():
    text = "ENTRY %m (p: f32[2]) -> f32[2] {\n  ROOT %p = f32[2]{0} parameter(0)\n}\n"
    assert parse_collectives(text) == [] and count_collectives(text) == Counter()
    assert count_reduce_scatters(text) == 0


def test_group_axes_names_the_axes_a_group_spans(devices):
    mesh = mesh_2x4(devices)
    assert group_axes([[0, 4], [1, 5], [2, 6], [3, 7]], mesh) == ("a",)
    assert group_axes([[0, 1, 2, 3], [4, 5, 6, 7]], mesh) == ("b",)
    assert group_axes([[0, 1], [2, 3], [4, 5], [6, 7]], mesh) == ("b",)
    assert group_axes([list(range(8))], mesh) == ("a", "b")
    assert group_axes([[1, 4]], mesh) == ("a", "b")  # (0, 1) and (1, 0) differ in both
    assert group_axes([[0], [5]], mesh) == ()
    assert group_axes([], mesh) == ()


def test_collective_table_sums_count_and_bytes_by_kind_and_axes(devices):
    mesh = mesh_2x4(devices)
    text = "\n".join([
        "ENTRY %m (p: f32[8]) -> f32[8] {",
        "  %p = f32[8]{0} parameter(0)",
        "  %all-reduce.1 = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}",
        "  %all-reduce.2 = f32[2]{0} all-reduce(%all-reduce.1), replica_groups=[2,4]<=[8]",
        "  %all-reduce.3 = s32[8]{0} all-reduce(%p), replica_groups={{0,4},{1,5},{2,6},{3,7}}",
        "  ROOT %all-gather.4 = bf16[8]{0} all-gather(%p), replica_groups={{0,1,2,3,4,5,6,7}}",
        "}"])
    assert loop_free(collective_table(text, mesh)) == [
        {"kind": "all-gather", "axes": ["a", "b"], "count": 1, "bytes_per_device": 16},
        {"kind": "all-reduce", "axes": ["a"], "count": 1, "bytes_per_device": 32},
        {"kind": "all-reduce", "axes": ["b"], "count": 2, "bytes_per_device": 40},
    ]


def test_count_reduce_scatters_counts_an_all_reduce_only_sliced_afterwards():
    text = "\n".join([
        "ENTRY %m (p: f32[8], i: s32[]) -> f32[2] {",
        "  %p = f32[8]{0} parameter(0)",
        "  %i = s32[] parameter(1)",
        "  %reduce-scatter.0 = f32[2]{0} reduce-scatter(%p), replica_groups=[2,4]<=[8]",
        # Every user of this all-reduce cuts out a slice: a reduce-scatter in disguise.
        "  %all-reduce.1 = f32[8]{0} all-reduce(%p), replica_groups=[2,4]<=[8]",
        "  %dynamic-slice.1 = f32[2]{0} dynamic-slice(%all-reduce.1, %i), "
        "dynamic_slice_sizes={2}",
        "  %dynamic-slice.2 = f32[2]{0} dynamic-slice(%all-reduce.1, %i), "
        "dynamic_slice_sizes={2}",
        # This one is added whole somewhere: a real all-reduce.
        "  %all-reduce.2 = f32[8]{0} all-reduce(%p), replica_groups=[2,4]<=[8]",
        "  %dynamic-slice.3 = f32[2]{0} dynamic-slice(%all-reduce.2, %i), "
        "dynamic_slice_sizes={2}",
        "  %add.4 = f32[8]{0} add(%all-reduce.2, %p)",
        # No user at all: not counted either.
        "  %all-reduce.3 = f32[8]{0} all-reduce(%p), replica_groups=[2,4]<=[8]",
        "  ROOT %add.5 = f32[2]{0} add(%dynamic-slice.1, %reduce-scatter.0)",
        "}"])
    assert count_collectives(text) == Counter({"all-reduce": 3, "reduce-scatter": 1})
    assert count_reduce_scatters(text) == 2


# Dots in the entry (once), in a fusion inside a loop of 3 trips, in a loop of 2 trips nested
# in that loop (6 runs), and in a loop whose trip count XLA did not record (counted once).
LOOPS = """\
%fused_dot (fp0: f32[4,8], fp1: f32[8,8]) -> f32[4,8] {
  %fp0 = f32[4,8]{1,0} parameter(0)
  %fp1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.f = f32[4,8]{1,0} dot(%fp0, %fp1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%inner_body (ib: (f32[2,3], f32[3,5])) -> (f32[2,3], f32[3,5]) {
  %ib = (f32[2,3]{1,0}, f32[3,5]{1,0}) parameter(0)
  %ib0 = f32[2,3]{1,0} get-tuple-element(%ib), index=0
  %ib1 = f32[3,5]{1,0} get-tuple-element(%ib), index=1
  %dot.i = f32[2,5]{1,0} dot(%ib0, %ib1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %it = (f32[2,3]{1,0}, f32[3,5]{1,0}) tuple(%ib0, %ib1)
}

%outer_body (ob: (f32[4,8], f32[8,8])) -> (f32[4,8], f32[8,8]) {
  %ob = (f32[4,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %ob0 = f32[4,8]{1,0} get-tuple-element(%ob), index=0
  %ob1 = f32[8,8]{1,0} get-tuple-element(%ob), index=1
  %fusion.o = f32[4,8]{1,0} fusion(%ob0, %ob1), kind=kOutput, calls=%fused_dot
  %inner = (f32[2,3]{1,0}, f32[3,5]{1,0}) while(%t0), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %ot = (f32[4,8]{1,0}, f32[8,8]{1,0}) tuple(%fusion.o, %ob1)
}

%odd_body (db: (f32[6,7], f32[7,1])) -> (f32[6,7], f32[7,1]) {
  %db = (f32[6,7]{1,0}, f32[7,1]{1,0}) parameter(0)
  %db0 = f32[6,7]{1,0} get-tuple-element(%db), index=0
  %db1 = f32[7,1]{1,0} get-tuple-element(%db), index=1
  %dot.d = f32[6,1]{1,0} dot(%db0, %db1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %dt = (f32[6,7]{1,0}, f32[7,1]{1,0}) tuple(%db0, %db1)
}

ENTRY %main (x: f32[8,16], w: f32[16,32]) -> f32[8,32] {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,32]{1,0} parameter(1)
  %outer = (f32[4,8]{1,0}, f32[8,8]{1,0}) while(%t1), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %odd = (f32[6,7]{1,0}, f32[7,1]{1,0}) while(%t2), condition=%cond, body=%odd_body
  ROOT %dot.e = f32[8,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""  # noqa: E501


def test_matmul_flops_weights_each_dot_by_how_often_it_runs():
    entry = 2 * 8 * 32 * 16          # once
    fused = 2 * 4 * 8 * 8 * 3        # in the outer loop's fusion: 3 trips
    inner = 2 * 2 * 5 * 3 * 3 * 2    # inner loop: 2 trips per outer trip
    odd = 2 * 6 * 1 * 7              # unknown trip count: once
    assert matmul_flops(LOOPS) == {"flops": entry + fused + inner + odd, "dots": 4,
                                   "loops": 3, "loops_without_trip_count": 1}


# The TPU compiler writes dot_generals as convolutions. Attention's batched matmuls, as it
# wrote them for a 22B-shaped layer on v4 (batch 16 x 24 heads, q.k over head_dim 256):
# the batch dimensions as a window either padded by its size minus one, or over an lhs
# dilated by its size; each output sees one position of them.
CONVOLUTIONS = """\
HloModule convs, is_scheduled=true

ENTRY %main (q: bf16[16,24,1024,256], k: bf16[16,24,256,1024], x: bf16[16384,6144], w: bf16[6144,16384]) -> f32[16,24,1024,1024] {
  %q = bf16[16,24,1024,256]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %k = bf16[16,24,256,1024]{3,2,1,0:T(8,128)(2,1)} parameter(1)
  %x = bf16[16384,6144]{1,0:T(8,128)(2,1)} parameter(2)
  %w = bf16[6144,16384]{1,0:T(8,128)(2,1)} parameter(3)
  %mlp = bf16[16384,16384]{1,0:T(8,128)(2,1)} convolution(%x, %w), dim_labels=bf_io->bf, metadata={op_name="dot_general"}
  %padded = f32[16,24,1024,1024]{3,2,1,0:T(8,128)} convolution(%q, %k), window={size=16x24 pad=15_15x23_23 rhs_reversal=1x1}, dim_labels=01bf_01io->01bf, metadata={op_name="dot_general"}
  ROOT %dilated = f32[16,24,1024,1024]{2,3,1,0:T(8,128)} convolution(%q, %k), window={size=16x24 stride=15x23 lhs_dilate=16x24}, dim_labels=01bf_01io->01bf, metadata={op_name="vmap(BTNH,BSNH->BNTS)/dot_general"}
}
"""  # noqa: E501


def test_matmul_flops_of_the_tpu_compilers_convolutions():
    mlp = 2 * 16384 * 16384 * 6144
    scores = 2 * 16 * 24 * 1024 * 1024 * 256  # not times the 384 batch positions
    assert matmul_flops(CONVOLUTIONS)["flops"] == mlp + 2 * scores


def test_matmul_flops_multiplies_loop_bodies_by_trip_count(devices):
    import jax
    import jax.numpy as jnp

    from jaxpar.analysis.hlo import matmul_flops

    def f(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    x, ws = jnp.ones((8, 16)), jnp.ones((5, 16, 16))
    hlo = jax.jit(f).lower(x, ws).compile().as_text()
    got = matmul_flops(hlo)
    assert got["flops"] == 5 * 2 * 8 * 16 * 16
    assert got["loops"] == 1 and got["loops_without_trip_count"] == 0


def test_contracting_over_a_sharded_axis_is_one_all_reduce_over_it(devices):
    # x[8, 64] split rows over a and columns over b, w[64, 32] split rows over b: each
    # device multiplies [4, 16] by [16, 32] and the partial [4, 32] sums over b.
    mesh = mesh_2x4(devices)
    x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("a", "b")))
    w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("b", None)))
    matmul = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P("a", None)))
    compiled = matmul.lower(x, w).compile()
    text = compiled.as_text()
    (only,) = parse_collectives(text)
    assert only.kind == "all-reduce" and only.bytes == 4 * 32 * 4
    assert only.groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert loop_free(collective_table(text, mesh)) == [
        {"kind": "all-reduce", "axes": ["b"], "count": 1, "bytes_per_device": 512}]
    assert matmul_flops(text)["flops"] == 2 * 4 * 32 * 16
    stats = memory_stats(compiled)
    assert stats["argument_bytes"] == (4 * 16 + 16 * 32) * 4
    assert stats["output_bytes"] == 4 * 32 * 4


def test_a_reduction_on_a_made_mesh_is_read_from_shardy_groups(devices):
    # jax.make_mesh's mesh: XLA may print the groups in Shardy's mesh form.
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("a", "b")))
    total = jax.jit(lambda x: x.sum(axis=1), out_shardings=NamedSharding(mesh, P("a")))
    text = total.lower(x).compile().as_text()
    assert loop_free(collective_table(text, mesh)) == [
        {"kind": "all-reduce", "axes": ["b"], "count": 1, "bytes_per_device": 8 * 4}]


def test_one_of_each_collective_from_shard_map(devices):
    mesh = mesh_2x4(devices)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"))
    def chain(x):                                                     # [8, 8] per device
        x = jax.lax.psum(x, "a")                                      # [8, 8]
        x = jax.lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)])
        x = jax.lax.all_gather(x, "a", axis=0, tiled=True)            # [16, 8]
        x = jax.lax.psum_scatter(x, "b", scatter_dimension=0, tiled=True)  # [4, 8]
        return jax.lax.all_to_all(x, "b", 0, 1, tiled=True)           # [1, 32]

    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("a", "b")))
    text = chain.lower(x).compile().as_text()
    assert count_collectives(text) == Counter({"all-reduce": 1, "collective-permute": 1,
                                               "all-gather": 1, "reduce-scatter": 1,
                                               "all-to-all": 1})
    assert count_reduce_scatters(text) == 1
    f32 = 4
    assert loop_free(collective_table(text, mesh)) == [
        {"kind": "all-gather", "axes": ["a"], "count": 1, "bytes_per_device": 16 * 8 * f32},
        {"kind": "all-reduce", "axes": ["a"], "count": 1, "bytes_per_device": 8 * 8 * f32},
        {"kind": "all-to-all", "axes": ["b"], "count": 1, "bytes_per_device": 32 * f32},
        {"kind": "collective-permute", "axes": ["b"], "count": 1,
         "bytes_per_device": 8 * 8 * f32},
        {"kind": "reduce-scatter", "axes": ["b"], "count": 1, "bytes_per_device": 4 * 8 * f32},
    ]
    permute = next(c for c in parse_collectives(text) if c.kind == "collective-permute")
    assert sorted(map(tuple, permute.groups)) == sorted(
        (4 * row + i, 4 * row + (i + 1) % 4) for row in range(2) for i in range(4))


def test_single_device_matmul_flops_and_memory(devices):
    compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 16)),
                                                 jnp.ones((16, 32))).compile()
    assert flops(compiled) == 2 * 8 * 32 * 16
    stats = memory_stats(compiled)
    assert stats["argument_bytes"] == (8 * 16 + 16 * 32) * 4
    assert stats["output_bytes"] == 8 * 32 * 4
    assert set(stats) == {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                          "code_bytes", "host_argument_bytes", "host_output_bytes",
                          "host_alias_bytes", "host_temp_bytes"}
    assert not any(stats[k] for k in stats if k.startswith("host_"))


def test_flops_and_memory_when_xla_reports_nothing():
    bare = SimpleNamespace(memory_analysis=lambda: None, cost_analysis=lambda: None)
    assert memory_stats(bare) == {} and flops(bare) == 0.0
    per_device = SimpleNamespace(cost_analysis=lambda: [{"flops": 12.0}, {"flops": 99.0}])
    assert flops(per_device) == 12.0  # older JAX: a list, one dict per device
    assert flops(SimpleNamespace(cost_analysis=lambda: [])) == 0.0
    assert flops(SimpleNamespace(cost_analysis=lambda: {"bytes accessed": 3.0})) == 0.0


def test_memory_stats_split_device_and_host_memory(devices):
    """A jitted update whose state lives in pinned host memory (JAX's own memory kinds):
    the host arrays are counted as host bytes, the rest as device bytes, per device."""
    mesh = Mesh(np.array(devices).reshape(8), ("x",))
    dev = NamedSharding(mesh, P("x"))
    host = dev.with_memory_kind("pinned_host")
    state = jax.device_put(jnp.zeros((64, 32)), host)  # 1 KiB per device
    grad = jax.device_put(jnp.ones((64, 32)), dev)
    bias = jax.device_put(jnp.ones((8, 16)), dev)      # 64 bytes per device

    def update(state, grad, bias):
        new = jax.device_put(state, jax.memory.Space.Device) + grad
        return jax.device_put(new, jax.memory.Space.Host), bias * 2

    compiled = jax.jit(update, donate_argnums=0, out_shardings=(host, dev)).lower(
        state, grad, bias).compile()
    got = memory_stats(compiled)
    assert got["host_argument_bytes"] == 1024 and got["host_output_bytes"] == 1024
    assert got["host_alias_bytes"] == 1024  # the donated state is updated in place
    assert got["argument_bytes"] == 1024 + 64 and got["alias_bytes"] == 0


# A conditional in a loop of 4 trips, its branches a cheap dot and a dear one: one branch
# runs per execution.
BRANCHES = """\
%cheap (c: (f32[2,4], f32[4,4])) -> f32[2,4] {
  %c = (f32[2,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  %c0 = f32[2,4]{1,0} get-tuple-element(%c), index=0
  %c1 = f32[4,4]{1,0} get-tuple-element(%c), index=1
  ROOT %dot.c = f32[2,4]{1,0} dot(%c0, %c1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%dear (d: (f32[8,4], f32[4,16])) -> f32[8,16] {
  %d = (f32[8,4]{1,0}, f32[4,16]{1,0}) parameter(0)
  %d0 = f32[8,4]{1,0} get-tuple-element(%d), index=0
  %d1 = f32[4,16]{1,0} get-tuple-element(%d), index=1
  ROOT %dot.d = f32[8,16]{1,0} dot(%d0, %d1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (b: (s32[], f32[4])) -> (s32[], f32[4]) {
  %b = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %k = s32[] constant(1)
  %cond.r = f32[2,4]{1,0} conditional(%i, %t0, %t1), branch_computations={%cheap, %dear}
  %n = s32[] add(%i, %k)
  ROOT %t = (s32[], f32[4]{0}) tuple(%n, %x)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cnd, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""  # noqa: E501


def test_a_conditional_runs_its_costliest_branch_once_per_execution():
    dear = 2 * 8 * 16 * 4
    assert matmul_flops(BRANCHES)["flops"] == 4 * dear  # not 4 x (cheap + dear)
    # A pipeline schedule's switch does work in a share of its ticks only.
    assert matmul_flops(BRANCHES, branch_share=0.25)["flops"] == dear


# The TPU compiler's forms, written as it prints them (tiled layouts, ``:T(...)``): a
# weight gathered by summing a buffer of zeros that holds this device's shard; a gradient
# reduced whole, each device then slicing out its part inside a fusion; a combined
# all-reduce of a sliced element and a used-whole one; and an all-gather that an async
# collective fusion carries from its start through a continuation to its done, under one
# channel id.
TPU_FORMS = """\
HloModule tpu_forms, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%place (fp0: f32[2,8], fp1: s32[]) -> f32[8,8] {
  %fp0 = f32[2,8]{1,0:T(8,128)} parameter(0)
  %fp1 = s32[] parameter(1)
  %zero = f32[] constant(0)
  %zeros = f32[8,8]{1,0:T(8,128)} broadcast(%zero), dimensions={}
  ROOT %dynamic-update-slice.1 = f32[8,8]{1,0:T(8,128)} dynamic-update-slice(%zeros, %fp0, %fp1, %fp1)
}

%keep_mine (kp0: f32[8,8], kp1: s32[]) -> f32[2,8] {
  %kp0 = f32[8,8]{1,0:T(8,128)} parameter(0)
  %kp1 = s32[] parameter(1)
  ROOT %dynamic-slice.1 = f32[2,8]{1,0:T(8,128)} dynamic-slice(%kp0, %kp1, %kp1), dynamic_slice_sizes={2,8}
}

%gather_start (gp0: f32[2,8]) -> (f32[2,8], f32[8,8]) {
  %gp0 = f32[2,8]{1,0:T(8,128)} parameter(0)
  %all-gather.10 = f32[8,8]{1,0:T(8,128)} all-gather(%gp0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %gs = (f32[2,8]{1,0:T(8,128)}, f32[8,8]{1,0:T(8,128)}) tuple(%gp0, %all-gather.10)
}

%async_collective_fusion.1 (cp0: f32[2,8], cp1: f32[8,8]) -> (f32[2,8], f32[8,8]) {
  %cp0 = f32[2,8]{1,0:T(8,128)} parameter(0)
  %cp1 = f32[8,8]{1,0:T(8,128)} parameter(1)
  %all-gather.11 = f32[8,8]{1,0:T(8,128)} all-gather(%cp0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %cs = (f32[2,8]{1,0:T(8,128)}, f32[8,8]{1,0:T(8,128)}) tuple(%cp0, %all-gather.11)
}

%gather_done (dp0: f32[2,8]) -> f32[8,8] {
  %dp0 = f32[2,8]{1,0:T(8,128)} parameter(0)
  ROOT %all-gather.12 = f32[8,8]{1,0:T(8,128)} all-gather(%dp0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
}

ENTRY %main (w: f32[2,8], g: f32[8,8], h: f32[8,8], i: s32[]) -> f32[2,8] {
  %w = f32[2,8]{1,0:T(8,128)} parameter(0)
  %g = f32[8,8]{1,0:T(8,128)} parameter(1)
  %h = f32[8,8]{1,0:T(8,128)} parameter(2)
  %i = s32[] parameter(3)
  %fusion.1 = f32[8,8]{1,0:T(8,128)} fusion(%w, %i), kind=kLoop, calls=%place
  %all-reduce.1 = f32[8,8]{1,0:T(8,128)} all-reduce(%fusion.1), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
  %all-reduce.2 = f32[8,8]{1,0:T(8,128)} all-reduce(%g), channel_id=2, replica_groups=[1,4]<=[4], to_apply=%add
  %fusion.2 = f32[2,8]{1,0:T(8,128)} fusion(%all-reduce.2, %i), kind=kLoop, calls=%keep_mine
  %all-reduce.3 = (f32[8,8]{1,0:T(8,128)}, f32[8,8]{1,0:T(8,128)}) all-reduce(%g, %h), channel_id=3, replica_groups=[1,4]<=[4], to_apply=%add
  %gte.0 = f32[8,8]{1,0:T(8,128)} get-tuple-element(%all-reduce.3), index=0
  %gte.1 = f32[8,8]{1,0:T(8,128)} get-tuple-element(%all-reduce.3), index=1
  %dynamic-slice.2 = f32[2,8]{1,0:T(8,128)} dynamic-slice(%gte.0, %i, %i), dynamic_slice_sizes={2,8}
  %add.1 = f32[8,8]{1,0:T(8,128)} add(%gte.1, %all-reduce.1)
  %async-collective-start.1 = (f32[2,8]{1,0:T(8,128)}, f32[8,8]{1,0:T(8,128)}) fusion(%w), kind=kCustom, calls=%gather_start
  %gte.2 = f32[2,8]{1,0:T(8,128)} get-tuple-element(%async-collective-start.1), index=0
  %gte.3 = f32[8,8]{1,0:T(8,128)} get-tuple-element(%async-collective-start.1), index=1
  %fusion.3 = (f32[2,8]{1,0:T(8,128)}, f32[8,8]{1,0:T(8,128)}) fusion(%gte.2, %gte.3), kind=kOutput, calls=%async_collective_fusion.1
  %gte.4 = f32[2,8]{1,0:T(8,128)} get-tuple-element(%fusion.3), index=0
  %async-collective-done.1 = f32[8,8]{1,0:T(8,128)} fusion(%gte.4), kind=kCustom, calls=%gather_done
  ROOT %out = f32[2,8]{1,0:T(8,128)} add(%fusion.2, %dynamic-slice.2)
}
"""  # noqa: E501


def test_the_tpu_compilers_all_reduces_are_read_as_the_gathers_and_scatters_they_make():
    got = [(c.kind, c.implements, c.bytes) for c in parse_collectives(TPU_FORMS)]
    assert got == [
        ("all-gather", "all-gather", 256),  # the async fusion's gather, once (its start)
        ("all-reduce", "all-gather", 256),  # shard placed in zeros, summed
        ("all-reduce", "reduce-scatter", 256),  # summed whole, sliced in a fusion
        ("all-reduce", "reduce-scatter", 256),  # a combined one: element 0 sliced
        ("all-reduce", "all-reduce", 256),  # element 1 added whole
    ]
    # An all-reduce moves an all-reduce's bytes whatever it implements: 2 (n - 1) / n of
    # its buffer, twice the ring all-gather of the same result.
    forms = parse_collectives(TPU_FORMS)
    assert [c.wire_bytes for c in forms] == [192, 384, 384, 384, 384]


def test_an_untiled_programs_sliced_all_reduce_stays_an_all_reduce():
    """XLA:CPU reduce-scatters by all-reducing and slicing, and the planner lists that
    all-reduce as one; only the TPU compiler's (tiled layouts) are read as scatters."""
    cpu = TPU_FORMS.replace(":T(8,128)", "")
    assert [c.implements for c in parse_collectives(cpu)] == [
        "all-gather", "all-reduce", "all-reduce", "all-reduce"]


# A collective matmul over 4 devices, unrolled into the layer (no windowed loop to name
# it): one permute passes a weight's shard on, another a running partial sum (zeros to
# start, then a matmul's result added), both brought by a dot_general.
UNROLLED = """\
ENTRY %main (w: bf16[2,8], x: bf16[4,2]) -> bf16[4,8] {
  %w = bf16[2,8]{1,0:T(8,128)} parameter(0)
  %x = bf16[4,2]{1,0:T(8,128)} parameter(1)
  %collective-permute.1 = bf16[2,8]{1,0:T(8,128)} collective-permute(%w), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, metadata={op_name="jit(step)/while/body/dot_general"}
  %zero = bf16[] constant(0)
  %zeros = bf16[4,8]{1,0:T(8,128)} broadcast(%zero), dimensions={}
  %dot.1 = bf16[4,8]{1,0:T(8,128)} dot(%x, %collective-permute.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %add.1 = bf16[4,8]{1,0:T(8,128)} add(%zeros, %dot.1)
  ROOT %collective-permute.2 = bf16[4,8]{1,0:T(8,128)} collective-permute(%add.1), channel_id=2, source_target_pairs={{0,3},{1,0},{2,1},{3,2}}, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
}
"""  # noqa: E501


def test_an_unrolled_collective_matmuls_permutes_are_its_gather_and_scatter():
    assert [c.implements for c in parse_collectives(UNROLLED)] == [
        "all-gather", "reduce-scatter"]
