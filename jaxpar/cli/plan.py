"""``jaxpar plan``: print the best plans as a table or JSON, optionally write the winner.

The search tries host offload (optimizer state, streamed layer weights, activations saved
to the host) when no layout fits without it; the table then shows what each plan keeps in
host memory and how much, and the winner's reason says what moved and what it costs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.planner import slices
from jaxpar.planner.api import estimate, plan, resolve_model, run_config, to_dict
from jaxpar.planner.catalog import parse_chips
from jaxpar.storage.folders import check_writable
from jaxpar.storage.remote import check_output_file, is_remote, output_file


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f}"


def _mesh_text(mesh: dict) -> str:
    parts = []
    for axis, m in mesh.items():
        if m["size"] > 1:
            parts.append(f"{axis}={m['ici']}" + (f"*{m['dcn']}" if m["dcn"] > 1 else ""))
    return " ".join(parts) or "single"


def _allowed(text: str | int | None) -> tuple[int, ...] | None:
    """``"1,2,4"`` -> ``(1, 2, 4)``; None passes through."""
    if text is None or isinstance(text, int):
        return None if text is None else (text,)
    try:
        sizes = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise JaxparError(f"axis sizes must be positive integers separated by commas, got "
                          f"{text!r}")
    return sizes


def _pipeline_text(row: dict) -> str:
    """Pipeline microbatches and schedule, e.g. ``8 1f1b``; ``-`` without stages."""
    kind = row.get("pipeline_schedule")
    if not kind:
        return "-"
    short = {"interleaved_1f1b": f"1f1b x{row.get('pipeline_repeats') or 1}"}
    m = row["pipeline_microbatches"] or row["mesh"]["stage"]["size"]
    return f"{m} {short.get(kind, kind)}"


def _host_text(row: dict) -> str:
    """``used/capacity`` GiB of host memory per device (``used`` alone when the chip's
    host memory is not known), ``-`` for a plan that offloads nothing."""
    if not row.get("host_bytes"):
        return "-"
    cap = row.get("host_capacity_bytes")
    return _gib(row["host_bytes"]) + (f"/{_gib(cap)}" if cap else "")


def table(rows: list[dict], header: str) -> str:
    """Plain aligned text: one line per plan, then the winner's reason. When a plan
    offloads, two more columns say what it keeps in host memory (``offload``: see
    :meth:`jaxpar.planner.Candidate.offload_text`) and how much (``host GiB``)."""
    offloads = any(r.get("offload") for r in rows)
    cols = ["#", "mesh (ici*dcn)", "sp", "cp attn", "zero", "remat", "mb", "pipeline", "mem GiB",
            "fits", "step s", "TFLOP/s", "MFU"]
    if offloads:
        cols[6:6] = ["offload"]
        cols[10:10] = ["host GiB"]
    lines = []
    for i, r in enumerate(rows, 1):
        line = [str(i), _mesh_text(r["mesh"]),
                "yes" if r.get("sequence_parallel") else "-",
                r.get("context_attention") or "-", str(r["zero_stage"]), r["remat"],
                str(r["microbatches"]), _pipeline_text(r),
                f"{_gib(r['memory_per_device_bytes'])}/{_gib(r['hbm_bytes'])}",
                "yes" if r["fits"] else "NO", f"{r['step_time_s']:.3f}",
                f"{r['tflops_per_device']:.0f}", f"{r['mfu'] * 100:.1f}%"]
        if offloads:
            line[6:6] = [r.get("offload") or "-"]
            line[10:10] = [_host_text(r)]
        lines.append(line)
    widths = [max([len(c), *(len(line[i]) for line in lines)]) for i, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
    out = [header, fmt(cols), fmt(["-" * w for w in widths]), *map(fmt, lines)]
    if rows:
        out.append(f"why #1: {rows[0]['reason']}")
        out.append(breakdown_text(rows[0]))
    return "\n".join(out)


def breakdown_text(row: dict, top: int = 10) -> str:
    """Where a plan's step goes: its largest parts (compute by operation, exposed
    collectives by kind and axes, pipeline bubble, optimizer update, host offload's
    exposed transfers and host update) in seconds and shares of the step, then the MFU
    that follows from them."""
    step = row["step_time_s"]
    parts = sorted(row["breakdown"].items(), key=lambda kv: -kv[1])
    lines = [f"where #1's step goes ({step:.3f} s):"]
    for name, t in parts[:top]:
        lines.append(f"  {name:48} {t:9.4f} s  {t / step * 100:5.1f}%")
    rest = sum(t for _, t in parts[top:])
    if rest:
        lines.append(f"  {'(the rest)':48} {rest:9.4f} s  {rest / step * 100:5.1f}%")
    lines.append(f"  MFU {row['mfu'] * 100:.1f}% = model FLOPs / (step x peak), from the "
                 "times above")
    return "\n".join(lines)


def _size(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def traced_text(row: dict, global_batch: int, seq: int) -> str:
    """Where a ``model.factory`` model's figures come from: its activations per device
    (its loss and gradient compiled for one device at the rows #1 gives a device, see
    :mod:`jaxpar.planner.traced`), and why its step time and MFU rank but do not
    predict."""
    m = row["memory"]
    return (f"activations of #1: {_size(m['activation_bytes'])} a device (the model's loss "
            f"and gradient traced and compiled for one device at its share of "
            f"{global_batch} x {seq}; its VJP saves {_size(m.get('traced_residual_bytes', 0))}"
            f" by the jaxpr), temporaries {_size(m['temp_bytes'])} with the gradients\n"
            "step s, TFLOP/s and MFU of a model.factory model: its traced matmul FLOPs at the "
            "chip's matmul rate, a ranking, not a prediction of its step")


def _check_write(target: str, *, force: bool) -> None:
    """Refuse a ``--write`` target that cannot be written, or that exists (without
    ``--force``), before anything is planned."""
    if is_remote(target):
        check_output_file(target, "--write", force=force)
        return
    path = Path(target)
    if path.is_dir():
        raise JaxparError(f"--write {str(path)!r} is a folder; name a file")
    if not path.parent.is_dir():
        raise JaxparError(f"--write {str(path)!r}: folder {str(path.parent)!r} does not exist")
    if path.exists() and not force:
        raise JaxparError(f"--write {str(path)!r} exists; pass --force to replace it")
    check_writable(path, "--write", file=True)


def verified(plans: list, rows: list[dict], base: Any, machine: Any,
             args: argparse.Namespace) -> tuple[list, list[dict]]:
    """``--verify K``: the first K plans compiled for the machine's TPU slices or GPU nodes
    by the TPU or GPU compiler (:func:`jaxpar.analysis.inspection.compile_step`); a plan
    the compiler says
    does not fit is dropped, and each kept row gets ``compiler_bytes`` beside the
    planner's ``memory_per_device_bytes``. A plan the compiler fits in more than 95% of
    the chip's HBM (:data:`jaxpar.analysis.report.TIGHT`) is kept as ``tight``, ranked
    after the verified plans with headroom. Plans after the first K are kept unverified.
    Its progress lines go to stderr, so ``--json`` prints JSON alone on stdout."""
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxpar.analysis.inspection import StepDoesNotFit, compile_step, step_report
    from jaxpar.analysis.report import fmt_bytes
    from jaxpar.analysis.targets import GPU_SPECS, gpu_target, topology_for, tpu_target

    kind = machine.chip.name
    if kind in GPU_SPECS:
        target, compiler = gpu_target(f"{kind}:{machine.slices}x{machine.per_slice}"), "GPU"
    elif kind.startswith("tpu-"):
        target = tpu_target(f"{kind}:{topology_for(kind, machine.per_slice)}", machine.slices)
        compiler = "TPU"
    else:
        raise JaxparError(f"--verify compiles with the TPU or GPU compiler: --chips "
                          f"{args.chips} is neither a TPU kind nor one of {', '.join(GPU_SPECS)}")
    roomy, tight, unverified = [], [], []  # (plan, row) pairs, ranked in this order
    for i, (est, row) in enumerate(zip(plans, rows, strict=True), 1):
        if i > args.verify:
            unverified.append((est, row))
            continue
        config = run_config(est, base, None, args.global_batch, args.seq)
        try:
            memory = step_report(compile_step(config, target))["memory"]
        except StepDoesNotFit as err:
            print(f"verify #{i}: dropped, the {compiler} compiler needs more than "
                  f"{fmt_bytes(err.temp_bytes)} of temporaries ({fmt_bytes(err.hbm_bytes)} "
                  f"of HBM); the planner said {fmt_bytes(row['memory_per_device_bytes'])}",
                  file=sys.stderr)
            continue
        ratio = row["memory_per_device_bytes"] / memory["total_bytes"]
        share = memory["total_bytes"] / memory["hbm_bytes"]
        print(f"verify #{i}: the {compiler} compiler needs {fmt_bytes(memory['total_bytes'])} a "
              f"device, the planner {fmt_bytes(row['memory_per_device_bytes'])} (x{ratio:.2f})"
              + ("" if memory["fits"] else "; dropped: it does not fit")
              + (f"; tight: {100 * share:.0f}% of {fmt_bytes(memory['hbm_bytes'])} of HBM, "
                 "ranked after the plans with headroom" if memory.get("tight") else ""),
              file=sys.stderr)
        if memory["fits"]:
            checked = dict(row, compiler_bytes=memory["total_bytes"],
                           tight=bool(memory.get("tight")))
            (tight if checked["tight"] else roomy).append((est, checked))
    ranked = roomy + tight + unverified
    return [e for e, _ in ranked], [r for _, r in ranked]


def command(args: argparse.Namespace) -> int:
    """Run ``jaxpar plan`` with the parsed CLI arguments; returns the exit code."""
    overrides = list(args.overrides or [])
    bad = [o for o in overrides if not o.startswith("model.")]
    if bad:
        raise JaxparError(f"jaxpar plan takes model.<field>=value overrides only, got {bad[0]!r}")
    for flag, value in (("--global-batch", args.global_batch), ("--seq", args.seq),
                        ("--top", args.top), ("--slices", args.slices)):
        if value < 1:
            raise JaxparError(f"{flag} {value}: must be at least 1")
    if args.verify < 0:
        raise JaxparError(f"--verify {args.verify}: must be 0 or more (the number of plans "
                          "to compile)")
    if args.write:
        _check_write(args.write, force=args.force)
    resolved = resolve_model(args.model, overrides)
    machine = parse_chips(args.chips, slices=args.slices, catalog=args.catalog)
    offload = args.offload
    plans = plan(resolved.config, chips=machine, global_batch=args.global_batch, seq=args.seq,
                 top=args.top, context=_allowed(args.context), expert=_allowed(args.expert),
                 offload=offload, quantize=args.quantize)
    rows = [to_dict(p, args.global_batch, args.seq) for p in plans]
    if args.verify:
        plans, rows = verified(plans, rows, resolved.config, machine, args)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        spec = resolved.spec_for(1)
        active = (f", {spec.n_active_dense / 1e9:.2f}B active in matmuls" if spec.is_moe
                  else "")
        header = (f"plan: {spec.n_params / 1e9:.2f}B params{active} ({resolved.name}) on "
                  f"{machine.describe()}, "
                  f"global batch {args.global_batch} x seq {args.seq}, bf16 compute"
                  f"{'' if args.quantize == 'none' else f' ({args.quantize} matmuls)'}, "
                  f"f32 master + Adam")
        print(table(rows, header))
        if spec.tracer is not None and rows:
            print(traced_text(rows[0], args.global_batch, args.seq))
        if plans and machine.slices > 1:
            best = plans[0]
            hpz = None
            if best.collectives and any("data" in r["axes"] and r["kind"] == "all-gather"
                                        for r in best.collectives):
                hpz = estimate(resolved.config, dataclasses.replace(best.candidate, hpz=True),
                               chips=machine, global_batch=args.global_batch, seq=args.seq)
            print("\n" + slices.report(best, machine, spec.n_params, hpz=hpz))
    if not plans or not plans[0].fits:
        best = (f"the smallest needs {_gib(rows[0]['memory_per_device_bytes'])} of "
                f"{_gib(rows[0]['hbm_bytes'])} GiB per device" if rows else "no layout works")
        even = ", even with host offload" if offload != "never" else ""
        raise JaxparError(
            f"no plan fits {resolved.name} on {machine.describe()} at global batch "
            f"{args.global_batch} x seq {args.seq}{even} ({best}); use more chips, a smaller "
            "--global-batch or --seq" + ("; nothing was written" if args.write else ""))
    if args.write:
        config = run_config(plans[0], resolved.config, None, args.global_batch, args.seq)
        with output_file(args.write, "--write") as local:
            config.save(local)
        if not args.json:
            print(f"wrote {args.write}: jaxpar train --config {args.write}")
    return 0
