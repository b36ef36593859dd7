"""The planner beside published training configurations.

    python benchmarks/published.py [--json]

For each published run it plans the same model on the same machine and batch, and prints
whether the plan fits in memory and its estimated throughput (model TFLOP/s per chip, MFU)
beside the published figure. No devices are needed.

Sources:

* Megatron-LM: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC 2021, Table 1 (GPT models, seq 2048, vocab 51200,
  A100-80GB; tensor size t, pipeline size p, GPUs, batch, achieved TFLOP/s per GPU and
  percent of the 312 TFLOP/s peak). GPT's 2-matrix 4h MLP is modelled as a SwiGLU MLP with
  d_ff = 8h/3 (same parameters and FLOPs).
* MaxText: github.com/AI-Hypercomputer/maxtext, MaxText/configs/v5p/README.md (TFLOP/s per
  chip and MFU) and configs/v5p/{32b,128b}.sh (per-device batch, seq 2048, fsdp x tensor).
  "v5p-128" counts TensorCores: 64 chips. MaxText derives shapes from
  ``global_parameter_scale``; here they are Llama-style shapes of the same parameter count
  (head_dim 128, d_ff 3.5 d), so only the totals match.

Long context and mixtures of experts (a second table, compared in tokens per second per
chip, which does not depend on how a framework counts FLOPs; MaxText now counts causal
attention at half the full ``s x s`` FLOPs this planner counts, so its MFU is not
comparable at long sequences):

* MaxText Mixtral 8x7B: github.com/AI-Hypercomputer/tpu-recipes,
  training/trillium/Mixtral-8x7B-MaxText/README.md: v6e-256 (256 chips), workload
  ``mixtral_8x7b_dropped`` (per-device batch 12, seq 4096, ``ici_fsdp_parallelism=-1``,
  capacity factor 1.25, host-offloaded remat), step log "TFLOP/s/device: 302.311,
  Tokens/s/device: 3645.203, total_weights: 12582912" (12582912 = 256 x 12 x 4096).
* MaxText long context: github.com/AI-Hypercomputer/tpu-recipes,
  training/v5p/Llama3.1-8B-LongContext-Maxtext/cluster_toolkit/README.md: a Llama 3.1 8B
  variant (16 query heads of 256, 4 KV heads; otherwise stock) on v5p-128 (64 chips) with
  ring context parallelism: 64K tokens at context 4 x fsdp 16, per-device batch 0.5
  (global 32), 10.25 s a step; 256K at context 16 x fsdp 4, global batch 8, 26.31 s;
  1M at context 64, global batch 2, 95.73 s (the recipe's "Measured Step Time").

Not included, for want of a figure with its machine, batch and layout in the same source:
Megatron-Core's Mixtral 8x7B "438 TFLOPS" (no GPU count or parallel layout beside it),
and DeepSeek-V3 runs (FP8, MLA and pipeline schedules this planner does not model).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpar.models import TransformerConfig  # noqa: E402
from jaxpar.planner import plan  # noqa: E402


def _gpt(hidden: int, heads: int, layers: int) -> TransformerConfig:
    d_ff = (8 * hidden // 3 + 127) // 128 * 128
    return TransformerConfig(vocab_size=51200, d_model=hidden, n_layers=layers, n_heads=heads,
                             n_kv_heads=heads, d_ff=d_ff, max_seq_len=2048)


def _llama(d: int, layers: int) -> TransformerConfig:
    heads = d // 128
    return TransformerConfig(vocab_size=32000, d_model=d, n_layers=layers, n_heads=heads,
                             n_kv_heads=heads, d_ff=7 * d // 2, max_seq_len=2048)


# name, model, chips, global batch, seq, published layout, TFLOP/s per chip, % of peak
PUBLISHED = [
    ("Megatron GPT 1.7B", _gpt(2304, 24, 24), "a100-80gb:32", 512, 2048, "t1 p1", 137, 44),
    ("Megatron GPT 3.6B", _gpt(3072, 32, 30), "a100-80gb:64", 512, 2048, "t2 p1", 138, 44),
    ("Megatron GPT 7.5B", _gpt(4096, 32, 36), "a100-80gb:128", 512, 2048, "t4 p1", 142, 46),
    ("Megatron GPT 18B", _gpt(6144, 48, 40), "a100-80gb:256", 1024, 2048, "t8 p1", 135, 43),
    ("Megatron GPT 39B", _gpt(8192, 64, 48), "a100-80gb:512", 1536, 2048, "t8 p2", 138, 44),
    ("Megatron GPT 76B", _gpt(10240, 80, 60), "a100-80gb:1024", 1792, 2048, "t8 p4", 140, 45),
    ("Megatron GPT 146B", _gpt(12288, 96, 80), "a100-80gb:1536", 2304, 2048, "t8 p8", 148,
     47),
    ("MaxText 32B v5p-128", _llama(6144, 64), "tpu-v5p:64", 7 * 64, 2048, "fsdp16 t4", 328,
     71.5),
    ("MaxText 128B v5p-256", _llama(12288, 64), "tpu-v5p:128", 128, 2048, "fsdp16 t8", 315,
     68.7),
]


def _llama31_8b_wide_heads(seq: int) -> TransformerConfig:
    """The tpu-recipes long-context variant of Llama 3.1 8B (16 heads of 256, 4 KV)."""
    return TransformerConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=16,
                             n_kv_heads=4, head_dim=256, d_ff=14336, max_seq_len=seq,
                             rope_theta=500000.0)


def _mixtral(capacity: float = 1.25) -> TransformerConfig:
    return TransformerConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, d_ff=14336, max_seq_len=4096, rope_theta=1e6,
                             n_experts=8, experts_per_token=2, expert_capacity=capacity)


# name, model, chips, global batch, seq, published layout, tokens/s per chip
PUBLISHED_PARALLEL = [
    ("MaxText Mixtral 8x7B", _mixtral(), "tpu-v6e:256", 256 * 12, 4096, "fsdp256 cf1.25",
     3645.2),
    ("MaxText 8B ctx 64K", _llama31_8b_wide_heads(65536), "tpu-v5p:64", 32, 65536,
     "cp4 fsdp16", 32 * 65536 / 10.25 / 64),
    ("MaxText 8B ctx 256K", _llama31_8b_wide_heads(262144), "tpu-v5p:64", 8, 262144,
     "cp16 fsdp4", 8 * 262144 / 26.31 / 64),
    ("MaxText 8B ctx 1M", _llama31_8b_wide_heads(1048576), "tpu-v5p:64", 2, 1048576,
     "cp64", 2 * 1048576 / 95.73 / 64),
]


def _parallel_rows() -> list[dict]:
    rows = []
    for name, model, chips, batch, seq, layout, tokens in PUBLISHED_PARALLEL:
        best = plan(model, chips=chips, global_batch=batch, seq=seq, top=1)[0]
        n = best.candidate.n_devices
        rows.append({
            "run": name, "params_b": model.param_count() / 1e9, "chips": chips,
            "batch": batch, "seq": seq, "published_layout": layout,
            "published_tokens_per_s_chip": tokens, "plan": best.candidate.describe(),
            "zero": best.candidate.zero_stage, "remat": best.candidate.remat,
            "microbatches": best.candidate.microbatches,
            "memory_gib": best.memory_per_device_bytes / 2**30,
            "hbm_gib": best.hbm_bytes / 2**30, "fits": best.fits,
            "planned_tokens_per_s_chip": batch * seq / best.step_time_s / n,
            "planned_mfu": best.mfu,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for name, model, chips, batch, seq, layout, tflops, pct in PUBLISHED:
        best = plan(model, chips=chips, global_batch=batch, seq=seq, top=1)[0]
        rows.append({
            "run": name, "params_b": model.param_count() / 1e9, "chips": chips,
            "batch": batch, "published_layout": layout, "published_tflops": tflops,
            "published_mfu": pct / 100, "plan": best.candidate.describe(),
            "zero": best.candidate.zero_stage, "remat": best.candidate.remat,
            "microbatches": best.candidate.microbatches,
            "memory_gib": best.memory_per_device_bytes / 2**30,
            "hbm_gib": best.hbm_bytes / 2**30, "fits": best.fits,
            "planned_tflops": best.model_flops / best.step_time_s / 1e12,
            "planned_mfu": best.mfu,
        })
    parallel = _parallel_rows()
    if args.json:
        print(json.dumps(rows + parallel, indent=1))
        return 0
    head = (f"{'run':22} {'params':>7} {'chips':>15} {'batch':>5} {'published':>10} "
            f"{'TF/s':>5} {'MFU':>5} | {'planned mesh':34} {'z':>1} {'remat':>12} {'mb':>3} "
            f"{'mem GiB':>11} {'fits':>4} {'TF/s':>5} {'MFU':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['run']:22} {r['params_b']:6.1f}B {r['chips']:>15} {r['batch']:>5} "
              f"{r['published_layout']:>10} {r['published_tflops']:>5.0f} "
              f"{r['published_mfu'] * 100:4.1f}% | {r['plan'][:34]:34} {r['zero']:>1} "
              f"{r['remat'][:12]:>12} {r['microbatches']:>3} "
              f"{r['memory_gib']:5.1f}/{r['hbm_gib']:5.1f} {'yes' if r['fits'] else 'NO':>4} "
              f"{r['planned_tflops']:5.0f} {r['planned_mfu'] * 100:4.1f}%")
    head = (f"\n{'run':22} {'params':>7} {'chips':>12} {'batch':>5} {'seq':>8} "
            f"{'published':>14} {'tok/s':>6} | {'planned mesh':44} {'z':>1} {'remat':>12} "
            f"{'mb':>3} {'mem GiB':>11} {'fits':>4} {'tok/s':>6} {'MFU*':>5}")
    print(head)
    print("-" * len(head))
    for r in parallel:
        print(f"{r['run']:22} {r['params_b']:6.1f}B {r['chips']:>12} {r['batch']:>5} "
              f"{r['seq']:>8} {r['published_layout']:>14} "
              f"{r['published_tokens_per_s_chip']:6.0f} | {r['plan'][:44]:44} {r['zero']:>1} "
              f"{r['remat'][:12]:>12} {r['microbatches']:>3} "
              f"{r['memory_gib']:5.1f}/{r['hbm_gib']:5.1f} {'yes' if r['fits'] else 'NO':>4} "
              f"{r['planned_tokens_per_s_chip']:6.0f} {r['planned_mfu'] * 100:4.1f}%")
    print("tok/s: tokens per second per chip. * model FLOPs with full s x s attention (the "
          "PaLM convention); causal kernels run about half of it, so at long sequences "
          "this exceeds the chips' real utilisation.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
