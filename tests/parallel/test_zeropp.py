"""ZeRO++ on FSDP: int8 weight gathers (qwZ) and int8 gradient reductions (qgZ), read
from the compiled step and checked against the unquantized run and exact sums."""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.analysis.hlo import collective_table, group_axes, parse_collectives
from jaxpar.models import Transformer, TransformerConfig
from jaxpar.parallel.zeropp import _all_reduce_int8, _reduce_scatter_block
from jaxpar.sharding.partitioning import abstract_sharded
from jaxpar.sharding.precision import Policy
from tests import user_models as um

# Tied embeddings: the table is gathered for the output head in every variant, so the
# byte ratios compare like with like (an untied table is looked up in place without
# ZeRO++, see jaxpar.parallel.embedding, and gathered like every weight with it).
CFG = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=256, max_seq_len=32, tie_embeddings=True)
LAYOUTS = {"fsdp8": ({"fsdp": 8}, "fsdp", 0),
           "zero3-data2-fsdp2-tensor2": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp", 3)}


@functools.cache
def _step(layout: str, gather: str, reduce: str, weight_copy: str = "auto"):
    """(bytes per device by (collective kind, axes), losses of three steps) of a
    bf16-compute step."""
    axes, rules, zero = LAYOUTS[layout]
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), rules, zero_stage=zero,
                                   quantize_gather=gather, quantize_reduce=reduce,
                                   weight_copy=weight_copy,
                                   precision=Policy.parse("p=f32,c=bf16,o=f32"))
    step = jaxpar.Trainer(jaxpar.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)),
                                              plan), optax.adam(1e-2), plan)
    batch = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    table: dict[tuple, int] = {}
    for r in collective_table(step.lower(batch).compile().as_text(), plan.mesh):
        key = (r["kind"], tuple(r["axes"]))
        table[key] = table.get(key, 0) + r["bytes_per_device"]
    return table, [float(step.step(batch)["loss"]) for _ in range(3)]


def _bytes(table: dict, kinds: tuple[str, ...], axes: set[str] | None = None) -> int:
    return sum(v for (kind, ax), v in table.items()
               if kind in kinds and (axes is None or set(ax) <= axes))


# --- qwZ ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_int8_weight_gathers_move_a_quarter_of_the_bytes(devices, layout):
    """plan.quantize_gather=int8 (ZeRO++ qwZ): the weights' all-gathers carry int8 and
    per-row scales. XLA:CPU runs bf16 matmuls in f32 and gathers the weights widened, so
    the bytes fall to under 30% of that, under 60% of a bf16 gather;
    no other collective appears, the gradient reductions are unchanged, and three steps'
    losses stay within 5e-3 of the unquantized run's (measured 2.5e-3 and 1.2e-3: the tied
    table is the head too, so its int8 rounding reaches the logits). Both runs store the
    bf16 copy (``plan.weight_copy``), as ZeRO++ does: with the cast in the step, XLA:CPU
    gathers a compile-order-dependent share of the plain run's weights in bf16 instead
    (the 30% bound is about the widened gathers)."""
    plain, plain_losses = _step(layout, "none", "none", "stored")
    quant, quant_losses = _step(layout, "int8", "none", "stored")
    gathered = lambda t: _bytes(t, ("all-gather",))  # noqa: E731
    assert gathered(quant) < 0.3 * gathered(plain)
    assert gathered(quant) < 0.6 * gathered(plain) / 2
    assert set(quant) <= set(plain)
    assert {k: v for k, v in quant.items() if k[0] != "all-gather"} == {
        k: v for k, v in plain.items() if k[0] not in ("all-gather", "collective-permute")}
    assert max(abs(a - b) / b for a, b in zip(quant_losses, plain_losses, strict=True)) < 5e-3


def test_int8_gathers_refuse_streamed_weights():
    with pytest.raises(jaxpar.JaxparError, match="plan.quantize_gather quantizes weights on "
                                                 "the device"):
        jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 8}), "fsdp",
                                quantize_gather="int8", offload_params=True)


# --- qgZ ----------------------------------------------------------------------------------
def _manual(fn, in_spec, out_spec, axes):
    mesh = jaxpar.make_mesh({"data": 2, "fsdp": 4})
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                                 axis_names=set(axes), check_vma=False)), mesh


