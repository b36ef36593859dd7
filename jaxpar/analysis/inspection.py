"""``jaxpar inspect``'s and ``jaxpar compile``'s report: a config's training step compiled
ahead of time, read back (collectives by mesh axis, memory, FLOPs, each parameter's stored
sharding) and set beside the planner's prediction for the same layout.

The step is built from shapes alone (:func:`compile_step`): the model, the optimizer state
and the batch are ``jax.ShapeDtypeStruct``s with the plan's shardings, so it compiles for
this machine's devices or for a TPU slice that is not here (:mod:`jaxpar.analysis.targets`),
and it is the program ``jaxpar train`` runs: the same Trainer lowers it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxpar.analysis.buffers import STEP_MODULE
from jaxpar.analysis.hlo import (
    collective_table,
    custom_calls,
    flops,
    matmul_flops,
    memory_stats,
)
from jaxpar.analysis.loops import parse_module
from jaxpar.analysis.report import fmt_bytes, is_tight
from jaxpar.analysis.sources import explain_collectives
from jaxpar.analysis.targets import CUDNN_MISSING, Target, cpu_target
from jaxpar.analysis.tpu_log import ProgramMemory, log_mark, program_memory
from jaxpar.config.assembly import Assembly
from jaxpar.errors import JaxparError
from jaxpar.parallel import schedules
from jaxpar.parallel.pipeline import STAGE, Schedule, manual_batch_axes
from jaxpar.planner.auto import assemble
from jaxpar.sharding.mesh import describe
from jaxpar.sharding.partitioning import logical_names, mostly_replicated
from jaxpar.sharding.paths import path_str


def _json_spec(spec: Any) -> list[Any]:
    return [e if e is None or isinstance(e, str) else list(e) for e in spec]


def param_rows(trainer: Any) -> list[dict[str, Any]]:
    """One row per model variable as the trainer stores it: path, shape, dtype, logical
    axes, the PartitionSpec of the stored array (ZeRO-3 included), per-device bytes and
    whether it trains. JSON-ready."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    rows = []
    for group, trainable in (("params", True), ("frozen", False)):
        for path, variable in nnx.to_flat_state(trainer.state[group]):
            value = variable.get_value()
            if not hasattr(value, "shape"):
                continue
            sharding = getattr(value, "sharding", None)
            spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
            shard = (sharding.shard_shape(value.shape) if sharding is not None
                     else tuple(value.shape))
            names = logical_names(variable)
            rows.append({
                "path": path_str(path),
                "shape": list(value.shape),
                "dtype": str(value.dtype),
                "logical_axes": list(names) if names is not None else None,
                "spec": _json_spec(spec),
                "shard_shape": list(shard),
                "bytes_per_device": int(np.prod(shard, dtype=np.int64)) * value.dtype.itemsize,
                "trainable": trainable,
            })
    return sorted(rows, key=lambda r: r["path"])


def planner_prediction(config: Any, n_devices: int, target: Target | None = None
                       ) -> tuple[dict[str, Any] | None, str]:
    """``jaxpar.planner.predict(config, n_devices)`` (for a TPU target, its accelerator
    forms and chip figures) or ``(None, why)`` when unavailable."""
    try:
        from jaxpar.planner import predict
    except ImportError as err:
        return None, f"no planner prediction: jaxpar.planner is not available ({err})"
    try:
        if target is not None and target.platform != "cpu":
            return predict(config, n_devices, backend=target.platform,
                           machine=target.machine), ""
        return predict(config, n_devices), ""
    except Exception as err:  # noqa: BLE001 - a planner failure must not hide the measurement
        return None, f"no planner prediction: {type(err).__name__}: {err}"


def _axes_key(axes: Any, mesh: Mesh) -> tuple[str, ...]:
    order = {name: i for i, name in enumerate(mesh.shape)}
    return tuple(sorted((str(a) for a in axes or ()), key=lambda a: order.get(a, len(order))))


