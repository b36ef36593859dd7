"""Model FLOPs utilisation (MFU) of a decoder training step, built through jaxpar's API.

    python benchmarks/mfu.py [--model tiny|1b|8b[,...]] [--batch N] [--seq N] [--steps 20]
        [--warmup 3] [--precision bf16|f16|f32|POLICY] [--attention auto|xla|cudnn|splash|chunked]
        [--remat POLICY] [--mesh fsdp=8[,tensor=2...]] [--devices N]
        [--dry-run [--chips KIND:COUNT]] [key=value ...]

For each model preset it builds the trainer of a :class:`jaxpar.Config`
(``jaxpar.build_trainer``) on the devices of this machine (on CPU: ``--devices``
simulated devices, default 8), makes one fixed batch of random token ids, runs
``--warmup`` untimed steps (the first compiles), then dispatches ``--steps`` steps with
``Trainer.step_async`` and blocks once at the end. A helper thread waits on each step's
metrics in order, so every step's completion time is known without stalling the
dispatch: the step time is the median gap between consecutive completions (the mean,
wall time over all steps, is shown beside it).

Model FLOPs per step are the planner's count (``jaxpar.runs.monitor.model_flops_per_step``:
``6 N + 12 L H Q s`` per token, PaLM appendix B; no remat recomputation), the peak the
chip's dense bf16 FLOP/s from the planner's catalog (``jaxpar.runs.monitor.peak_flops_per_device``,
none on CPU), and MFU = flops / (step time x devices x peak).

Presets: ``tiny`` (configs/tiny.yaml: d_model 128, 4 layers, vocab 256; seconds on 8
simulated CPU devices), ``1b`` (Llama-style ~1.04B: d_model 2048, 16 layers, 16/8 heads,
d_ff 7168, vocab 32000, seq 4096) and ``8b`` (Llama-3-8B shapes: d_model 4096, 32
layers, 32/8 heads, d_ff 14336, vocab 128256, seq 4096). ``--batch`` defaults to the
preset's sequences per device times the device count. ``--remat`` defaults to the
planner's pick for this mesh (the remat policy whose estimated step is fastest among
those estimated to fit; the config's own ``plan.remat`` when the chip is not in the
catalog). Trailing ``key=value`` are config overrides (e.g. ``model.loss_chunk=1024``,
``plan.zero_stage=1``). ``--dry-run`` builds nothing on the devices: it prints each
preset's parameter count (from the config and from an abstract ``nnx.eval_shape`` of the
model), FLOPs per step and the planner's remat choice and memory estimate, for this
machine's devices or, with ``--chips h200:8``, for another machine.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import queue
import statistics
import sys
import threading
import time

# name -> (YAML under configs/ or None, overrides, sequences per device, default seq)
PRESETS: dict[str, tuple[str | None, list[str], int, int]] = {
    "tiny": ("configs/tiny.yaml", [], 2, 128),
    "1b": (None, ["model.vocab_size=32000", "model.d_model=2048", "model.n_layers=16",
                  "model.n_heads=16", "model.n_kv_heads=8", "model.d_ff=7168",
                  "model.rope_theta=500000.0"], 1, 4096),
    "8b": (None, ["model.vocab_size=128256", "model.d_model=4096", "model.n_layers=32",
                  "model.n_heads=32", "model.n_kv_heads=8", "model.d_ff=14336",
                  "model.rope_theta=500000.0"], 1, 4096),
}
PRECISIONS = {"bf16": "params=float32,compute=bfloat16,output=float32",
              "f16": "params=float32,compute=float16,output=float32",
              "f32": "params=float32,compute=float32,output=float32"}
ATTENTIONS = ("auto", "xla", "cudnn", "splash", "chunked")


def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3f} {prefix}{unit}"
    return f"{x:.3f} {unit}".rstrip()


def _dur(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def mesh_overrides(text: str) -> list[str]:
    """``"fsdp=4,tensor=2"`` (or space separated) -> ``["mesh.fsdp=4", "mesh.tensor=2"]``."""
    out = []
    for part in text.replace(",", " ").split():
        if "=" not in part:
            raise SystemExit(f"--mesh {text!r}: expected axis=size[,axis=size...]")
        out.append(part if part.startswith("mesh.") else f"mesh.{part}")
    return out


def build_config(args, name: str, n_devices: int, remat: str | None):
    """The run config of preset ``name`` with the command line's choices applied."""
    import jaxpar

    yaml, preset, per_device, seq_default = PRESETS[name]
    seq = args.seq or seq_default
    batch = args.batch or per_device * n_devices
    precision = PRECISIONS.get(args.precision, args.precision)
    over = [*preset, f"train.global_batch={batch}", f"train.seq_len={seq}",
            f"plan.precision={precision}", f"model.attention={args.attention}"]
    if remat is not None:
        over.append(f"plan.remat={remat}")
    if yaml is None:  # the defaults' mesh is data=-1; FSDP suits these sizes better
        over += ["mesh.data=1", "mesh.fsdp=-1"]
    over += mesh_overrides(args.mesh) if args.mesh else []
    over += list(args.overrides)
    config = jaxpar.load_config(yaml, over)
    if config.model.max_seq_len < seq:
        config = jaxpar.load_config(yaml, [*over, f"model.max_seq_len={seq}"])
    return config


