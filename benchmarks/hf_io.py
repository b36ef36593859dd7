"""Hugging Face checkpoint load/save: jaxpar.hf against transformers, time and peak host RSS.

    python benchmarks/hf_io.py [--dir /tmp/jaxpar-hf-bench] [--repeats 2] [--devices 8]
        [--ops jaxpar-load-f32,jaxpar-load-bf16,jaxpar-save-bf16,jaxpar-save-f32,...]
        [--json]

Creates once (and reuses from ``--dir``) a random ~1.07B-parameter Llama checkpoint
(hidden 2048, 20 layers, 16 heads, 8 KV heads, intermediate 5632, vocab 32000, untied
embeddings), initialised by transformers in bfloat16 and written with ``save_pretrained(...,
max_shard_size="2GB")`` (two shards and an index). Then every operation runs in a fresh
subprocess, the operations alternating (A B C ... A B C ...) ``--repeats`` times:

* ``jaxpar-load-{f32,bf16}``: ``jaxpar.hf.load(path, plan=plan, dtype=...)`` with
  ``Plan.from_preset(make_mesh({"fsdp": N}), "fsdp")`` over N simulated CPU devices, until
  ``jax.block_until_ready``; the child then checks a few slices against the safetensors;
* ``jaxpar-save-{bf16,f32}``: the same load, then ``jaxpar.hf.save(model, out)`` in the
  model's dtype (only the save is timed; its peak is the high-water mark, reset through
  ``/proc/self/clear_refs`` just before it, and its base the RSS once the model is loaded);
* ``hf-load-{f32,bf16}``: ``transformers.AutoModelForCausalLM.from_pretrained(path,
  dtype=...)``; transformers may leave same-dtype weights memory-mapped and unread, so a
  second row adds reading every weight once (a float32 sum per tensor).

Peak RSS is ``getrusage(RUSAGE_SELF).ru_maxrss`` at the end of the child; "base" is the RSS
once the libraries are imported (and JAX's CPU backend is up), so ``peak - base`` is what
the operation itself added. A sampling thread also records the peak anonymous and
file-backed (memory-mapped safetensors) parts of RSS. The checkpoint is read from the page
cache after the first run (it is small next to the host's memory), so times are warm-cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
             num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
             max_position_embeddings=2048, tie_word_embeddings=False)
OPS = ("jaxpar-load-f32", "jaxpar-load-bf16", "jaxpar-save-bf16", "jaxpar-save-f32",
       "hf-load-f32", "hf-load-bf16")
MARK = "HF_IO_RESULT "
GIB = 2**30


# --- memory probes (used in the children) -------------------------------------------------
def _status() -> dict[str, int]:
    """``/proc/self/status`` memory fields in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Sampler:
    """Peak anonymous and file-backed RSS, sampled every few milliseconds."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.anon, self.file = interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = _status()
            self.anon, self.file = max(self.anon, s["RssAnon"]), max(self.file, s["RssFile"])
            time.sleep(self.interval)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _reset_peak() -> bool:
    """Reset the RSS high-water mark (VmHWM); false where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --- children -----------------------------------------------------------------------------
def _create(path: Path) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # never a float32 copy of the model
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    params = sum(p.numel() for p in model.parameters())
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="2GB")
    (tmp / "bench.json").write_text(json.dumps({"shape": SHAPE, "params": params}) + "\n")
    os.replace(tmp, path)
    return {"params": params}


def _jaxpar_model(path: Path, dtype: str, devices: int, check: bool) -> tuple[object, dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from safetensors import safe_open

    import jaxpar
    import jaxpar.hf

    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": devices}), "fsdp")
    stats: dict = {}
    base = _maxrss()
    with _Sampler() as sampler:
        start = time.perf_counter()
        model = jaxpar.hf.load(path, plan=plan, dtype=getattr(jnp, dtype), stats=stats)
        jax.block_until_ready(jax.tree.leaves(_params(model)))
        seconds = time.perf_counter() - start
    after = _status()["RssAnon"]  # the loader's temporaries are gone by now
    out = {"seconds": seconds, "imports": base, "peak": _maxrss(), "anon": sampler.anon,
           "anon_after": after,
           "file": sampler.file, "bytes_read": stats.get("bytes_read", 0),
           "model_bytes": sum(x.nbytes for x in jax.tree.leaves(_params(model)))}
    if check:
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]

        def stored(name: str, rows: slice) -> np.ndarray:
            with safe_open(str(path / index[name]), framework="numpy") as f:
                return f.get_slice(name)[rows].astype(np.float32)

        kernel = model.blocks.attn.wq.kernel  # (layers, d_model, heads, head_dim)
        head_dim = kernel.shape[-1]
        checks = {
            "embed[0:4]": (np.asarray(model.embed[0:4]),
                           stored("model.embed_tokens.weight", slice(0, 4))),
            "layer 0 wq head 0": (np.asarray(kernel[0, :, 0, :]),
                                  stored("model.layers.0.self_attn.q_proj.weight",
                                         slice(0, head_dim)).T),
            "last layer w_down[:, :4]": (
                np.asarray(model.blocks.mlp.w_down.kernel[-1, :, 0:4]),
                stored(f"model.layers.{kernel.shape[0] - 1}.mlp.down_proj.weight",
                       slice(0, 4)).T),
        }
        bad = [k for k, (a, b) in checks.items()
               if not np.array_equal(a.astype(np.float32), b)]
        out["check"] = "ok" if not bad else "MISMATCH: " + ", ".join(bad)
        assert str(kernel[...].dtype) == dtype, (kernel[...].dtype, dtype)
    return model, out


