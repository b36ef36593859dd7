"""ZeRO-Offload on one GPU: a Llama-3-8B-shaped model whose optimizer state does not fit
the device trains on it, the state in host memory, beside the planner's prediction.

    python benchmarks/offload_gpu.py [--model 8b] [--batch 1] [--seq 4096] [--steps 5]
        [--warmup 2] [--modes device,host] [--json PATH] [key=value ...]

Each mode is one run of ``benchmarks/mfu.py``'s preset (bf16 compute with f32 master
weights, ``plan.remat=full``, AdamW) with all optimizer state in host memory
(``plan.offload_optimizer=1``): ``device`` streams it through the GPU a layer at a time
for the update (:mod:`jaxpar.parallel.streamed_update`), ``host`` updates it on the host
(``plan.host_update``), slab by slab too. Before JAX starts, the pinned host pool is sized
for the largest mode (:func:`jaxpar.size_host_pool`: ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``),
or the run is refused in one line if this host cannot hold the state.

Per mode it prints the median step time (steps dispatched asynchronously, completions
timed by a helper thread, as ``mfu.py`` does), MFU against the chip's dense bf16 peak, the
device's peak memory (``peak_bytes_in_use``), the state held in host memory, and the
planner's figures for the same config on this chip (device memory, host memory, step
time). Modes run one after another in one process; each gives its state back before the
next starts (the peak memory is the process's, so the first mode's is the cleanest).

On a machine without a GPU it runs the ``tiny`` preset on one CPU device (a check of the
code path; CPU memory reports no peaks) unless ``--model`` says otherwise. Figures from a
lent GPU are in the docs (docs/guides/memory.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mfu  # noqa: E402  (benchmarks/mfu.py: presets, timing, peak memory)

MODES = {"device": ["plan.offload_optimizer=1"],
         "host": ["plan.offload_optimizer=1", "plan.host_update=true"]}


def configs(args, n_devices: int) -> dict:
    """Each mode's config."""
    ns = argparse.Namespace(seq=args.seq, batch=args.batch, precision="bf16",
                            attention="auto", mesh="", overrides=args.overrides)
    out = {}
    for mode in args.modes:
        ns.overrides = [*MODES[mode], *args.overrides]
        out[mode] = mfu.build_config(ns, args.model, n_devices, "full")
    return out


def predicted(config, key: str | None, backend: str) -> dict:
    """The planner's memory and step time for ``config`` on one chip of catalog ``key``."""
    from jaxpar.planner.catalog import BUILTIN, Machine
    from jaxpar.planner.prediction import predict

    machine = Machine(BUILTIN[key], 1, 1) if key in BUILTIN else None
    out = predict(config, 1, backend="cpu" if backend == "cpu" else "gpu", machine=machine)
    return {"device_bytes": out["memory"]["total_bytes"], "host_bytes":
            out["memory"]["host_bytes"], "step_s": out["step_time_s"] if machine else None}


def run_mode(mode: str, config, devices, key: str | None, args) -> dict:
    """Build, warm up and time one mode; its figures."""
    import jax
    import numpy as np

    import jaxpar
    from jaxpar.parallel import offload
    from jaxpar.runs.monitor import mfu as utilisation
    from jaxpar.runs.monitor import model_flops_per_step, peak_flops_per_device

    t = config.train
    start = time.perf_counter()
    trainer = jaxpar.build_trainer(config, devices)
    build_s = time.perf_counter() - start
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size,
                                               (t.global_batch, t.seq_len + 1), np.int32)
    batch = trainer.global_batch(tokens)
    start = time.perf_counter()
    trainer.step(batch)
    first_s = time.perf_counter() - start
    for _ in range(max(args.warmup - 1, 0)):
        trainer.step(batch)
    gaps, _, last = mfu.time_steps(trainer, batch, args.steps)
    step_s = statistics.median(gaps)
    flops = model_flops_per_step(config.model, t.global_batch, t.seq_len)
    peak = peak_flops_per_device(devices[0])
    row = {"mode": mode, "step_s": step_s, "first_step_s": first_s, "build_s": build_s,
           "mfu": utilisation(flops, step_s, 1, peak) if peak else None,
           "peak_device_bytes": mfu.peak_memory(devices),
           "host_bytes": offload.host_bytes(trainer.state)[1],
           "streams_update": trainer.streams_update, "loss": last["loss"],
           "predicted": predicted(config, key, devices[0].platform)}
    del trainer, batch
    gc.collect()
    jax.clear_caches()
    return row


def print_rows(rows: list[dict], header: str) -> None:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.1f} GiB"  # noqa: E731
    ms = lambda s: "-" if s is None else f"{s * 1e3:.0f} ms"  # noqa: E731
    print(f"\n{header}")
    cols = ("mode", "step", "pred. step", "MFU", "peak device", "pred. device", "host state",
            "pred. host", "loss")
    table = [cols]
    for r in rows:
        p = r["predicted"]
        table.append((r["mode"], ms(r["step_s"]), ms(p["step_s"]),
                      "-" if r["mfu"] is None else f"{r['mfu']:.1%}",
                      gib(r["peak_device_bytes"]), gib(p["device_bytes"]),
                      gib(r["host_bytes"]), gib(p["host_bytes"]), f"{r['loss']:.3f}"))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(cols))]
    for row in table:
        print("  " + "  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a mfu.py preset (default: 8b on a "
                        "GPU, tiny on CPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=0, help="default: the preset's")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--modes", default="device,host", help=f"from {', '.join(MODES)}")
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in args.modes if m not in MODES]:
        parser.error(f"--modes {bad[0]!r}: choose from {', '.join(MODES)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2")

    from jaxpar.errors import JaxparError
    from jaxpar.runs.host_memory import GPU_POOL_ENV, local_gpu_count, size_host_pool

    gpus = local_gpu_count()
    args.model = args.model or ("8b" if gpus else "tiny")
    n = 1
    try:
        pool = max((size_host_pool(c, n) or 0) for c in configs(args, n).values())
    except JaxparError as err:
        print(f"offload_gpu: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "" if gpus else "cpu")
    import jax

    devices = jax.devices()[:1]
    platform, kind = devices[0].platform, devices[0].device_kind
    key = mfu.chip_key(platform, kind)
    header = (f"ZeRO-Offload, {args.model} on one {kind} ({platform}), jax {jax.__version__}, "
              f"batch {args.batch} x {configs(args, n)[args.modes[0]].train.seq_len}, "
              f"bf16, remat full; {GPU_POOL_ENV}={os.environ.get(GPU_POOL_ENV, '-')} "
              f"(sized {pool} GiB)")
    rows = []
    for mode, config in configs(args, n).items():
        try:
            rows.append(run_mode(mode, config, devices, key, args))
        except JaxparError as err:
            print(f"offload_gpu: {mode}: {err}", file=sys.stderr)
            return 2
    print_rows(rows, header)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
