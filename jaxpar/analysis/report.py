"""Plain-text tables for the command line: aligned columns, byte sizes, ratios.

No terminal library is needed; every function returns a string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.50 KiB'``; ``None`` -> ``'-'``."""
    if n is None:
        return "-"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{int(value)} B" if unit == 0 else f"{value:.2f} {_UNITS[unit]}"


def fmt_count(n: float | None) -> str:
    """A large count in engineering notation (``9.87e+08``), small ones as integers."""
    if n is None:
        return "-"
    return f"{n:,.0f}" if abs(n) < 1e6 else f"{n:.3e}"


def _or_dash(x: Any) -> Any:
    return "-" if x is None else x


def fmt_ratio(predicted: float | None, measured: float | None) -> str:
    """``predicted / measured`` to two decimals, or ``'-'`` when either is missing or zero."""
    if predicted is None or not measured:
        return "-"
    return f"{predicted / measured:.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
          right: Sequence[int] = (), indent: int = 2) -> str:
    """An aligned plain-text table; columns whose index is in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return " " * indent + "  ".join(parts).rstrip()

    rule = (" " * indent + "  ".join("-" * w for w in widths)).rstrip()
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def fmt_spec(spec: Sequence[Any]) -> str:
    """A JSON-style PartitionSpec (entries None, an axis, or a list of axes) as text."""
    def one(entry: Any) -> str:
        if entry is None:
            return "-"
        return entry if isinstance(entry, str) else "{" + ",".join(entry) + "}"

    return "(" + ", ".join(one(e) for e in spec) + ")" if spec else "replicated"


def fmt_axes(axes: Sequence[Any] | None) -> str:
    """Logical names or mesh axes, comma-separated; ``None`` entries shown as ``-``."""
    if axes is None:
        return "-"
    return ", ".join("-" if a is None else str(a) for a in axes) or "-"


TIGHT = 0.95
"""A step the compiler lays out in more than this share of a device's HBM is *tight*: it
fits on paper, but the runtime's own buffers and fragmentation may leave it short."""


def is_tight(total_bytes: float, hbm_bytes: float) -> bool:
    """Whether ``total_bytes`` fits ``hbm_bytes`` with less than ``1 - TIGHT`` to spare."""
    return TIGHT * hbm_bytes < total_bytes <= hbm_bytes


def fit_line(memory: dict[str, Any]) -> str:
    """``fits: 71.30 GiB of 95.00 GiB per device (75%)`` (``tight`` above :data:`TIGHT`),
    or why it does not fit: the compiler's own breakdown of the bytes a device needs."""
    total, hbm = memory["total_bytes"], memory["hbm_bytes"]
    if memory.get("fits", total <= hbm):
        if is_tight(total, hbm):
            return (f"fits, tight: {fmt_bytes(total)} of {fmt_bytes(hbm)} per device "
                    f"({100 * total / hbm:.0f}%, above {100 * TIGHT:.0f}%: the runtime's "
                    "buffers and fragmentation may not leave room)")
        return (f"fits: {fmt_bytes(total)} of {fmt_bytes(hbm)} per device "
                f"({100 * total / hbm:.0f}%)")
    return (f"does not fit: {fmt_bytes(total)} needed of {fmt_bytes(hbm)} per device "
            f"(arguments {fmt_bytes(memory['argument_bytes'])}, outputs "
            f"{fmt_bytes(memory['output_bytes'] - memory['alias_bytes'])} beyond the donated "
            f"arguments, temporaries {fmt_bytes(memory['temp_bytes'])})")