def compare_collectives(measured: list[dict[str, Any]], predicted: list[dict[str, Any]] | None,
                        mesh: Mesh) -> list[dict[str, Any]]:
    """Measured collective rows joined with predicted ones on (kind, mesh axes).

    Each row gets the planner's figures in the units the two sides share:
    ``predicted_count`` / ``predicted_bytes_per_device`` (instructions in the HLO text, a
    loop body once), ``predicted_executions`` / ``predicted_bytes_per_step`` (as the step
    runs them, every layer and microbatch) and ``predicted_wire_bytes_per_step`` (bytes a
    device receives in the step), and ``step_ratio`` (predicted / measured bytes received
    per step). They are None when the planner predicted none of that kind and axes;
    predicted rows that XLA did not emit appear with ``count`` 0 and measured bytes None.
    """
    keys = ("bytes_per_device", "count", "bytes_per_step", "executions", "wire_bytes_per_step")
    pred: dict[tuple[str, tuple[str, ...]], dict[str, float]] = {}
    for row in predicted or []:
        key = (row["kind"], _axes_key(row.get("axes"), mesh))
        total = pred.setdefault(key, dict.fromkeys(keys, 0))
        for k in keys:
            total[k] += row.get(k, 0)
    out = []

    def joined(row: dict[str, Any], p: dict[str, float] | None) -> dict[str, Any]:
        p = p or {}
        ratio = (p["wire_bytes_per_step"] / row["wire_bytes_per_step"]
                 if p and row.get("wire_bytes_per_step") else None)
        return dict(row, **{f"predicted_{k}": p.get(k) for k in keys}, step_ratio=ratio)

    for row in measured:
        out.append(joined(row, pred.pop((row["kind"], _axes_key(row["axes"], mesh)), None)))
    for (kind, axes), p in pred.items():
        out.append(joined({"kind": kind, "axes": list(axes), "count": 0, "executions": 0,
                           "bytes_per_device": None, "bytes_per_step": None,
                           "wire_bytes_per_step": None}, p))
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return str(x)


def _busy_share(run: Assembly) -> float | None:
    """A tick-by-tick schedule that picks each stage's work by ``lax.switch`` (not in
    lockstep): the share of ticks in which each of its two switches (forward, backward)
    runs a chunk; None otherwise."""
    schedule = run.schedule
    if schedule is None or not schedule.backward_in_schedule:
        return None
    plan = run.plan
    batch = run.config.train.global_batch // max(plan.microbatches, 1)
    manual = manual_batch_axes(plan, batch, schedule.microbatches)
    if schedules.runs_lockstep(plan.mesh, STAGE, manual):
        return None
    tl = schedules.timeline(schedule.kind, schedule.stages, schedule.microbatches,
                            schedule.repeats)
    return schedule.microbatches * schedule.repeats / tl.ticks


def _timeline_text(schedule: Schedule | None) -> str:
    """What the tick table a 1F1B schedule runs says (counted, not from the formulas)."""
    if schedule is None or not schedule.backward_in_schedule:
        return ""
    tl = schedules.timeline(schedule.kind, schedule.stages, schedule.microbatches,
                            schedule.repeats)
    idle = sum(tl.idle_ticks())
    busy = idle / tl.bubble() if tl.bubble() else 0
    share = idle / (idle + busy) if idle + busy else 0.0
    return (f"timeline: {tl.ticks} ticks, {max(tl.idle_ticks())} idle on each stage (bubble "
            f"{100 * share:.1f}% of stage-ticks, as counted; {100 * tl.bubble():.1f}% of "
            f"busy time, Megatron's measure), at most {max(tl.in_flight())} stage inputs "
            "held")


def for_slices(config: Any, slices: int) -> Any:
    """``config`` for a target of ``slices`` slices: a mesh that names no DCN axis puts the
    slices on ``data`` (data parallelism across slices, as a multislice run would)."""
    if slices <= 1 or config.mesh.dcn() is not None:
        return config
    return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, dcn_data=slices))


class StepDoesNotFit(JaxparError):
    """The TPU compiler refused the step: its temporaries exceed the device's HBM."""

    def __init__(self, message: str, temp_bytes: float, hbm_bytes: float):
        super().__init__(message)
        self.temp_bytes, self.hbm_bytes = temp_bytes, hbm_bytes


_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                  r"\(([\d.]+)([KMGT]?)\)")


def _bytes(value: str, unit: str) -> float:
    return float(value) * 1024 ** " KMGT".index(unit or " ")


@dataclasses.dataclass
class CompiledStep:
    """One training step compiled ahead of time, and what it was built from."""

    run: Assembly
    target: Target
    batch: Any
    """The global batch's shape (a ``jax.ShapeDtypeStruct`` with its sharding)."""
    lowered: Any
    compiled: Any
    compile_s: float
    program: ProgramMemory | None = None
    """The TPU compiler's own account of the program's HBM (:mod:`jaxpar.analysis.tpu_log`);
    None on other targets, or where its log could not be read."""


