"""Candidates: mesh axes from dicts, their sizes and descriptions, element sizes, and the
per-device shapes of one microbatch (worked out by hand for a small model)."""

import dataclasses

import pytest

import jaxpar
from jaxpar.models import TransformerConfig
from jaxpar.planner.candidate import (
    Candidate,
    dtype_bytes,
    local_sizes,
    pipe_microbatches,
)
from jaxpar.planner.layout import layout
from jaxpar.planner.model import from_transformer
from tests.planner.cases import TINY


def _local(cfg: TransformerConfig, cand: Candidate, global_batch: int, seq: int):
    spec = from_transformer(cfg)
    return local_sizes(spec, layout(spec, cand.sizes, cand.rules, cand.zero_stage), cand,
                       global_batch, seq)


def test_make_fills_every_axis_and_multiplies_ici_by_dcn():
    cand = Candidate.make({"fsdp": 4, "tensor": 2}, {"data": 2})
    assert cand.sizes == {"data": 2, "stage": 1, "fsdp": 4, "expert": 1, "context": 1,
                          "tensor": 2}
    assert cand.n_devices == 16 and cand.context == 1 and cand.expert == 1
    assert cand.mesh_dict()["data"] == {"size": 2, "ici": 1, "dcn": 2}
    assert cand.mesh_dict()["fsdp"] == {"size": 4, "ici": 4, "dcn": 1}
    assert Candidate.make({"context": 4, "expert": 2}).context == 4
    assert Candidate.make({"context": 4, "expert": 2}).expert == 2


def test_describe_names_the_split_axes_and_knobs():
    assert Candidate.make({}).describe() == "single"
    assert Candidate.make({"fsdp": 4, "tensor": 2}, {"data": 2}).describe() == (
        "fsdp=4 x tensor=2 (dcn data=2)")
    sp = Candidate.make({"data": 4, "tensor": 2}, sequence_parallel=True)
    assert sp.describe() == "data=4 x tensor=2 +sp"
    # Sequence parallelism without a tensor axis does nothing, and is not shown.
    assert Candidate.make({"data": 8}, sequence_parallel=True).describe() == "data=8"
    ring = Candidate.make({"data": 2, "context": 4}, context_attention="ring")
    assert ring.describe() == "data=2 x context=4 (ring)"
    vocab = Candidate.make({"fsdp": 8}, vocab_over_fsdp=True)
    assert vocab.describe() == "fsdp=8 +vocab/fsdp"
    assert Candidate.make({"data": 8}, vocab_over_fsdp=True).describe() == "data=8"


@pytest.mark.parametrize(("dtype", "size"), [("float32", 4), ("f32", 4), ("bfloat16", 2),
                                             ("bf16", 2), ("float16", 2)])
def test_dtype_bytes(dtype, size):
    assert dtype_bytes(dtype) == size


def test_unknown_precision_is_named():
    with pytest.raises(jaxpar.JaxparError, match="unknown precision 'int8'"):
        dtype_bytes("int8")


def test_pipeline_microbatches_default_to_one_per_stage():
    assert pipe_microbatches(Candidate.make({"stage": 4}), 4) == 4
    assert pipe_microbatches(Candidate.make({"stage": 4}, pipeline_microbatches=8), 4) == 8


def test_local_sizes_of_data_context_and_tensor_splits():
    cand = Candidate.make({"data": 2, "context": 2, "tensor": 2}, microbatches=2)
    loc = _local(TINY, cand, global_batch=8, seq=64)
    # 8 sequences over data=2, in 2 microbatches: 2 a device; each split in 2 by context.
    assert loc.seqs == 2 and loc.tokens == 2 * 64 / 2
    assert (loc.seq, loc.seq_local, loc.context, loc.tp) == (64, 32, 2, 2)
    # 4 heads, 2 KV heads, d_ff 256 and vocab 256 halved by tensor=2.
    assert (loc.heads, loc.kv_heads, loc.d_ff, loc.vocab) == (2, 1, 128, 128)
    assert loc.ff_per_token == 128 and loc.residual_split == 1
    sp = _local(TINY, dataclasses.replace(cand, sequence_parallel=True), 8, 64)
    assert sp.seq_parallel and sp.residual_split == 2


def test_dimensions_that_do_not_divide_the_tensor_axis_stay_whole():
    loc = _local(TINY, Candidate.make({"data": 2, "tensor": 4}), global_batch=8, seq=64)
    assert (loc.heads, loc.kv_heads, loc.d_ff, loc.vocab) == (1, 2, 64, 64)  # 2 KV heads
    assert loc.seqs == 4 and loc.tokens == 4 * 64


def test_local_sizes_of_a_mixture_of_experts():
    cfg = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=256, n_experts=4, experts_per_token=2, expert_d_ff=64,
                            n_shared_experts=1, expert_capacity=1.25)
    loc = _local(cfg, Candidate.make({"data": 4, "tensor": 2}), global_batch=8, seq=64)
    # Two choices a token, 25% capacity padding: 2.5 expert slots per routed token.
    assert loc.slots == pytest.approx(2.5)
    assert loc.dispatched == pytest.approx(2 * 64 * 2.5)
    assert (loc.expert_ff, loc.shared_ff) == (32, 32)
    assert loc.ff_per_token == pytest.approx(2.5 * 32 + 32)
    dropless = dataclasses.replace(cfg, expert_capacity=0.0)
    assert _local(dropless, Candidate.make({"data": 8}), 8, 64).slots == 2
