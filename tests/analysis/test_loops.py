"""How often each computation of a compiled step runs (jaxpar.analysis.loops): trip counts
read from a loop's counter (start, step, bound) on hand-written HLO in the forms the TPU
compiler writes, checked on CPU programs against XLA's own ``known_trip_count`` and against
the same program unrolled (every collective written out once)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.analysis.hlo import collective_table, matmul_flops
from jaxpar.analysis.loops import computation_runs, parse_module

# Loops as the TPU compiler leaves them (no known_trip_count): ``step1`` counts 0..4 by 1
# (5 trips); ``step2`` (in step1's body) counts 0..11 by 2 through copies and a fused
# condition (6 trips, so its body runs 30 times); ``peeled`` starts at 1 and runs while
# i <= 3 (3 trips); ``down`` counts 10 down to 0 exclusive by 5, its bound on the left
# (2 trips); ``opaque`` compares with a runtime value (counted once, reported).
LOOPS = """\
HloModule loops

%cond1 (c1: (s32[], f32[4])) -> pred[] {
  %c1 = (s32[], f32[4]{0}) parameter(0)
  %i1 = s32[] get-tuple-element(%c1), index=0
  %n1 = s32[] constant(5)
  ROOT %lt1 = pred[] compare(%i1, %n1), direction=LT
}

%fused_lt (fa: s32[], fb: s32[]) -> pred[] {
  %fa = s32[] parameter(0)
  %fb = s32[] parameter(1)
  ROOT %lt2 = pred[] compare(%fa, %fb), direction=LT
}

%cond2 (c2: (f32[4], s32[])) -> pred[] {
  %c2 = (f32[4]{0}, s32[]{:T(128)}) parameter(0)
  %i2 = s32[]{:T(128)} get-tuple-element(%c2), index=1
  %n2 = s32[]{:T(128)} constant(12)
  ROOT %f2 = pred[] fusion(%i2, %n2), kind=kLoop, calls=%fused_lt
}

%body2 (b2: (f32[4], s32[])) -> (f32[4], s32[]) {
  %b2 = (f32[4]{0}, s32[]{:T(128)}) parameter(0)
  %x2 = f32[4]{0} get-tuple-element(%b2), index=0
  %j2 = s32[]{:T(128)} get-tuple-element(%b2), index=1
  %k2 = s32[]{:T(128)S(6)} copy(%j2)
  %two = s32[]{:T(128)} constant(2)
  %next2 = s32[]{:T(128)} add(%k2, %two)
  %y2 = f32[4]{0} all-reduce(%x2), replica_groups={{0,1}}, to_apply=%sum
  ROOT %t2 = (f32[4]{0}, s32[]{:T(128)}) tuple(%y2, %next2)
}

%body1 (b1: (s32[], f32[4])) -> (s32[], f32[4]) {
  %b1 = (s32[], f32[4]{0}) parameter(0)
  %i0 = s32[] get-tuple-element(%b1), index=0
  %x1 = f32[4]{0} get-tuple-element(%b1), index=1
  %zero = s32[] constant(0)
  %z1 = s32[] copy(%zero)
  %init2 = (f32[4]{0}, s32[]) tuple(%x1, %z1)
  %w2 = (f32[4]{0}, s32[]) while(%init2), condition=%cond2, body=%body2
  %y1 = f32[4]{0} get-tuple-element(%w2), index=0
  %g1 = f32[8]{0} all-gather(%y1), replica_groups={{0,1}}, dimensions={0}
  %one = s32[] constant(1)
  %next1 = s32[] add(%i0, %one)
  ROOT %t1 = (s32[], f32[4]{0}) tuple(%next1, %y1)
}

%cond3 (c3: (s32[])) -> pred[] {
  %c3 = (s32[]) parameter(0)
  %i3 = s32[] get-tuple-element(%c3), index=0
  %n3 = s32[] constant(3)
  ROOT %le3 = pred[] compare(%i3, %n3), direction=LE
}

%body3 (b3: (s32[])) -> (s32[]) {
  %b3 = (s32[]) parameter(0)
  %i4 = s32[] get-tuple-element(%b3), index=0
  %one3 = s32[] constant(1)
  %a3 = s32[] add(%one3, %i4)
  ROOT %t3 = (s32[]) tuple(%a3)
}

%cond4 (c4: (s32[])) -> pred[] {
  %c4 = (s32[]) parameter(0)
  %i5 = s32[] get-tuple-element(%c4), index=0
  %n4 = s32[] constant(0)
  ROOT %gt4 = pred[] compare(%n4, %i5), direction=LT
}

%body4 (b4: (s32[])) -> (s32[]) {
  %b4 = (s32[]) parameter(0)
  %i6 = s32[] get-tuple-element(%b4), index=0
  %five = s32[] constant(5)
  %s4 = s32[] subtract(%i6, %five)
  ROOT %t4 = (s32[]) tuple(%s4)
}

%cond5 (c5: (s32[], s32[])) -> pred[] {
  %c5 = (s32[], s32[]) parameter(0)
  %i7 = s32[] get-tuple-element(%c5), index=0
  %n5 = s32[] get-tuple-element(%c5), index=1
  ROOT %lt5 = pred[] compare(%i7, %n5), direction=LT
}