def compile_step(config: Any, target: Target | None = None) -> CompiledStep:
    """Build ``config``'s training step from shapes alone and compile it for ``target``
    (default: this machine's devices).

    The run is assembled abstractly (:func:`jaxpar.config.assembly.assemble` with
    ``abstract=True``: model, LoRA, optimizer state, ZeRO, offload, precision, remat,
    quantization and pipeline schedule as ``jaxpar train`` builds them, with nothing
    allocated), the global batch is a ``ShapeDtypeStruct``, and the Trainer's own step is
    lowered and compiled. Compiling for a TPU slice uses the TPU compiler on this host.
    ``auto`` plan knobs take what the planner picks for ``target``'s chips
    (:func:`jaxpar.planner.auto.resolve_auto`), as ``jaxpar train`` on them would.
    """
    import time

    import jax

    target = target or cpu_target()
    config = for_slices(config, target.slices)
    run = assemble(config, target.devices, abstract=True, machine=target.machine)
    trainer = run.trainer
    shape = (config.train.global_batch, config.train.seq_len + 1)
    batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=trainer.plan.batch_sharding(2))
    start = time.perf_counter()
    try:
        lowered = trainer.lower(batch)
    except RuntimeError as err:  # jax asks cuDNN for its version as it traces its attention
        if target.platform == "gpu" and "cuDNN not found" in str(err):
            raise JaxparError(f"--target {target.name}: {CUDNN_MISSING}") from None
        raise
    mark = log_mark() if target.platform == "tpu" else None
    try:
        compiled = lowered.compile()
    except Exception as err:  # noqa: BLE001 - the TPU compiler's "does not fit" is an answer
        m = _OOM.search(str(err))
        if m is None:
            raise
        temp, hbm = _bytes(m[1], m[2]), _bytes(m[3], m[4])
        raise StepDoesNotFit(
            f"does not fit {target.name}: the TPU compiler needs {fmt_bytes(temp)} of "
            f"temporaries a device, beyond the {fmt_bytes(hbm)} of HBM it can use (mesh "
            f"{describe(run.plan.mesh)}, remat {run.plan.remat}, zero "
            f"{run.plan.zero_stage}); try plan.remat=full, a higher plan.zero_stage, more "
            "microbatches or more chips", temp, hbm) from None
    elapsed = time.perf_counter() - start
    program = program_memory(STEP_MODULE, since=mark) if mark is not None else None
    return CompiledStep(run, target, batch, lowered, compiled, elapsed, program)


def _memory(compiled: Any, target: Target, program: ProgramMemory | None = None
            ) -> dict[str, Any]:
    memory = memory_stats(compiled)
    if not memory:
        return memory
    # XLA's analysis counts the heap's gaps twice on a TPU: the compiler's program
    # requirement is what a device needs (see jaxpar.analysis.tpu_log). None where the
    # compiler gives no account of its own (XLA:CPU, the GPU compiler).
    memory.update(xla_temp_bytes=None, fragmentation_bytes=None, usable_bytes=None)
    if program is not None:
        memory.update(xla_temp_bytes=memory["temp_bytes"], temp_bytes=program.program_bytes,
                      fragmentation_bytes=program.fragmentation_bytes,
                      usable_bytes=program.usable_bytes)
    # Outputs that alias donated arguments take no extra space.
    memory["total_bytes"] = (memory["argument_bytes"] + memory["output_bytes"]
                             - memory["alias_bytes"] + memory["temp_bytes"])
    memory["host_total_bytes"] = (memory["host_argument_bytes"] + memory["host_output_bytes"]
                                  - memory["host_alias_bytes"] + memory["host_temp_bytes"])
    memory["hbm_bytes"] = int(target.hbm_bytes)
    memory["fits"] = memory["total_bytes"] <= target.hbm_bytes
    memory["tight"] = is_tight(memory["total_bytes"], target.hbm_bytes)
    return memory


def traced_notes(predicted: dict[str, Any] | None, memory: dict[str, Any], remat: str
                 ) -> list[str]:
    """What a ``model.factory`` model's prediction rests on: its activations traced (see
    :mod:`jaxpar.planner.traced`), its step time not predicted, and, when XLA keeps far
    more temporaries than the traced step needs under a remat policy, that the compiler
    did not keep to the policy."""
    pmem = (predicted or {}).get("memory") or {}
    notes = []
    if "traced_residual_bytes" in pmem:
        notes.append(f"activations traced: {fmt_bytes(pmem['activation_bytes'])} a device "
                     "of the model's loss and gradient compiled for one device at its rows "
                     f"(its VJP saves {fmt_bytes(pmem['traced_residual_bytes'])} by the "
                     "jaxpr, before XLA's fusions)")
    if (predicted or {}).get("not_predicted"):
        notes.append(predicted["not_predicted"])
    temp, want = memory.get("temp_bytes"), pmem.get("temp_bytes")
    if "traced_residual_bytes" in pmem and remat != "none" and temp and want \
            and temp > 1.5 * want:
        notes.append(f"XLA keeps {fmt_bytes(temp)} of temporaries where the traced step "
                     f"needs {fmt_bytes(want)} under remat {remat}: the compiler did not keep "
                     "to the policy (XLA:CPU schedules the recomputation of blocks called "
                     "one after another early; blocks run as one jax.lax.scan keep to it)")
    return notes


