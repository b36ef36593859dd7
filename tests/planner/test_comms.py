"""The collectives of a step and their time. Bytes per step are checked against counts
worked out by hand from the module docstring: data parallelism all-reduces every
gradient; ZeRO 1-3 trade that for reduce-scatters and parameter gathers (XLA:CPU
all-reduces instead of reduce-scattering); Megatron tensor parallelism all-reduces the
activations 4 times a layer on TPU (7 on XLA:CPU, 2 more under remat), or reduce-scatters
and all-gathers them under sequence parallelism; ring attention passes K/V blocks
``context - 1`` times each way; experts move their dispatch buffer by 4 all-to-alls a
layer; a pipeline sends activations once per iteration each way. Times: latency per ring
step plus ``2 (n-1)/n`` (all-reduce) or ``(n-1)/n`` of the payload over the axis
bandwidth, hierarchically over ICI and then DCN."""

import pytest

from jaxpar.models import TransformerConfig
from jaxpar.planner import Candidate, parse_chips
from jaxpar.planner.comms import collectives, transfers
from jaxpar.planner.layout import layout
from jaxpar.planner.links import Transfer, transfer_time
from jaxpar.planner.model import from_transformer
from tests.planner.cases import TINY, TINY_LAYER_PARAMS, TINY_PARAMS

MOE = TransformerConfig(**{**vars(TINY), "n_experts": 4, "experts_per_token": 2,
                           "expert_d_ff": 64, "expert_capacity": 1.25})


def test_collective_time_is_latency_plus_bytes_over_the_axis_bandwidth():
    from jaxpar.planner.links import Transfer, transfer_time

    machine = parse_chips("tpu-v5p:64")
    cand = Candidate.make({"fsdp": 64})
    chip = machine.chip
    small = transfer_time(Transfer("all-gather", ("fsdp",), 1.0, 1, "forward"), cand, machine)
    assert small == pytest.approx(63 * chip.ici_latency_s, rel=0.01)
    big = transfer_time(Transfer("all-gather", ("fsdp",), 1e9, 1, "forward"), cand, machine)
    # 64 chips of a 4x4x4 torus: the axis spans all three dimensions, 2 links each.
    bw = 6 * chip.ici_link_bw * chip.collective_efficiency
    assert big == pytest.approx(63 * chip.ici_latency_s + 63 / 64 * 1e9 / bw, rel=0.01)
    # An 8-GPU axis inside an NVLink node is faster than one across nodes.
    h100 = parse_chips("h100:16")
    inside = transfer_time(Transfer("all-reduce", ("fsdp",), 1e9, 1, "gradient"),
                           Candidate.make({"fsdp": 8}, {"data": 2}), h100)
    across = transfer_time(Transfer("all-reduce", ("data",), 1e9, 1, "gradient"),
                           Candidate.make({"fsdp": 8}, {"data": 2}), h100)
    assert across > 3 * inside


def _rows(cfg: TransformerConfig, cand: Candidate, global_batch: int, seq: int,
          backend: str = "tpu") -> dict[tuple[str, tuple[str, ...]], dict]:
    spec = from_transformer(cfg, stages=cand.sizes["stage"])
    lay = layout(spec, cand.sizes, cand.rules, cand.zero_stage)
    rows = collectives(spec, lay, cand, global_batch, seq, backend)
    return {(r["kind"], tuple(r["axes"])): r for r in rows}


def test_data_parallel_all_reduces_every_gradient_once():
    cand = Candidate.make({"data": 8}, rules="dp", precision="float32")
    rows = _rows(TINY, cand, 16, 64)
    assert list(rows) == [("all-reduce", ("data",))]
    row = rows["all-reduce", ("data",)]
    assert row["bytes_per_step"] == 4 * TINY_PARAMS
    # The HLO text holds the layer loop's reductions once: one layer's share.
    assert row["bytes_per_device"] == 4 * (TINY_PARAMS - 2 * TINY_LAYER_PARAMS
                                           + TINY_LAYER_PARAMS)
    assert row["exposed_bytes_per_step"] == 0  # hidden under the backward pass