%body5 (b5: (s32[], s32[])) -> (s32[], s32[]) {
  %b5 = (s32[], s32[]) parameter(0)
  %i8 = s32[] get-tuple-element(%b5), index=0
  %n6 = s32[] get-tuple-element(%b5), index=1
  %one5 = s32[] constant(1)
  %a5 = s32[] add(%i8, %one5)
  ROOT %t5 = (s32[], s32[]) tuple(%a5, %n6)
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[4], n: s32[]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %n = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %init1 = (s32[], f32[4]{0}) tuple(%c0, %x)
  %step1 = (s32[], f32[4]{0}) while(%init1), condition=%cond1, body=%body1
  %c1s = s32[] constant(1)
  %init3 = (s32[]) tuple(%c1s)
  %peeled = (s32[]) while(%init3), condition=%cond3, body=%body3
  %c10 = s32[] constant(10)
  %init4 = (s32[]) tuple(%c10)
  %down = (s32[]) while(%init4), condition=%cond4, body=%body4
  %init5 = (s32[], s32[]) tuple(%c0, %n)
  %opaque = (s32[], s32[]) while(%init5), condition=%cond5, body=%body5
  ROOT %out = f32[4]{0} get-tuple-element(%step1), index=1
}
"""


def test_trip_counts_are_read_from_each_loops_counter():
    runs = computation_runs(LOOPS)
    found = {lp.name: (lp.trips, lp.how, lp.start, lp.step, lp.bound) for lp in runs.loops}
    assert found == {
        "step1": (5, "induction", 0, 1, 5),
        "w2": (6, "induction", 0, 2, 12),
        "peeled": (3, "induction", 1, 1, 3),
        "down": (2, "induction", 10, -5, 0),
        "opaque": (None, "unknown", None, None, None),
    }
    assert [lp.name for lp in runs.unknown] == ["opaque"]
    assert runs.runs["body1"] == 5 and runs.runs["body2"] == 30  # nested: 5 x 6
    assert runs.runs["body3"] == 3 and runs.runs["body5"] == 1 and runs.runs["main"] == 1


def test_collectives_are_counted_per_step():
    """The all-reduce in the inner loop runs 30 times, the all-gather in the outer 5."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    rows = {r["kind"]: r for r in collective_table(LOOPS, mesh)}
    assert (rows["all-reduce"]["count"], rows["all-reduce"]["executions"]) == (1, 30)
    assert rows["all-reduce"]["bytes_per_step"] == 30 * 16
    assert (rows["all-gather"]["executions"], rows["all-gather"]["bytes_per_step"]) == (5, 160)


def _strip_known(text: str) -> str:
    return re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)


def test_cpu_loops_read_from_their_counters_agree_with_xla(devices):
    """Loops of steps 1 and 2, nested, and a scan: the counter's reading equals the trip
    count XLA:CPU records (removed from the text before reading)."""
    def f(x):
        def inner(c):
            i, y = c
            return i + 2, jnp.sin(y) * 1.01

        def outer(y, _):
            return jax.lax.while_loop(lambda c: c[0] < 9, inner, (1, y))[1] @ y.T @ y, None

        y = jax.lax.scan(outer, x, None, length=7)[0]
        return jax.lax.fori_loop(3, 11, lambda i, y: y * i, y)

    text = jax.jit(f).lower(jnp.ones((4, 4))).compile().as_text()
    xla = {lp.name: lp.trips for lp in computation_runs(text).loops}
    assert sorted(t for t in xla.values()) == [4, 7, 8]  # (9 - 1) / 2; 7; 11 - 3
    read = computation_runs(_strip_known(text))
    assert {lp.name: lp.trips for lp in read.loops} == xla
    assert {lp.how for lp in read.loops} == {"induction"}


@pytest.fixture(scope="module")
def layer_stack(devices):
    """Six layers of a matmul whose contraction is split over ``b``: one all-reduce each."""
    mesh = Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    x = jax.device_put(jnp.ones((8, 32)), NamedSharding(mesh, P("a", "b")))
    ws = jax.device_put(jnp.ones((6, 32, 32)), NamedSharding(mesh, P(None, "b", None)))

    def stack(unroll):
        def f(x, ws):
            def layer(h, w):
                out = jax.lax.with_sharding_constraint(jnp.tanh(h @ w),
                                                       NamedSharding(mesh, P("a", "b")))
                return out, None
            return jax.lax.scan(layer, x, ws, unroll=unroll)[0]
        return jax.jit(f).lower(x, ws).compile().as_text()

    return mesh, stack(1), stack(True)


def test_a_scanned_stack_counts_what_its_unrolled_twin_writes_out(layer_stack):
    """An independent count: unrolled, every collective and dot is written out once per
    layer; the scanned program's per-step figures equal that count."""
    mesh, scanned, unrolled = layer_stack
    loop, flat = collective_table(scanned, mesh), collective_table(unrolled, mesh)
    assert [r["count"] for r in loop] == [1] and [r["count"] for r in flat] == [6]
    per_step = [{k: r[k] for k in ("kind", "axes", "executions", "bytes_per_step")}
                for r in loop]
    assert per_step == [{"kind": "all-reduce", "axes": ["b"], "executions": 6,
                         "bytes_per_step": flat[0]["bytes_per_device"]}]
    assert matmul_flops(scanned)["flops"] == matmul_flops(unrolled)["flops"] == 6 * 2 * 4 * 32 * 8
    stripped = computation_runs(_strip_known(scanned))
    assert [lp.trips for lp in stripped.loops] == [6]


def test_parse_module_reads_operands_and_roots():
    module = parse_module(LOOPS)
    assert module.entry == "main"
    assert module.by_name["next2"].operands == ["k2", "two"]
    assert module.root("body1").name == "t1"
    assert module.parameter("fused_lt", 1).name == "fb"
