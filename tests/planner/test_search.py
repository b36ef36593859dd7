"""The search: which context and expert sizes and which meshes it tries, that it ranks
fitting plans by step time (and falls back to the leanest when nothing fits), that its
bound skips pricing but never a plan; plus whole searches on published model sizes."""

import math
import time

import pytest

from jaxpar.models import TransformerConfig
from jaxpar.planner import BUILTIN, parse_chips, plan
from jaxpar.planner.api import resolve_model
from jaxpar.planner.model import from_transformer
from jaxpar.planner.search import context_sizes, expert_sizes, meshes, search
from tests.planner.cases import MIXTRAL, TINY


def test_llama_7b_on_v5p_256_fits_and_is_sane():
    plans = plan("configs/llama-7b.yaml", chips="tpu-v5p:256", global_batch=512, seq=4096)
    best = plans[0]
    assert best.fits and best.memory_per_device_bytes < 95 * 2**30
    assert best.candidate.n_devices == 256
    # Executed FLOPs never beat the chip's sustained matmul rate; MFU counts full s x s
    # attention, which splash halves by skipping masked blocks, so it may sit above it.
    eff = BUILTIN["tpu-v5p"].matmul_efficiency
    assert best.flops / (best.step_time_s * 459e12) <= eff
    assert 0.2 < best.mfu <= eff + 0.05
    assert best.reason and all(p.step_time_s >= best.step_time_s * 0.99 for p in plans)
    # 6 N D: the step must take at least the FLOPs at peak.
    assert best.step_time_s > 6 * 6.7e9 * 512 * 4096 / (459e12 * 256)


def test_1024_chip_plan_answers_quickly_ranked_by_absolute_step_time():
    start = time.perf_counter()
    plans = plan("configs/llama-70b.yaml", chips="tpu-v5p:1024", global_batch=1024, seq=4096)
    assert time.perf_counter() - start < 60  # the CLI target is 10 s; generous under load
    assert plans and plans[0].fits and plans[0].candidate.n_devices == 1024
    # Regression: ranking by step time relative to each plan's own compute put full-remat
    # plans (more compute, so a smaller ratio) ahead of faster ones.
    times = [p.step_time_s for p in plans]
    assert all(b >= a * 0.995 for a, b in zip(times, times[1:], strict=False)), times
    assert plans[0].candidate.remat != "full"


def test_70b_at_128k_on_v5p_uses_context_parallelism():
    plans = plan("configs/llama-70b.yaml", chips="tpu-v5p:512", global_batch=64, seq=131072,
                 top=2)
    best = plans[0]
    assert best.fits and best.memory_per_device_bytes < 0.9 * 95 * 2**30
    assert best.candidate.context > 1 and 131072 % (2 * best.candidate.context) == 0
    assert "context parallelism" in best.reason and "context=1" in best.reason
    # Without a context axis a whole 128k sequence sits on each device: the best such plan
    # must recompute part of each layer to fit (splash keeps no score-sized buffers, so
    # saving the attention and MLP outputs, split by sequence parallelism, fits), and is
    # slower.
    flat = plan("configs/llama-70b.yaml", chips="tpu-v5p:512", global_batch=64, seq=131072,
                top=1, context=1)[0]
    assert flat.candidate.context == 1 and flat.candidate.remat != "none"
    assert flat.step_time_s > best.step_time_s
    # With fewer sequences than 512 chips can take whole, nothing runs without context.
    small = plan("configs/llama-70b.yaml", chips="tpu-v5p:512", global_batch=32, seq=131072,
                 top=1, context=1)
    assert not small or not small[0].fits
    assert plan("configs/llama-70b.yaml", chips="tpu-v5p:512", global_batch=32, seq=131072,
                top=1)[0].candidate.context > 1


def test_mixtral_on_h100_uses_expert_parallelism():
    """On 16 H100s Mixtral's experts do not fit gathered whole: the first plan splits them
    over an expert axis. (On 64, ZeRO-3 over 64 devices fits, and the planner finds it
    faster.)"""
    best = plan(MIXTRAL, chips="h100:16", global_batch=256, seq=4096, top=2)[0]
    assert best.fits and best.candidate.expert > 1
    assert 8 % best.candidate.expert == 0
    assert "expert parallelism" in best.reason
    assert any(k.startswith("all-to-all") for k in best.comm_s)