def render_inspection(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`jaxpar.analysis.inspection.inspect_config`'s report."""
    out: list[str] = []
    head = report["header"]
    if head.get("platform", "cpu") == "cpu":
        out.append(f"jaxpar inspect: {head['config']} on {head['n_devices']} "
                   f"{head['platform']} devices, mesh {head['mesh']}")
    else:
        slices = head.get("slices", 1)
        out.append(f"jaxpar compile: {head['config']} for {head['target']} "
                   f"({head['n_devices']} {head.get('device_kind', '')} devices, {slices} "
                   f"{'node' if head['platform'] == 'gpu' else 'slice'}{'s' * (slices > 1)}; "
                   f"the {head['platform'].upper()} compiler, run here), mesh {head['mesh']}")
    out.append(f"  model {report['param_count']:,} params; {head['plan']}")
    out += [f"  {line}" for line in head.get("auto", [])]
    out.append(f"  batch {head['global_batch']} x {head['seq_len']} tokens, attention "
               f"{head.get('attention', 'auto')}; one train step compiled in "
               f"{head['compile_s']:.1f} s (not run)")
    if head.get("pipeline"):
        out.append(f"  {head['pipeline']}")
    if head.get("pipeline_timeline"):
        out.append(f"  {head['pipeline_timeline']}")

    params = report["params"]
    total = sum(p["bytes_per_device"] for p in params)
    out.append(f"\nParameters: {len(params)} arrays, {report['param_count']:,} values, "
               f"{fmt_bytes(total)} per device")
    rep = report.get("replication")
    if rep:
        largest = ", ".join(p for p, _ in rep["largest"][:3]) or "none"
        out.append(f"  replicated by the rules: {100 * rep['replicated_share']:.1f}% of "
                   f"parameter bytes (largest: {largest})")
    rows = [(p["path"], str(tuple(p["shape"])), p["dtype"], fmt_axes(p["logical_axes"]),
             fmt_spec(p["spec"]), fmt_bytes(p["bytes_per_device"]),
             "" if p.get("trainable", True) else "frozen") for p in params]
    out.append(table(["path", "shape", "dtype", "logical axes", "spec", "per device", ""],
                     rows, right=(5,)))

    pred = report.get("predicted") or {}
    pmem = pred.get("memory") or {}
    mem = report["memory"]
    out.append("\nMemory per device (XLA)")
    mrows = []
    rows_m = [("argument_bytes", "arguments"), ("output_bytes", "outputs"),
              ("temp_bytes", "temp"), ("alias_bytes", "aliased (donated)"),
              ("total_bytes", "total = args + outs - aliased + temp")]
    if mem.get("host_total_bytes"):  # offloaded state: device and host memory apart
        rows_m = [(k, f"device {label}") for k, label in rows_m] + [
            ("host_argument_bytes", "host arguments"), ("host_output_bytes", "host outputs"),
            ("host_total_bytes", "host total")]
    for key, label in rows_m:
        if key not in mem:
            continue
        p = pmem.get("host_bytes" if key == "host_total_bytes" else key)
        mrows.append((label, fmt_bytes(mem[key]), fmt_bytes(p), fmt_ratio(p, mem[key])))
    out.append(table(["", "measured", "predicted", "pred/meas"], mrows, right=(1, 2, 3)))
    if mem.get("xla_temp_bytes") is not None:
        out.append(f"  temp is the TPU compiler's program requirement (its heap, with "
                   f"{fmt_bytes(mem['fragmentation_bytes'])} of gaps, its kernels' scoped "
                   f"memory and code), from its log; XLA's memory_analysis() reports "
                   f"{fmt_bytes(mem['xla_temp_bytes'])}, the heap's gaps counted twice")
    if mem.get("hbm_bytes"):
        out.append("  " + fit_line(mem))

    out.append("\nCollectives per device and step (each HLO instruction times its loops' "
               "trips; bytes a device receives)")
    rows_c = report["comparison"]["collectives"]
    crows = [(c["kind"], fmt_axes(c["axes"]), c["count"], c.get("executions", c["count"]),
              _or_dash(c.get("predicted_executions")),
              fmt_bytes(c.get("wire_bytes_per_step")),
              fmt_bytes(c.get("predicted_wire_bytes_per_step")),
              fmt_ratio(c.get("predicted_wire_bytes_per_step"), c.get("wire_bytes_per_step")))
             for c in rows_c]
    if crows:
        meas = sum(c.get("wire_bytes_per_step") or 0 for c in rows_c)
        preds = [c["predicted_wire_bytes_per_step"] for c in rows_c
                 if c.get("predicted_wire_bytes_per_step") is not None]
        p_total = sum(preds) if preds else None
        crows.append(("total", "", sum(c["count"] for c in rows_c),
                      sum(c.get("executions", c["count"]) for c in rows_c), "",
                      fmt_bytes(meas), fmt_bytes(p_total), fmt_ratio(p_total, meas)))
        out.append(table(["kind", "mesh axes", "in HLO", "runs", "predicted", "received",
                          "predicted", "pred/meas"], crows, right=(2, 3, 4, 5, 6, 7)))
        matmuls = sum(c.get("in_collective_matmuls") or 0 for c in rows_c)
        if matmuls:
            out.append(f"  {matmuls} collective-permutes of the compiler's collective matmuls "
                       "are counted under the gather or reduce-scatter they make up")
    else:
        out.append("  none (a single device, or nothing to communicate)")

    out.append("\nCompute per device")
    p_flops = report["comparison"].get("predicted_flops")
    detail = report.get("flops_detail", {})
    frows = [("matmul FLOPs (every loop trip)", fmt_count(report["flops"]), fmt_count(p_flops),
              fmt_ratio(p_flops, report["flops"]))]
    if "xla_cost_analysis" in detail:
        frows.append(("XLA cost analysis FLOPs (loop bodies once)",
                      fmt_count(detail["xla_cost_analysis"]), "-", "-"))
    step = pred.get("step_time_s")
    if step is not None:
        frows.append(("step time (s), not run", "-", f"{step:.4g}", "-"))
    out.append(table(["", "measured", "predicted", "pred/meas"], frows, right=(1, 2, 3)))
    kernels = report.get("kernels") or {}
    if kernels.get("tpu_custom_call"):
        out.append(f"\nPallas/Mosaic kernels compiled for the TPU: "
                   f"{kernels['tpu_custom_call']} tpu_custom_call(s)")
    for note in report.get("notes", []):
        out.append(f"\nnote: {note}")
    return "\n".join(out)


def render_peak_buffers(section: dict[str, Any] | None) -> str:
    """The ``peak_buffers`` section of a compile report (``jaxpar compile/inspect
    --peak-buffers N``): XLA's largest buffers of device memory, with the values that
    use each one after another."""
    if not section:
        return "largest buffers: XLA wrote no memory-usage report for the step"
    rows = [(fmt_bytes(b["bytes"]), b["values"], b["shapes"]) for b in section["buffers"]]
    return (f"largest buffers: {len(rows)} of XLA's layout of the step's device memory "
            f"(its heap peaks at {fmt_bytes(section['total_bytes'])}; buffers live at "
            "different times share space; XLA's memory-usage report, sizes as it rounds "
            "them)\n" + table(["size", "values", "shapes (one after another)"], rows,
                               right=(0, 1)))