@pytest.mark.parametrize(("zero", "expected"), [
    # ZeRO-1: the full gradient all-reduced, the updated parameters gathered from shards.
    (1, {("all-reduce", ("data",)): 2 * TINY_PARAMS, ("all-gather", ("data",)): 2 * TINY_PARAMS}),
    # ZeRO-2: each device keeps 1/8 of the reduced gradient (reduce-scatter).
    (2, {("reduce-scatter", ("data",)): 2 * TINY_PARAMS / 8,
         ("all-gather", ("data",)): 2 * TINY_PARAMS}),
])
def test_zero_1_and_2_on_an_accelerator(zero, expected):
    rows = _rows(TINY, Candidate.make({"data": 8}, rules="dp", zero_stage=zero), 16, 64)
    assert {k: r["bytes_per_step"] for k, r in rows.items()} == pytest.approx(expected)


def test_zero_3_gathers_parameters_for_the_forward_and_backward_passes():
    cand = Candidate.make({"data": 8}, rules="dp", zero_stage=3)
    spec = from_transformer(TINY)
    lay = layout(spec, cand.sizes, cand.rules, cand.zero_stage)
    rows, moves = transfers(spec, lay, cand, 16, 64)
    by_kind = {r["kind"]: r for r in rows}
    assert set(by_kind) == {"all-gather", "reduce-scatter"}
    assert by_kind["reduce-scatter"]["bytes_per_step"] == pytest.approx(2 * TINY_PARAMS / 8)
    forward = sum(t.nbytes * t.runs for t in moves
                  if t.kind == "all-gather" and t.phase == "forward")
    assert forward == 2 * TINY_PARAMS  # every parameter, in bf16, once
    # The HLO text: one gather per tensor outside the layer loop, and two (forward and
    # backward) of one layer's slice of each stacked tensor inside it.
    outside = TINY_PARAMS - 2 * TINY_LAYER_PARAMS
    assert by_kind["all-gather"]["bytes_per_device"] == 2 * (outside + 2 * TINY_LAYER_PARAMS)
    # Unstacked: embed, final norm, head; stacked: 2 norms, q, k, v, o, gate, up, down.
    assert by_kind["all-gather"]["count"] == 3 + 2 * 9


def test_xla_cpu_all_reduces_where_accelerators_reduce_scatter():
    cand = Candidate.make({"data": 8}, rules="dp", zero_stage=2)
    rows = _rows(TINY, cand, 16, 64, backend="cpu")
    # bf16 is upcast to f32 before it is sent on XLA:CPU.
    assert {k: r["bytes_per_step"] for k, r in rows.items()} == pytest.approx({
        ("all-reduce", ("data",)): 4 * TINY_PARAMS, ("all-gather", ("data",)): 4 * TINY_PARAMS})


@pytest.mark.parametrize(("backend", "remat", "per_layer", "wire"), [
    ("tpu", "none", 2 + 2, 2),  # attention and MLP outputs; one input gradient each
    ("cpu", "none", 2 + 5, 4),  # one input gradient per column-parallel projection
    ("tpu", "full", 2 + 2 + 2, 2),  # remat reruns the forward's two
])
def test_tensor_parallel_activation_all_reduces(backend, remat, per_layer, wire):
    rows = _rows(TINY, Candidate.make({"data": 4, "tensor": 2}, remat=remat), 16, 64, backend)
    tokens = 16 // 4 * 64  # per device: the batch split over data only
    row = rows["all-reduce", ("tensor",)]
    # Per layer, plus the vocab-parallel embedding's output and the head's input gradient.
    assert row["executions"] == 2 * per_layer + 2
    assert row["bytes_per_step"] == (2 * per_layer + 2) * tokens * 64 * wire
    assert row["exposed_bytes_per_step"] == row["bytes_per_step"]