MOE = TransformerConfig(**{**vars(TINY), "n_experts": 8, "experts_per_token": 2})


# (chips, seq, global batch, allowed, context sizes). Powers of two dividing a slice that
# leave each shard 1024 positions or more; only for sequences of 16384 or more, or batches
# too small to give every chip a whole sequence.
CONTEXTS = [
    ("tpu-v5p:512", 131072, 64, None, [1, 2, 4, 8, 16, 32, 64, 128]),
    ("tpu-v5p:512", 4096, 512, None, [1]),
    ("tpu-v5p:512", 4096, 64, None, [1, 2, 4]),
    ("tpu-v5p:512", 131072, 64, (1, 3, 4), [1, 4]),
    ("h100:64", 131072, 64, None, [1, 2, 4, 8]),  # a node of 8 GPUs
]


@pytest.mark.parametrize(("chips", "seq", "batch", "allowed", "sizes"), CONTEXTS)
def test_context_sizes(chips, seq, batch, allowed, sizes):
    assert context_sizes(from_transformer(TINY), parse_chips(chips), seq, batch,
                         allowed) == sizes


def test_expert_sizes_divide_the_experts_and_the_slice():
    moe = from_transformer(MOE)
    assert expert_sizes(moe, parse_chips("h100:64")) == [1, 2, 4, 8]
    assert expert_sizes(moe, parse_chips("tpu-v5p:12")) == [1, 2, 4]
    assert expert_sizes(moe, parse_chips("h100:64"), (1, 8)) == [1, 8]
    assert expert_sizes(from_transformer(TINY), parse_chips("h100:64")) == [1]
    dropless = from_transformer(TransformerConfig(**{**vars(MOE), "expert_capacity": 0.0}))
    assert expert_sizes(dropless, parse_chips("h100:64")) == [1]


def test_meshes_cover_the_machine_and_keep_tensor_parallelism_in_a_node():
    found = list(meshes(from_transformer(TINY), parse_chips("h100:16"), seq=64,
                        global_batch=64))
    assert found and len(found) == len({(tuple(i.items()), tuple(d.items()))
                                        for i, d in found})
    for ici, dcn in found:
        assert math.prod(ici.values()) == 8 and math.prod(dcn.values()) == 2
        assert ici["tensor"] <= 8 and ici["context"] == ici["expert"] == 1
        assert 2 % (ici["stage"] * dcn["stage"]) == 0  # stages divide the 2 layers
    assert any(d["stage"] == 2 for _, d in found) and any(i["tensor"] == 8 for i, _ in found)
    # No pipeline with experts; with pipelines off, no stage axis at all.
    assert all(i["stage"] == d["stage"] == 1
               for i, d in meshes(from_transformer(MOE), parse_chips("h100:16")))
    assert all(i["stage"] == d["stage"] == 1
               for i, d in meshes(from_transformer(TINY), parse_chips("h100:16"),
                                  stages=False))


def test_search_ranks_fitting_plans_by_step_time():
    result = search(lambda s: from_transformer(TINY, stages=s), parse_chips("h100:8"), 16,
                    128, top=4)
    assert result.evaluated > len(result.plans) == 4
    times = [p.step_time_s for p in result.plans]
    assert all(p.fits for p in result.plans)
    assert all(b >= a * 0.995 for a, b in zip(times, times[1:], strict=False)), times
    # 2 KV heads do not split over tensor=4 or 8: those meshes were rejected, and said so.
    assert result.rejected["model.n_kv_heads=2"] > 0
    assert all(p.candidate.sizes["tensor"] <= 2 for p in result.plans)


def test_when_nothing_fits_the_leanest_plans_come_first():
    plans = plan("configs/llama-70b.yaml", chips="h100:8", global_batch=8, seq=4096, top=3)
    assert plans and not any(p.fits for p in plans)
    memory = [p.memory_per_device_bytes for p in plans]
    assert memory == sorted(memory) and memory[0] > 0.9 * BUILTIN["h100"].hbm_bytes
    assert plans[0].reason == "nothing fits; this plan needs the least memory"