def _params(model: object) -> object:
    from flax import nnx

    return nnx.state(model, nnx.Param)


def _jaxpar_child(op: str, path: Path, out_dir: Path, devices: int) -> dict:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    import jaxpar  # noqa: F401
    import jaxpar.hf

    assert len(jax.devices()) == devices, jax.devices()  # backend up before the baseline
    dtype = {"f32": "float32", "bf16": "bfloat16"}[op.rsplit("-", 1)[1]]
    if op.startswith("jaxpar-load"):
        _, result = _jaxpar_model(path, dtype, devices, check=True)
        return result
    model, loaded = _jaxpar_model(path, dtype, devices, check=False)
    shutil.rmtree(out_dir, ignore_errors=True)
    before = _status()["VmRSS"]
    reset = _reset_peak()
    with _Sampler() as sampler:
        start = time.perf_counter()
        jaxpar.hf.save(model, out_dir)
        seconds = time.perf_counter() - start
    hwm = _status()["VmHWM"] if reset else _maxrss()
    from safetensors import safe_open

    files = sorted(out_dir.glob("*.safetensors"))
    with safe_open(str(files[0]), framework="numpy") as f:
        saved = f.get_slice("model.embed_tokens.weight")[0:4]
    same = np.array_equal(np.asarray(model.embed[0:4]).astype(np.float32),
                          saved.astype(np.float32))
    written = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"seconds": seconds, "imports": loaded["imports"], "loaded": before,
            "peak": hwm, "anon": sampler.anon, "file": sampler.file,
            "load_peak": loaded["peak"], "written": written, "files": len(files),
            "check": "ok" if same else "MISMATCH: embed[0:4] of the saved file"}