def inspect_config(config: Any, *, source: str = "defaults",
                   target: Target | None = None) -> dict[str, Any]:
    """Compile one train step for ``target`` (default: this machine's devices) without
    running it (:func:`compile_step`), and report it (:func:`step_report`)."""
    return step_report(compile_step(config, target), source=source)


def step_report(step: CompiledStep, *, source: str = "defaults") -> dict[str, Any]:
    """What a compiled step holds, beside the planner's prediction.

    Returns a JSON-ready dict with ``params`` (see :func:`param_rows`), ``memory``
    (:func:`memory_stats` plus ``total_bytes``, the device's ``hbm_bytes`` and whether the
    step ``fits``), ``collectives`` (:func:`collective_table`), ``flops`` (per device,
    :func:`matmul_flops`; XLA's cost-analysis figure, which counts loop bodies once, is in
    ``flops_detail``), ``predicted`` (the planner's prediction or None), ``comparison``
    (measured beside predicted), ``param_count``, ``header`` and ``notes`` (among them, the
    op and model line that brought each all-to-all, from
    :func:`jaxpar.analysis.sources.explain_collectives`).
    """
    run, compiled, target = step.run, step.compiled, step.target
    config = run.config
    trainer, plan = run.trainer, run.plan
    memory = _memory(compiled, target, step.program)
    hlo = compiled.as_text()
    module = parse_module(hlo)  # read once for the collectives and the FLOPs
    collectives = collective_table(module, plan.mesh)
    matmuls = matmul_flops(module, branch_share=_busy_share(run))
    params = param_rows(trainer)
    predicted, note = planner_prediction(config, plan.mesh.size, target)
    predicted = _jsonable(predicted) if predicted is not None else None
    notes = [note] if note else []
    if target.platform == "tpu" and step.program is None and memory:
        notes.append("the TPU compiler's account of the program's memory was not found in "
                     "libtpu's log ($TPU_LOG_DIR, default /tmp/tpu_logs): temp is "
                     "memory_analysis()'s, which counts the gaps in the program's heap twice")
    if matmuls["loops_without_trip_count"]:
        notes.append(f"{matmuls['loops_without_trip_count']} loop(s) without a known trip "
                     "count: their bodies' FLOPs are counted once")
    notes += explain_collectives(hlo)  # each all-to-all's op and model line
    notes += traced_notes(predicted, memory, plan.remat)
    schedule = run.schedule
    replication = trainer.replication
    if mostly_replicated(replication):
        notes.append(f"{100 * replication['replicated_share']:.0f}% of parameter bytes are "
                     "replicated; name them with plan.annotations (jaxpar.annotate)")
    return {
        "header": {
            "config": source,
            "n_devices": plan.mesh.size,
            "platform": target.platform,
            "target": target.name,
            "device_kind": target.device_kind,
            "slices": target.slices,
            "mesh": describe(plan.mesh),
            "mesh_shape": dict(plan.mesh.shape),
            "plan": (f"rules {config.plan.rules}, zero {plan.zero_stage}, precision "
                     f"{plan.precision}, remat {plan.remat}, microbatches {plan.microbatches}"
                     + (f", optimizer offload {plan.offload_optimizer:g}"
                        if plan.offload_optimizer else "")
                     + (", update on host" if plan.host_update else "")
                     + (", weights streamed from host" if plan.offload_params else "")
                     + (f", {plan.quantize} matmuls" if plan.quantize != "none" else "")
                     + (f", {plan.quantize_gather} weight gathers"
                        if plan.quantize_gather != "none" else "")),
            "auto": list(run.auto),  # what each auto plan knob became, and why
            "attention": config.model.attention,
            "global_batch": config.train.global_batch,
            "seq_len": config.train.seq_len,
            "compile_s": step.compile_s,
            "pipeline": schedule.describe() if schedule is not None else "",
            "pipeline_timeline": _timeline_text(schedule),
        },
        "replication": {"replicated_share": replication["replicated_share"],
                        "replicated_bytes": replication["replicated_bytes"],
                        "largest": [[p, list(s)] for p, s in replication["largest"]]},
        "param_count": int(sum(np.prod(p["shape"], dtype=np.int64) for p in params)),
        "params": params,
        "memory": memory,
        "collectives": collectives,
        "flops": matmuls["flops"],
        "flops_detail": {"matmul_flops": matmuls["flops"], "xla_cost_analysis": flops(compiled),
                         "dots": matmuls["dots"], "loops": matmuls["loops"]},
        "kernels": custom_calls(hlo),
        "predicted": predicted,
        "comparison": {
            "collectives": compare_collectives(collectives, (predicted or {}).get("collectives"),
                                               plan.mesh),
            "predicted_flops": (predicted or {}).get("flops"),
        },
        "notes": notes,
    }