def test_sequence_parallel_moves_the_same_activations_in_two_halves():
    cand = Candidate.make({"data": 4, "tensor": 2}, sequence_parallel=True)
    rows = _rows(TINY, cand, 16, 64)
    activations = (2 * 4 + 2) * (16 // 4 * 64) * 64 * 2
    assert ("all-reduce", ("tensor",)) not in rows
    assert rows["all-gather", ("tensor",)]["bytes_per_step"] == activations
    assert rows["reduce-scatter", ("tensor",)]["bytes_per_step"] == activations / 2


def test_context_parallel_key_value_traffic():
    seqs, seq, c = 8 // 2, 256, 4
    block = seqs * seq // c * 2 * 16 * 2  # local tokens x KV heads x head_dim, bf16
    ring = _rows(TINY, Candidate.make({"data": 2, "context": c}, context_attention="ring"),
                 8, seq)
    # K and V blocks passed c - 1 times forward, their cotangents c - 1 times backward.
    assert ring["collective-permute", ("context",)]["bytes_per_step"] == (
        2 * 2 * (c - 1) * block * TINY.n_layers)
    gather = _rows(TINY, Candidate.make({"data": 2, "context": c}), 8, seq)
    assert gather["all-gather", ("context",)]["bytes_per_step"] == 2 * c * block * 2
    assert gather["reduce-scatter", ("context",)]["bytes_per_step"] == 2 * block * 2
    assert ("collective-permute", ("context",)) not in gather


@pytest.mark.parametrize(("remat", "per_layer"), [("none", 4), ("full", 6)])
def test_expert_dispatch_and_combine_all_to_alls(remat, per_layer):
    rows = _rows(MOE, Candidate.make({"data": 2, "expert": 4}, remat=remat), 16, 64)
    # 16 sequences over data x expert: 2 a device; 2.5 slots a token (2 choices, 1.25).
    buffer = 2 * 64 * 2.5 * 64 * 2
    row = rows["all-to-all", ("expert",)]
    assert row["bytes_per_step"] == pytest.approx(per_layer * 2 * buffer)
    # Expert weights are reduced over data only; dense ones over data and expert.
    assert ("all-reduce", ("data",)) in rows and ("all-reduce", ("data", "expert")) in rows


def test_pipeline_sends_one_microbatch_per_iteration_each_way():
    cfg = TransformerConfig(**{**vars(TINY), "n_layers": 4})
    cand = Candidate.make({"data": 4, "stage": 2}, pipeline_microbatches=4)
    rows = _rows(cfg, cand, 16, 64)
    iterations = 2 * 4 + 2 - 1  # 2 layers a stage x 4 microbatches, plus the fill
    activations = 16 // 4 // 4 * 64 * 64 * 2  # one sequence of 64 tokens, bf16
    assert rows["collective-permute", ("stage",)]["bytes_per_step"] == (
        2 * iterations * activations)


def test_all_reduce_moves_twice_the_bytes_of_a_gather():
    h100 = parse_chips("h100:8")
    cand = Candidate.make({"fsdp": 8})
    lat, bw = 5e-6, 450e9 * 0.8  # NVLink one way, at the collective efficiency
    reduce = transfer_time(Transfer("all-reduce", ("fsdp",), 1e9, 3, "gradient"), cand, h100)
    assert reduce == pytest.approx(3 * (2 * 7 * lat + 2 * 7 / 8 * 1e9 / bw))
    # A reduce-scatter's payload is its input: 8 x the 1e8 bytes each device keeps.
    scatter = transfer_time(Transfer("reduce-scatter", ("fsdp",), 1e8, 1, "gradient"), cand,
                            h100)
    assert scatter == pytest.approx(7 * lat + 7 / 8 * 8e8 / bw)


def test_permute_on_a_torus_uses_one_direction_of_the_links():
    v5p = parse_chips("tpu-v5p:64")
    cand = Candidate.make({"fsdp": 16, "context": 4})
    t = transfer_time(Transfer("collective-permute", ("context",), 1e8, 2, "forward"), cand,
                      v5p)
    # 4 chips span one torus dimension: 2 links of 90 GB/s, one of them each way.
    assert t == pytest.approx(2 * (2e-6 + 1e8 / (90e9 * 0.8)))


def test_transfers_across_slices_pay_the_dcn():
    h100 = parse_chips("h100:16")
    lat, dcn_lat, bw, dcn = 5e-6, 1e-5, 450e9 * 0.8, 50e9 * 0.8
    both = Candidate.make({"data": 8}, {"data": 2})
    t = transfer_time(Transfer("all-reduce", ("data",), 1e9, 1, "gradient"), both, h100)
    # Inside the node over NVLink, then 1/8 of the buffer per GPU over InfiniBand.
    assert t == pytest.approx(14 * lat + 1.75e9 / bw + 2 * dcn_lat + 1e9 / 8 / dcn)
    experts = Candidate.make({"data": 2, "expert": 4}, {"expert": 2})
    a2a = transfer_time(Transfer("all-to-all", ("expert",), 1e9, 1, "exposed"), experts, h100)
    gather = transfer_time(Transfer("all-gather", ("expert",), 1e9, 1, "forward"), experts,
                           h100)
    # An all-to-all sends every byte bound for the other node itself; a gather shares it.
    assert a2a == pytest.approx(3 * lat + 0.75e9 / bw + dcn_lat + 0.5e9 / dcn)
    assert a2a - gather == pytest.approx(0.5 * (1e9 - 1e9 / 4) / dcn)