def test_int8_reduce_scatter_sums_within_quantization_error(devices):
    """Eight devices' different gradients of a [16, 8, 32] weight split over data (dim 0)
    and fsdp (dim 1): each device's block of the int8 hierarchical reduction equals the
    block of the exact sum within the half-steps of int8 rounding, hop by hop."""
    rng = np.random.default_rng(0)
    local = rng.normal(size=(8, 16, 8, 32)).astype(np.float32)  # one gradient per device
    spec = P("data", "fsdp")

    def body(g):
        return _reduce_scatter_block(g[0], spec, mesh, ("data", "fsdp"))

    fn, mesh = _manual(body, P(("data", "fsdp")), spec, ("data", "fsdp"))
    got = np.asarray(fn(local))
    exact = local.sum(axis=0)
    bound = 16 * np.abs(local).max() / 254  # hops over 4 then 2: (4 + 2 x 4) half-steps
    assert got.shape == exact.shape
    assert np.abs(got - exact).max() < bound
    assert np.abs(got - exact).max() > 0  # it did quantize
    assert np.corrcoef(got.ravel(), exact.ravel())[0, 1] > 0.999


def test_int8_all_reduce_over_an_unsplit_axis(devices):
    """A gradient whole over ``data``: the int8 all-to-all + all-gather gives every data
    device the same sum, within two quantization steps."""
    rng = np.random.default_rng(1)
    local = rng.normal(size=(2, 10, 7)).astype(np.float32)  # size not a multiple of rows

    def body(g):
        return _all_reduce_int8(g[0], "data", 2)[None]

    fn, _ = _manual(body, P("data"), P("data"), ("data",))
    got = np.asarray(fn(local))
    np.testing.assert_array_equal(got[0], got[1])
    assert np.abs(got[0] - local.sum(axis=0)).max() < 2 * 2 * np.abs(local).max() / 127


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_int8_gradient_reductions_halve_the_bytes(devices, layout):
    """plan.quantize_reduce=int8 (ZeRO++ qgZ): the gradients' reductions over the
    data-parallel axes become int8 all-to-alls (plus int8 gathers for an unsplit axis),
    at most 60% of the plain step's reduction bytes (which XLA:CPU all-reduces in bf16;
    measured 47% on fsdp 8 and 57% on ZeRO-3, where the plain step reduces over data and
    fsdp in one collective and qgZ goes one axis at a time);
    tensor-parallel collectives are untouched (no weight or gradient is replicated over
    tensor for it); three steps' losses within 2e-3 of the unquantized run's. The plain
    run is the int8-gather test's (its bf16 weight copy stored; the gradient reductions
    do not depend on where the copy is cast), built once for both."""
    plain, plain_losses = _step(layout, "none", "none", "stored")
    quant, quant_losses = _step(layout, "none", "int8")
    dp = {"data", "fsdp"}
    reduced = lambda t: _bytes(t, ("all-reduce", "reduce-scatter"), dp)  # noqa: E731
    sent = _bytes(quant, ("all-to-all",), dp) + reduced(quant)
    assert _bytes(quant, ("all-to-all",), dp) > 0
    assert reduced(quant) < 0.01 * reduced(plain)
    assert sent < 0.6 * reduced(plain)
    tensor = lambda t: {k: v for k, v in t.items() if "tensor" in k[1]}  # noqa: E731
    assert tensor(quant) == tensor(plain)
    assert max(abs(a - b) / b for a, b in zip(quant_losses, plain_losses, strict=True)) < 2e-3


@pytest.mark.parametrize("axes,knobs,message", [
    ({"data": 8}, {}, "splits none"),
    ({"fsdp": 4, "stage": 2}, {}, "pipeline stages"),
    ({"data": 2, "fsdp": 4}, {"compress_gradients": "sign"}, "does not combine"),
    ({"fsdp": 8}, {"microbatches": 2}, "does not combine"),
])
def test_int8_reductions_refuse_what_they_cannot_run(devices, axes, knobs, message):
    with pytest.raises(jaxpar.JaxparError, match=message):  # the model's shapes suffice
        plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), "fsdp_tp",
                                       quantize_reduce="int8", **knobs)
        jaxpar.Trainer(abstract_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan),
                       optax.adam(1e-2), plan)


# --- hpZ ------------------------------------------------------------------------------------
def _loop_bodies(hlo_text: str) -> set[str]:
    """Names of the computations that run as while-loop bodies (the layer scans)."""
    return set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo_text))


def _collectives_by_place(hlo_text: str, mesh) -> dict[str, set[tuple[str, tuple[str, ...]]]]:
    """(kind, mesh axes) of the collectives inside loop bodies and outside them."""
    bodies = _loop_bodies(hlo_text)
    out: dict[str, set] = {"loop": set(), "outside": set()}
    current = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current = head[1]
            continue
        for c in parse_collectives(line):
            axes = group_axes(c.groups, mesh)
            out["loop" if current in bodies else "outside"].add((c.kind, axes))
    return out