def _hf_child(op: str, path: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    transformers.logging.set_verbosity_error()
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[op.rsplit("-", 1)[1]]
    base = _maxrss()
    with _Sampler() as sampler:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        seconds = time.perf_counter() - start
    peak = _maxrss()
    params = list(model.parameters())
    assert all(p.dtype == dtype for p in params)
    # from_pretrained may leave the weights memory-mapped and unread (same dtype as stored):
    # read every byte once, as the first forward pass would, and measure again.
    with _Sampler() as touched, torch.no_grad():
        start = time.perf_counter()
        total = sum(float(p.sum(dtype=torch.float32)) for p in params)
        touch = time.perf_counter() - start
    assert total == total  # not NaN
    return {"seconds": seconds, "imports": base, "peak": peak, "anon": sampler.anon,
            "file": sampler.file, "model_bytes": sum(p.nbytes for p in params),
            "touch_seconds": touch, "touch_peak": _maxrss(),
            "touch_anon": max(touched.anon, sampler.anon),
            "touch_file": max(touched.file, sampler.file)}


def _child(args: argparse.Namespace) -> int:
    path = Path(args.dir) / "model"
    if args.child == "create":
        result = _create(path)
    elif args.child.startswith("jaxpar-"):
        result = _jaxpar_child(args.child, path, Path(args.dir) / "saved", args.devices)
    else:
        result = _hf_child(args.child, path)
    print(MARK + json.dumps(result), flush=True)
    return 0


# --- parent -------------------------------------------------------------------------------
def _run_child(op: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", op, "--dir", args.dir,
           "--devices", str(args.devices)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{op}: child failed (exit {proc.returncode})")
    return json.loads(lines[-1][len(MARK):])


def _gib(x: float) -> str:
    return f"{x / GIB:6.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/jaxpar-hf-bench")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--ops", default=",".join(OPS),
                        help="comma-separated, from: " + ", ".join(OPS))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)

    model = Path(args.dir) / "model"
    if not (model / "bench.json").is_file() or \
            json.loads((model / "bench.json").read_text())["shape"] != SHAPE:
        shutil.rmtree(model, ignore_errors=True)
        model.parent.mkdir(parents=True, exist_ok=True)
        print(f"creating the random checkpoint in {model} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        _run_child("create", args)
        print(f"  done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    params = json.loads((model / "bench.json").read_text())["params"]
    shards = sorted(model.glob("*.safetensors"))
    ckpt_bytes = sum(p.stat().st_size for p in shards)

    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        parser.error(f"unknown --ops {', '.join(unknown)}; choose from {', '.join(OPS)}")
    runs: dict[str, list[dict]] = {op: [] for op in ops}
    for rep in range(args.repeats):
        for op in ops:
            result = _run_child(op, args)
            runs[op].append(result)
            print(f"[{rep + 1}/{args.repeats}] {op:18s} {result['seconds']:7.2f} s  peak "
                  f"{result['peak'] / GIB:.2f} GiB  {result.get('check', '')}",
                  file=sys.stderr, flush=True)

    med = {op: {k: statistics.median(r[k] for r in rs) for k in rs[0]
                if isinstance(rs[0][k], int | float)} for op, rs in runs.items()}
    checks = {op: sorted({r.get("check", "-") for r in rs}) for op, rs in runs.items()}
    head = {"params": params, "checkpoint_bytes": ckpt_bytes, "shards": len(shards),
            "devices": args.devices, "repeats": args.repeats}
    if args.json:
        print(json.dumps({**head, "median": med, "checks": checks, "runs": runs}, indent=1))
        return 0

    print(f"random Llama checkpoint: {params / 1e9:.3f}B params, {ckpt_bytes / GIB:.2f} GiB "
          f"bfloat16 in {len(shards)} safetensors shards (+ index); jaxpar on "
          f"{args.devices} CPU devices, fsdp preset; median of {args.repeats} fresh "
          "processes each")
    rows = []
    for op in ops:
        m = med[op]
        base = m["loaded"] if "loaded" in m else m["imports"]
        rows.append((op, m["seconds"], m["peak"], base, m["anon"], m["file"],
                     "/".join(checks[op])))
        if "touch_seconds" in m:
            rows.append(("  + read weights", m["seconds"] + m["touch_seconds"],
                         m["touch_peak"], base, m["touch_anon"], m["touch_file"], "-"))
    cols = ("operation", "time s", "peak GiB", "base", "peak-base", "anon pk",
            "file pk", "check")
    print(f"{cols[0]:<18} {cols[1]:>7} {cols[2]:>8} {cols[3]:>7} {cols[4]:>9} {cols[5]:>7} "
          f"{cols[6]:>7}  {cols[7]}")
    for name, seconds, peak, base, anon, file, check in rows:
        print(f"{name:<18} {seconds:7.2f} {_gib(peak):>8} {_gib(base):>7} "
              f"{_gib(peak - base):>9} {_gib(anon):>7} {_gib(file):>7}  {check}")
    notes = []
    for op in ops:
        m = med[op]
        if "bytes_read" in m:
            notes.append(f"{op}: read {m['bytes_read'] / GIB:.2f} GiB of tensor data "
                         f"({m['bytes_read'] / ckpt_bytes:.2f}x the checkpoint); the model's "
                         f"arrays hold {m['model_bytes'] / GIB:.2f} GiB; anonymous RSS "
                         f"{m['anon_after'] / GIB:.2f} GiB once load returned")
        if "loaded" in m:
            notes.append(f"{op}: base = RSS once loaded, before the save (the load's own "
                         f"peak was {m['load_peak'] / GIB:.2f} GiB); wrote "
                         f"{m['written'] / GIB:.2f} GiB in {int(m['files'])} file(s)")
        if op.startswith("hf-load"):
            notes.append(f"{op}: the model's tensors hold {m['model_bytes'] / GIB:.2f} GiB")
    for dt in ("f32", "bf16"):
        a, b = med.get(f"jaxpar-load-{dt}"), med.get(f"hf-load-{dt}")
        if a and b:
            added = (a["peak"] - a["imports"]) / (b["peak"] - b["imports"])
            notes.append(f"{dt}: jaxpar load / transformers load = time "
                         f"{a['seconds'] / b['seconds']:.2f}x, peak RSS "
                         f"{a['peak'] / b['peak']:.2f}x, peak - base {added:.2f}x")
            read = (a["peak"] - a["imports"]) / (b["touch_peak"] - b["imports"])
            notes.append(f"{dt}: jaxpar load / (transformers load + read weights) = time "
                         f"{a['seconds'] / (b['seconds'] + b['touch_seconds']):.2f}x, peak "
                         f"RSS {a['peak'] / b['touch_peak']:.2f}x, peak - base {read:.2f}x")
    for note in notes:
        print("  " + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