def resolved_mesh(config, n_devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """ICI and DCN axis sizes of ``config.mesh`` on ``n_devices`` (the -1 axis filled in)."""
    ici = dict(config.mesh.ici())
    dcn = config.mesh.dcn() or {}
    known = math.prod(v for v in ici.values() if v != -1) * math.prod(dcn.values() or [1])
    for axis, size in ici.items():
        if size == -1:
            ici[axis] = max(n_devices // known, 1)
    return ici, dcn


def chip_key(platform: str, device_kind: str) -> str | None:
    """The planner's catalog key of these devices (``cpu`` on the host), or None."""
    from jaxpar.runs.monitor import chip_for_kind

    return "cpu" if platform == "cpu" else chip_for_kind(device_kind)


def planner_remat(config, n_devices: int, key: str | None, backend: str) -> tuple[str, str]:
    """(remat policy, how it was chosen): the planner's cost model evaluated for this
    config's mesh, knobs and batch on ``n_devices`` chips of catalog kind ``key`` with
    each remat policy; the fastest estimated to fit (the least memory when none fits).
    The config's ``plan.remat`` when the planner has no figures for the chip or precision."""
    import jax.numpy as jnp

    from jaxpar.planner import api
    from jaxpar.planner.cost import DTYPE_BYTES, Candidate
    from jaxpar.planner.search import REMATS
    from jaxpar.sharding.precision import Policy

    compute = Policy.parse(config.plan.precision).compute
    if key is None:
        return config.plan.remat, "config's: the planner's catalog lacks this chip"
    if jnp.dtype(compute).name not in DTYPE_BYTES:
        return config.plan.remat, f"config's: no planner figures for {jnp.dtype(compute).name}"
    ici, dcn = resolved_mesh(config, n_devices)
    estimates = []
    for remat in REMATS:
        cand = Candidate.make(ici, dcn or None, rules=config.plan.rules,
                              zero_stage=config.plan.zero_stage, remat=remat,
                              microbatches=config.plan.microbatches,
                              pipeline_microbatches=config.pipeline.microbatches,
                              precision=jnp.dtype(compute).name,
                              optimizer=config.train.optimizer)
        try:
            estimates.append(api.estimate(config, cand, chips=f"{key}:{n_devices}",
                                          global_batch=config.train.global_batch,
                                          seq=config.train.seq_len, backend=backend))
        except Exception as err:  # noqa: BLE001 -- a planner refusal: keep the config's
            return config.plan.remat, f"config's: the planner declined ({err})"
    fitting = [e for e in estimates if e.fits]
    if fitting:
        best = min(fitting, key=lambda e: e.step_time_s)
        how = "fits"
    else:
        best = min(estimates, key=lambda e: e.memory_per_device_bytes)
        how = "least memory, none fits"
    mfu = "" if key == "cpu" else f", MFU {best.mfu:.1%}"
    return best.candidate.remat, (f"planner on {key}:{n_devices}: {how}; est. "
                                  f"{_gib(best.memory_per_device_bytes)}/device, "
                                  f"{_dur(best.step_time_s)}/step{mfu}")


def time_steps(trainer, batch, steps: int) -> tuple[list[float], float, dict]:
    """Dispatch ``steps`` steps with ``step_async`` and block once at the end; a helper
    thread records when each step's metrics become ready. Returns the per-step gaps
    between consecutive completions (s), the wall time of all steps (s) and the last
    step's metrics (host numbers)."""
    import jax

    pending: queue.Queue = queue.Queue()
    done: list[float] = []

    def wait() -> None:
        while (metrics := pending.get()) is not None:
            jax.block_until_ready(metrics)
            done.append(time.perf_counter())

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    start = time.perf_counter()
    metrics = None
    for _ in range(steps):
        metrics = trainer.step_async(batch)
        pending.put(metrics)
    last = jax.device_get(metrics)
    wall = time.perf_counter() - start
    pending.put(None)
    waiter.join()
    gaps = [b - a for a, b in zip(done, done[1:], strict=False)] or [wall]
    return gaps, wall, {k: float(v) for k, v in last.items()}


def peak_memory(devices) -> int | None:
    """The largest ``peak_bytes_in_use`` over ``devices``; None where none reports it."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except (RuntimeError, NotImplementedError):
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    sys.stdout.flush()


def dry_run(args, name: str, n_devices: int, key: str | None, backend: str) -> None:
    import jax
    from flax import nnx

    from jaxpar.config.assembly import model_factory
    from jaxpar.planner.catalog import BUILTIN
    from jaxpar.runs.monitor import model_flops_per_step

    config = build_config(args, name, n_devices, args.remat)
    remat, how = ((args.remat, "--remat") if args.remat is not None
                  else planner_remat(config, n_devices, key, backend))
    m, t = config.model, config.train
    flops = model_flops_per_step(m, t.global_batch, t.seq_len)
    tokens = t.global_batch * t.seq_len
    start = time.perf_counter()
    abstract = nnx.eval_shape(model_factory(config))
    shapes = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    ici, dcn = resolved_mesh(config, n_devices)
    peak = None if key in (None, "cpu") else BUILTIN[key].peak_flops
    at_peak = flops / (n_devices * peak) if flops and peak else None
    print_table(f"{name} (dry run on {key or 'unknown chip'}:{n_devices}: nothing built "
                "on the devices)", [
        ("model", f"d_model {m.d_model}, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} "
                  f"heads x {m.head_dim}, d_ff {m.d_ff}, vocab {m.vocab_size}"),
        ("params (config)", f"{m.param_count():,}"),
        ("params (eval_shape)", f"{shapes:,} ({time.perf_counter() - start:.1f} s)"),
        ("global batch x seq", f"{t.global_batch} x {t.seq_len} = {tokens:,} tokens/step"),
        ("model FLOPs/step", _si(flops, "FLOP")),
        ("model FLOPs/token", _si(flops / tokens if flops else None, "FLOP")),
        ("mesh", (" x ".join(f"{a}={s}" for a, s in ici.items() if s > 1) or "single")
         + (f" (dcn {dcn})" if dcn else "")),
        ("precision", config.plan.precision),
        ("remat", f"{remat} ({how})"),
        ("step at 100% MFU", "n/a" if at_peak is None else _dur(at_peak)),
    ])


def run(args, name: str, devices, platform: str, device_kind: str) -> None:
    import numpy as np

    import jaxpar
    from jaxpar.runs.monitor import mfu, model_flops_per_step, peak_flops_per_device

    n = len(devices)
    config = build_config(args, name, n, args.remat)
    if args.remat is None:
        remat, how = planner_remat(config, n, chip_key(platform, device_kind), platform)
        config = build_config(args, name, n, remat)
    else:
        remat, how = args.remat, "--remat"
    t = config.train
    start = time.perf_counter()
    trainer = jaxpar.build_trainer(config, devices)
    build_s = time.perf_counter() - start
    tokens = np.random.default_rng(0).integers(
        0, config.model.vocab_size, (t.global_batch, t.seq_len + 1), dtype=np.int32)
    batch = trainer.global_batch(tokens)  # placed once, reused by every step
    start = time.perf_counter()
    trainer.step(batch)
    first_s = time.perf_counter() - start
    for _ in range(max(args.warmup - 1, 0)):
        trainer.step(batch)
    gaps, wall, last = time_steps(trainer, batch, args.steps)
    step_s = statistics.median(gaps)
    mean_s = wall / args.steps
    flops = model_flops_per_step(config.model, t.global_batch, t.seq_len)
    peak = peak_flops_per_device(devices[0])
    util = mfu(flops, step_s, n, peak) if flops else None
    n_tokens = t.global_batch * t.seq_len
    mesh = " x ".join(f"{a}={s}" for a, s in trainer.plan.mesh.shape.items() if s > 1)
    if util is not None:
        mfu_text = f"{util:.1%} (mean-step time: {mfu(flops, mean_s, n, peak):.1%})"
    else:
        mfu_text = "n/a (CPU: no peak)" if platform == "cpu" else "n/a (chip not in catalog)"
    print_table(f"{name}", [
        ("model", f"d_model {config.model.d_model}, {config.model.n_layers} layers, "
                  f"{config.model.n_heads}/{config.model.n_kv_heads} heads, d_ff "
                  f"{config.model.d_ff}, vocab {config.model.vocab_size}"),
        ("params", f"{config.model.param_count():,}"),
        ("mesh / rules", f"{mesh or 'single'} / {config.plan.rules}, zero "
                         f"{config.plan.zero_stage}, microbatches {config.plan.microbatches}"),
        ("precision", config.plan.precision),
        ("attention", config.model.attention),
        ("remat", f"{remat} ({how})"),
        ("global batch x seq", f"{t.global_batch} x {t.seq_len}"),
        ("tokens/step", f"{n_tokens:,}"),
        ("build / first step", f"{build_s:.1f} s / {first_s:.1f} s (compile)"),
        ("timed steps", f"{args.steps} after {args.warmup} warm-up"),
        ("step time median", f"{step_s * 1e3:.2f} ms (min {min(gaps) * 1e3:.2f}, max "
                             f"{max(gaps) * 1e3:.2f}, mean {mean_s * 1e3:.2f})"),
        ("tokens/s", f"{n_tokens / step_s:,.0f}"),
        ("model FLOPs/step", _si(flops, "FLOP")),
        ("achieved/device", _si(flops / step_s / n if flops else None, "FLOP/s")),
        ("peak/device", _si(peak, "FLOP/s") + (" (dense bf16)" if peak else "")),
        ("MFU", mfu_text),
        ("peak memory/device", _gib(peak_memory(devices))
         + ("" if platform != "cpu" else " (CPU reports none)")),
        ("last loss", f"{last['loss']:.4f}"),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny",
                        help=f"comma-separated presets: {', '.join(PRESETS)}")
    parser.add_argument("--batch", type=int, default=0,
                        help="global batch (default: the preset's per device x devices)")
    parser.add_argument("--seq", type=int, default=0, help="default: the preset's")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps before them (the first compiles)")
    parser.add_argument("--precision", default="bf16",
                        help="bf16 (f32 master, bf16 compute), f16, f32, or a policy string "
                             "such as p=f32,c=bf16,o=f32")
    parser.add_argument("--attention", default="auto", choices=ATTENTIONS)
    parser.add_argument("--remat", default=None,
                        help="plan.remat (default: the planner's pick for this mesh)")
    parser.add_argument("--mesh", default="", help="mesh sizes, e.g. fsdp=4,tensor=2")
    parser.add_argument("--devices", type=int, default=0,
                        help="devices to use (CPU: simulated count, default 8; else all)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print params, FLOPs and the remat choice; run nothing")
    parser.add_argument("--chips", default="",
                        help="with --dry-run: plan for KIND:COUNT (e.g. h200:8) instead "
                             "of this machine's devices")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.model.split(",") if s.strip()]
    for name in names:
        if name not in PRESETS:
            parser.error(f"--model {name!r}: choose from {', '.join(PRESETS)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if args.chips and not args.dry_run:
        parser.error("--chips plans for another machine: it needs --dry-run")

    from jaxpar.errors import JaxparError
    from jaxpar.runs.host_memory import local_gpu_count, size_host_pool

    gpus = local_gpu_count()
    if gpus and not args.dry_run:  # offloaded state: XLA's pinned pool, sized before start
        try:
            for name in names:
                size_host_pool(build_config(args, name, args.devices or gpus, args.remat),
                               args.devices or gpus)
        except JaxparError as err:
            print(f"mfu: {err}", file=sys.stderr)
            return 2
    # Only the host platform reads this: on a GPU/TPU machine the real devices are used.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices or 8}")
    import jax

    devices = jax.devices()
    if args.devices:
        devices = devices[:args.devices]
    platform, kind = devices[0].platform, devices[0].device_kind
    print(f"devices: {len(devices)} x {kind} ({platform}), jax {jax.__version__}, "
          f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    if args.chips:
        from jaxpar.planner.catalog import resolve_kind

        kind_text, _, count = args.chips.partition(":")
        key, n_plan = resolve_kind(kind_text), int(count or 1)
        backend = "cpu" if key == "cpu" else "tpu" if key.startswith("tpu") else "gpu"
    else:
        key, n_plan, backend = chip_key(platform, kind), len(devices), platform

    for name in names:
        try:
            if args.dry_run:
                dry_run(args, name, n_plan, key, backend)
            else:
                run(args, name, devices, platform, kind)
        except JaxparError as err:
            print(f"{name}: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