def _hpz_trainer(hpz: bool) -> jaxpar.Trainer:
    mesh = jaxpar.make_mesh({"fsdp": 4}, dcn={"data": 2})  # two slices of four devices
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", zero_stage=3, hpz=hpz)
    model = jaxpar.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan)
    return jaxpar.Trainer(model, optax.adam(1e-2), plan)


def test_hpz_keeps_the_layers_gathers_inside_the_slice(devices):
    """ZeRO-3 over two slices x fsdp 4: without hpZ the layer loops gather weights over
    data and fsdp (across slices, every layer, forward and backward); with hpZ every
    gather inside a loop is over fsdp alone and the cross-slice gathers run once, outside;
    the losses are the same."""
    batch = np.random.default_rng(0).integers(0, CFG.vocab_size, (16, 17)).astype(np.int32)
    plain, hpz = _hpz_trainer(False), _hpz_trainer(True)
    mesh = plain.plan.mesh
    before = _collectives_by_place(plain.lower(batch).compile().as_text(), mesh)
    after = _collectives_by_place(hpz.lower(batch).compile().as_text(), mesh)
    assert ("all-gather", ("data", "fsdp")) in before["loop"]
    gathers = {axes for kind, axes in after["loop"] if kind == "all-gather"}
    assert gathers == {("fsdp",)}
    assert any(kind == "all-gather" and "data" in axes for kind, axes in after["outside"])
    want = [float(plain.step(batch)["loss"]) for _ in range(3)]
    got = [float(hpz.step(batch)["loss"]) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_hpz_needs_weights_split_across_slices(devices):
    mesh = jaxpar.make_mesh({"fsdp": 4}, dcn={"data": 2})
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", hpz=True)
    model = abstract_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), plan)  # shapes
    with pytest.raises(jaxpar.JaxparError, match="no weight is split over the data axis"):
        jaxpar.Trainer(model, optax.adam(1e-2), plan)


def _user_step(build, annotations, gather: str, reduce: str):
    """(all-gather and reduce-scatter bytes per device, three losses) of a user's model
    under FSDP over 8 devices, ZeRO-3."""
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 8}), "fsdp", zero_stage=3,
                                   quantize_gather=gather, quantize_reduce=reduce,
                                   annotations=annotations)
    step = jaxpar.Trainer(jaxpar.init_sharded(build, plan), optax.adam(1e-2), plan)
    batch = np.random.default_rng(0).integers(0, um.VOCAB, (8, 17)).astype(np.int32)
    table: dict[tuple, int] = {}
    for r in collective_table(step.lower(batch).compile().as_text(), plan.mesh):
        table[r["kind"]] = table.get(r["kind"], 0) + r["bytes_per_device"]
    return table, [float(step.step(batch)["loss"]) for _ in range(3)]


@pytest.mark.parametrize("kind", ["scan", "linen"])
def test_qwz_and_qgz_on_a_scanned_and_a_linen_model(devices, kind):
    """ScanLM (nnx.vmap stack run by nnx.scan) and LinenGPT (jaxpar.from_linen), both
    halves of ZeRO++ on: the int8 weight gathers move under 60% of the f32 gathers' bytes
    (a quarter plus scales, and the few vectors gathered whole), the gradients are
    exchanged in int8 (LinenGPT: under 60% of the f32 reductions' bytes); three steps'
    losses within 3% of the
    unquantized run's (LinenGPT's tied table, gathered in int8, is its head too: measured
    1.4% at the first step)."""
    if kind == "scan":
        build, names = (lambda: um.ScanLM(rngs=nnx.Rngs(0))), ()
    else:
        build = lambda: jaxpar.from_linen(um.LinenGPT(), np.zeros((2, 8), np.int32))  # noqa
        names = um.GPT_ANNOTATIONS
    plain, plain_losses = _user_step(build, names, "none", "none")
    both, both_losses = _user_step(build, names, "int8", "int8")
    assert both["all-gather"] < 0.6 * plain["all-gather"], (both, plain)
    reduced = lambda t: t.get("reduce-scatter", 0) + t.get("all-reduce", 0)  # noqa: E731
    assert both.get("all-to-all", 0) > 0 and reduced(both) < 0.01 * reduced(plain)
    if kind == "linen":
        assert both["all-to-all"] + reduced(both) < 0.6 * reduced(plain), (both, plain)
    # ScanLM: the int8 exchange measured 56,192 bytes a device against the plain step's
    # 49,304 of all-reduce, so qgZ saves nothing on this model as XLA:CPU lowers it (left
    # open in issue 40's closing note).
    np.testing.assert_allclose(both_losses, plain_losses, rtol=0.03)
