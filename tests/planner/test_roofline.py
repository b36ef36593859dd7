"""The roofline price of each operation: a matmul as the slower of its FLOPs at the chip's
sustained rate (dimensions padded to the MXU tile) and its bytes at HBM speed, float32 at
the f32 rate, streaming work, what remat policies rerun (with the elementwise work around
it), and the optimizer update's bytes (all checked against the formulas of the module
docstring worked out by hand)."""

import dataclasses

import pytest

import jaxpar
from jaxpar.planner import BUILTIN, Candidate
from jaxpar.planner.candidate import local_sizes
from jaxpar.planner.layout import layout
from jaxpar.planner.model import from_transformer
from jaxpar.planner.roofline import (
    compute_times,
    matmul_time,
    memory_time,
    recomputed_parts,
    update_bytes,
    update_time,
)
from tests.planner.cases import TINY


def test_v6e_head_dim_padding_and_memory_bound_matmuls():
    import dataclasses

    from jaxpar.planner.roofline import matmul_time

    v6e, v5p = BUILTIN["tpu-v6e"], BUILTIN["tpu-v5p"]
    # Compute alone (HBM made free): an output 128 wide fills half of v6e's 256-wide MXU,
    # so it costs what 256 wide does; on v5p's 128-wide MXU it costs half.
    fast6, fast5 = (dataclasses.replace(c, hbm_bw=1e18) for c in (v6e, v5p))
    assert matmul_time(fast6, 8192, 8192, 128) == pytest.approx(
        matmul_time(fast6, 8192, 8192, 256), rel=1e-3)
    assert matmul_time(fast5, 8192, 8192, 128) == pytest.approx(
        0.5 * matmul_time(fast5, 8192, 8192, 256), rel=1e-3)
    # A matrix-vector product is bound by HBM, not the MXU.
    gemv = matmul_time(v5p, 1, 8192, 8192)
    assert gemv == pytest.approx(8192 * 8192 * 2 / (v5p.hbm_bw * v5p.memory_efficiency),
                                 rel=0.01)


def test_large_matmul_is_priced_at_the_sustained_peak():
    h100 = BUILTIN["h100"]
    m = k = n = 4096  # multiples of the 128 tile: no padding
    flops = 2 * m * k * n
    assert matmul_time(h100, m, k, n) == pytest.approx(flops / (989e12 * 0.64))
    # float32 runs at the FP32 rate (67 TFLOP/s), 15x slower than bf16 here.
    assert matmul_time(h100, m, k, n, act_bytes=4) == pytest.approx(flops / (67e12 * 0.64))
    # ``batch`` independent products cost ``batch`` times one.
    assert matmul_time(h100, m, k, n, batch=3) == pytest.approx(3 * flops / (989e12 * 0.64))
    # A flash kernel's efficiency scales the rate.
    assert matmul_time(h100, m, k, n, efficiency=0.5) == pytest.approx(
        2 * flops / (989e12 * 0.64))


def test_small_dimensions_are_padded_to_the_tile():
    fast = dataclasses.replace(BUILTIN["tpu-v5p"], hbm_bw=1e18)  # compute only
    # Rows pad to 8, contraction and output to the 128-wide MXU.
    assert matmul_time(fast, 1, 4096, 4096) == pytest.approx(matmul_time(fast, 8, 4096, 4096))
    assert matmul_time(fast, 1024, 100, 4096) == pytest.approx(
        2 * 1024 * 128 * 4096 / (459e12 * 0.76))


def test_fixed_overhead_per_kernel_and_empty_matmuls():
    chip = dataclasses.replace(BUILTIN["h100"], op_overhead_s=1e-3)
    assert matmul_time(chip, 8, 128, 128) == pytest.approx(1e-3, rel=1e-3)
    assert matmul_time(chip, 0, 128, 128) == 0.0  # nothing to run, nothing to launch


def test_memory_time_streams_at_the_sustained_hbm_rate():
    v5p = BUILTIN["tpu-v5p"]
    assert memory_time(v5p, 1e9) == pytest.approx(1e9 / (2765e9 * 0.7))
    assert memory_time(v5p, 0) == 0.0


@pytest.mark.parametrize(("remat", "parts"), [
    ("none", ()),
    ("dots_saveable", ()),
    ("dots_with_no_batch_dims_saveable", ("attention",)),
    ("save_attention_and_mlp_outputs", ("qkv", "gate_up", "attention")),
    ("full", ("qkv", "wo", "gate_up", "down", "attention")),
    ("recompute=qkv+attention", ("qkv", "attention")),
    ("recompute=", ()),
])
def test_recomputed_parts_by_policy(remat, parts):
    assert recomputed_parts(remat) == parts


def test_unknown_recomputed_part_is_named():
    with pytest.raises(jaxpar.JaxparError, match="unknown part 'mlp'.*qkv, wo"):
        recomputed_parts("recompute=qkv+mlp")


def test_update_bytes_follow_the_optimizer_state():
    # Per element of state: read the f32 gradient twice (update, global norm), read and
    # write the f32 master weight and each moment, write the working copy.
    adam_mixed = Candidate.make({"data": 8})  # bf16 compute, AdamW
    assert update_bytes(adam_mixed, 1000, 0) == 1000 * (4 + 4 + 2 * 4 + 2 * 2 * 4 + 2)
    adam_f32 = dataclasses.replace(adam_mixed, precision="float32")  # no working copy
    assert update_bytes(adam_f32, 1000, 0) == 1000 * (4 + 4 + 2 * 4 + 2 * 2 * 4)
    sgd = dataclasses.replace(adam_mixed, optimizer="sgd")  # one moment (momentum)
    assert update_bytes(sgd, 1000, 0) == 1000 * (4 + 4 + 2 * 4 + 2 * 4 + 2)
    # Gradient accumulation reads and writes an f32 running sum each microbatch.
    accumulating = dataclasses.replace(adam_mixed, microbatches=4)
    assert update_bytes(accumulating, 1000, 500) == update_bytes(adam_mixed, 1000, 0) + (
        4 * 8 * 500)
    h100 = BUILTIN["h100"]
    assert update_time(h100, adam_mixed, 1000, 0) == pytest.approx(
        34_000 / (3350e9 * 0.7))


@pytest.mark.parametrize(("parts", "matmul", "elementwise"), [
    # (rerun parts, the rerun matmul (m, k, n) per token row, elementwise elements a token)
    (("wo",), (64, 64), 2 * 64),  # the residual add after the attention projection
    (("qkv",), (64, 16 * (4 + 2 + 2)), 2 * 64 + 2 * (4 + 2) * 16),  # the norm and RoPE
    (("gate_up",), (64, 2 * 256), 2 * 64 + 3 * 256),  # the norm and the gated activation
])
def test_recomputation_reruns_the_elementwise_work_around_its_matmuls(parts, matmul,
                                                                       elementwise):
    spec, chip = from_transformer(TINY), BUILTIN["tpu-v5p"]
    cand = Candidate.make({"data": 1})
    loc = local_sizes(spec, layout(spec, cand.sizes, cand.rules, cand.zero_stage), cand, 2, 16)
    times = compute_times(spec, loc, cand, chip, attention="xla", causal=1.0,
                          recomputed=parts, local_state=0, local_grads=0)
    tokens, act = 2 * 16, 2  # bfloat16 compute
    assert times.parts["recompute"] == pytest.approx(
        matmul_time(chip, tokens, *matmul, act_bytes=act)
        + memory_time(chip, elementwise * tokens * act))