def test_pipeline_schedules_trade_bubble_and_recomputation_for_activation_memory():
    """Llama-2-70B on 4 x 8 H100 at 8k tokens: on one mesh, the 1F1B schedules keep far
    fewer activations than the circular one, pay a larger bubble (fewer chunks a stage)
    and a recomputed forward. Without remat circular does not fit and interleaved 1F1B
    does, within 10% of circular under full remat (20.8 and 19.4 s); the search's first
    plan, FSDP x tensor without stages (18.2 s), beats both (it fits since the GPU memory
    model was checked against the GPU compiler)."""
    from jaxpar.planner import Candidate, estimate

    mesh, common = {"stage": 8, "fsdp": 2, "tensor": 2}, dict(
        zero_stage=3, remat="none", pipeline_microbatches=32, sequence_parallel=True)
    est = {kind: estimate("configs/llama-70b.yaml", Candidate.make(
        mesh, pipeline_schedule=kind, pipeline_repeats=repeats, **common),
        chips="h100:32", global_batch=64, seq=8192)
        for kind, repeats in (("circular", 0), ("1f1b", 1), ("interleaved_1f1b", 2))}
    act = {k: e.memory["activation_bytes"] for k, e in est.items()}
    # Every microbatch's activations against a few stage inputs and one chunk's (half as
    # many layers interleaved).
    assert act["interleaved_1f1b"] < act["1f1b"] < act["circular"] / 20
    assert est["circular"].bubble < est["interleaved_1f1b"].bubble < est["1f1b"].bubble
    assert est["1f1b"].breakdown["compute 1F1B forward recomputation"] > 0
    assert not est["circular"].fits and est["interleaved_1f1b"].fits
    recomputed = estimate("configs/llama-70b.yaml", Candidate.make(
        mesh, pipeline_schedule="circular", pipeline_repeats=0, **{**common, "remat": "full"}),
        chips="h100:32", global_batch=64, seq=8192)
    assert recomputed.fits
    assert est["interleaved_1f1b"].step_time_s < 1.10 * recomputed.step_time_s
    best = plan("configs/llama-70b.yaml", chips="h100:32", global_batch=64, seq=8192, top=1)[0]
    assert best.candidate.sizes.get("stage", 1) == 1
    assert best.step_time_s < min(recomputed.step_time_s, est["interleaved_1f1b"].step_time_s)


@pytest.mark.parametrize("model, chips, slices, batch, seq, offload", [
    ("configs/llama-8b.yaml", "tpu-v6e:8", 2, 32, 8192, "never"),  # stages, DCN
    ("configs/llama-70b.yaml", "tpu-v5p:64", 1, 16, 65536, "never"),  # context baseline
    (MIXTRAL, "h100:32", 1, 128, 4096, "never"),  # expert baseline, nodes
    ("configs/llama-8b.yaml", "h100:8", 1, 32, 4096, "always"),  # the offload pass
])
def test_the_bound_skips_pricing_but_not_plans(model, chips, slices, batch, seq, offload):
    """Branch and bound returns what pricing every candidate returns: the same plans in
    the same order with the same figures, and the same baselines for the reasons."""
    resolved = resolve_model(model)
    machine = parse_chips(chips, slices=slices)
    bounded, full = (search(resolved.spec_for, machine, batch, seq, top=3, offload=offload,
                            prune=prune) for prune in (True, False))
    assert full.skipped == 0 and bounded.skipped > 0 and bounded.priced < full.priced / 2
    assert bounded.rejected == full.rejected and all(p.fits for p in full.plans)
    assert [(p.candidate, p.step_time_s, p.memory) for p in bounded.plans] == [
        (p.candidate, p.step_time_s, p.memory) for p in full.plans]
    assert {k: b and b.candidate for k, b in bounded.baselines.items()} == {
        k: b and b.candidate for k, b in full.baselines.items()}
    assert [p.notes.keys() for p in bounded.plans] == [p.notes.keys() for p in full.plans]
