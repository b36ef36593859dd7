"""``jaxpar calibrate``: measure this machine's devices and write a catalog entry.

Short microbenchmarks run on every given device at once (each device works on its own
shard inside one ``shard_map``), so a rate is what one device sustains while all of them
are busy, as in a training step; on simulated CPU devices, which share the host's
cores, that is the host's rate split among them.

* matmuls ``(m x k) @ (k x n)`` per device over a grid of shapes, float32 and bfloat16:
  ``f32_flops`` and ``peak_flops`` are the median rates of the large shapes (the
  sustained rate, robust to a timing disturbed by other work; on a GPU or TPU the grid
  adds matmuls up to 8192 wide, and only those of at least 2 x 4096^3 FLOPs count as
  large: a 1024-wide matmul leaves an H100 mostly idle); every timed iteration takes
  the next of several copies of its operands, which together fill the memory
  measurement's working set, so operands come from memory as a step's do (each layer its
  own weights and activations): on the 2-core host of ``benchmarks/planner_cpu.py``
  cache-resident operands ran 10-30% faster (grid medians 24-27 against 18-24 GFLOP/s in
  float32) and the smallest shape, memory-bound once its weights stream, 2-3x faster;
  ``matmul_tile`` and ``op_overhead_s`` are fitted (least squares on log time) so that
  :func:`jaxpar.planner.roofline.matmul_time`, with ``matmul_efficiency`` 1, reproduces
  the whole grid;
* memory: an elementwise update of 64 MB a device on a CPU (a working set like a step's:
  a smaller one runs from the caches), 1 GiB on a GPU or TPU; ``hbm_bw`` = bytes read
  and written per second (``memory_efficiency`` 1);
* saved activations: the gradient of a scan of cheap layers with each layer's activations
  saved for the backward pass and with them recomputed: ``saved_bw``, saved bytes over the
  time difference (on XLA:CPU storing and reloading them costs far more than streaming);
* collectives (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute)
  at several sizes over a 1-D mesh of all devices and over both axes of a 2-D one:
  ``ici_latency_s`` and ``ici_bw`` are the least-squares fit (on relative error) of
  :func:`jaxpar.planner.links.transfer_time`'s formula, ``latency x ring steps + wire
  bytes / bandwidth`` (``torus_dims`` 0, ``collective_efficiency`` 1).

Every timed operation runs ``R`` times inside one compiled loop (each iteration depends
on the previous one), so dispatch costs are not counted; ``R`` is chosen from a first
short run to make each timing last a few milliseconds.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.planner.catalog import Chip, GiB, chip_from_mapping
from jaxpar.planner.roofline import matmul_time

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
MATMUL_GRID = ((16, 256, 256), (64, 64, 128), (128, 64, 128), (128, 256, 256),
               (128, 256, 1024), (128, 1024, 256), (256, 256, 4096), (512, 512, 512),
               (1024, 256, 1024), (512, 1024, 512))
QUICK_GRID = ((16, 256, 256), (128, 64, 128), (128, 256, 1024), (512, 512, 512))
# A GPU or TPU reaches its peak only on large matmuls: these join the grid there.
ACCELERATOR_GRID = ((2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
                    (4096, 8192, 4096), (8192, 4096, 14336))
LARGE_FLOPS = 2 * 128 * 256 * 1024  # shapes at least this big set the peak (CPU)
ACCELERATOR_LARGE_FLOPS = 2 * 4096 ** 3  # and on a GPU or TPU
TILES = (1, 8, 16, 32, 64, 128)
MAX_OPERAND_COPIES = 256
"""The most operand copies a matmul timing cycles through (see :func:`measure_matmuls`)."""


def _time_loop(fn: Callable[[Any], Any], args: tuple, target_s: float, repeats: int
               ) -> tuple[float, int]:
    """Seconds per iteration of ``fn(r, *args)`` (a compiled loop of ``r`` iterations) and
    the ``r`` used: ``(T(r) - T(1)) / (r - 1)``, which leaves out the dispatch, with
    ``T(r)`` the fastest of ``repeats`` timings and ``r`` chosen to last about
    ``target_s``."""
    import jax
    import jax.numpy as jnp

    def once(r: int) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(jnp.int32(r), *args))
        return time.perf_counter() - t0

    once(1)  # compile
    base = min(once(1) for _ in range(3))  # dispatch and one iteration
    # Grow r fourfold until a loop lasts a quarter of the target: an estimate from a loop
    # lost in the dispatch noise (a busy machine) would pick an r that runs far too long.
    r, elapsed = 4, once(4)
    while elapsed < target_s / 4 and r < 10000:
        r = min(4 * r, 10000)
        elapsed = once(r)
    # (at least a tenth of the plain mean: noise in base cannot make r explode)
    per = max((elapsed - base) / (r - 1), 0.1 * elapsed / r)
    r = int(min(max(target_s / per, 2), 10000))
    total = min(once(r) for _ in range(repeats))
    per = (total - base) / (r - 1)
    # A noisy base (a slow first call) can eat the difference: then keep the plain mean.
    return (per if per > 0.5 * total / r else total / r), r


def _mesh(devices: Sequence[Any], shape: tuple[int, ...], names: tuple[str, ...]):
    from jax.sharding import Mesh

    return Mesh(np.array(devices).reshape(shape), names)


def measure_matmuls(devices: Sequence[Any], grid: Sequence[tuple[int, int, int]],
                    dtypes: Sequence[str], target_s: float, repeats: int,
                    working_set_bytes: float = 0.0) -> list[dict[str, Any]]:
    """Per-device seconds of each ``(m, k, n)`` matmul of ``grid`` in each dtype, every
    device computing its own at once.

    ``working_set_bytes``: each device cycles through as many copies of its operands as
    fill this many bytes (at most :data:`MAX_OPERAND_COPIES`), one copy an iteration, so
    that the operands come from memory as a training step's do (every layer its own
    weights and activations) instead of from the caches; 0 or a single copy's size
    reuses one pair of operands."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    mesh = _mesh(devices, (n,), ("d",))
    rows = []
    for dtype in dtypes:
        for m, k, nn in grid:
            pair = (m * k + k * nn) * jnp.dtype(dtype).itemsize
            copies = int(min(max(math.ceil(working_set_bytes / pair), 1),
                             MAX_OPERAND_COPIES))

            def local(r, xs, ws, copies=copies):
                def body(i, c):
                    s, _y = c
                    j = i % copies
                    x = jax.lax.dynamic_index_in_dim(xs, j, keepdims=False)
                    w = jax.lax.dynamic_index_in_dim(ws, j, keepdims=False)
                    y = jnp.dot(x * s, w, preferred_element_type=x.dtype)
                    return (s + y[0, 0] * 1e-30).astype(x.dtype), y
                s0 = jnp.ones((), xs.dtype)
                out = jnp.zeros((xs.shape[1], ws.shape[2]), xs.dtype)
                return jax.lax.fori_loop(0, r, body, (s0, out))[1]

            fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                                       out_specs=P("d"), check_vma=False))
            x = jax.device_put(jnp.ones((n * copies, m, k), dtype) * 0.01,
                               NamedSharding(mesh, P("d")))
            w = jax.device_put(jnp.ones((n * copies, k, nn), dtype) * 0.01,
                               NamedSharding(mesh, P("d")))
            t, r = _time_loop(fn, (x, w), target_s, repeats)
            rows.append({"dtype": dtype, "m": m, "k": k, "n": nn, "seconds": t, "loops": r,
                         "operand_copies": copies, "flops_per_s": 2 * m * k * nn / t})
    return rows


def measure_memory(devices: Sequence[Any], elements: int, target_s: float, repeats: int
                   ) -> dict[str, Any]:
    """Bytes/s per device of ``x = x * a + b`` over ``elements`` float32 per device (4
    bytes read and 4 written per element)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    mesh = _mesh(devices, (n,), ("d",))

    def local(r, x):
        return jax.lax.fori_loop(0, r, lambda _, y: y * 0.999 + 0.001, x)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"),
                               check_vma=False))
    x = jax.device_put(jnp.ones((n * elements,), jnp.float32), NamedSharding(mesh, P("d")))
    t, r = _time_loop(fn, (x,), target_s, repeats)
    return {"elements": elements, "seconds": t, "loops": r, "bytes_per_s": 8 * elements / t}


def measure_saved(devices: Sequence[Any], elements: int, layers: int = 4, repeats: int = 3
                  ) -> dict[str, Any]:
    """Bytes/s per device at which activations saved for the backward pass across a layer
    scan are stored and reloaded: the gradient of a scan of ``layers`` cheap layers over
    ``elements`` float32 per device, with the layer's activations saved and with them
    recomputed (``jax.checkpoint``); the extra bytes saved over the time difference. The
    bytes are those JAX's differentiation keeps (the residuals of ``jax.vjp``, both ways:
    the layer keeps two arrays of ``elements`` a layer beside the carry both keep). 0
    when saving costs nothing measurable (the recomputation is a few elementwise ops)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    mesh = _mesh(devices, (n,), ("d",))

    def layer(h, w):
        return jnp.tanh(h * w) + h, None

    def step(body):
        def loss(ws, x):
            return jnp.sum(jax.lax.scan(body, x, ws)[0])
        return jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(), P("d")),
                                     out_specs=P(), check_vma=False))

    x = jax.device_put(jnp.ones((n * elements,), jnp.float32), NamedSharding(mesh, P("d")))
    ws = jnp.full((layers, 1), 0.5, jnp.float32)
    times = {}
    for name, body in (("saved", layer), ("recomputed", jax.checkpoint(layer))):
        fn = step(body)
        fn(ws, x).block_until_ready()
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn(ws, x).block_until_ready()
            runs.append(time.perf_counter() - t)
        times[name] = float(np.median(runs))
    extra = times["saved"] - times["recomputed"]
    nbytes = _residual_bytes(layer, ws, elements) - _residual_bytes(
        jax.checkpoint(layer), ws, elements)
    bw = nbytes / extra if extra > 0.1 * times["recomputed"] else 0.0
    return {"elements": elements, "layers": layers, "saved_s": times["saved"],
            "recomputed_s": times["recomputed"], "saved_bytes": nbytes, "bytes_per_s": bw}


def _residual_bytes(layer: Callable[..., Any], ws: Any, elements: int) -> int:
    """Bytes the backward pass of a scan of ``layer`` over one device's ``elements`` keeps
    from the forward (the leaves of its ``jax.vjp`` closure; shapes only, nothing runs)."""
    import jax
    import jax.numpy as jnp

    def loss(w, x):
        return jnp.sum(jax.lax.scan(layer, x, w)[0])

    def residuals(w, x):
        return jax.vjp(loss, w, x)[1]

    x = jax.ShapeDtypeStruct((elements,), jnp.float32)
    kept = jax.eval_shape(residuals, jax.ShapeDtypeStruct(ws.shape, ws.dtype), x)
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(kept))


def _collective_body(kind: str, axis: str, size: int) -> Callable[[Any], Any]:
    """One iteration of ``kind`` over ``axis`` on the carried local buffer (its shape
    kept: gathered results are sliced back, scattered ones written into the buffer)."""
    import jax
    import jax.numpy as jnp

    def body(_, x):
        if kind == "all-gather":
            y = jax.lax.all_gather(x, axis, tiled=True)
            return y[: x.shape[0]]
        if kind == "reduce-scatter":
            y = jax.lax.psum_scatter(x, axis, tiled=True)
            return jax.lax.dynamic_update_slice(x, y, (0,))
        if kind == "all-reduce":
            return jax.lax.psum(x, axis) * (1.0 / size)
        if kind == "all-to-all":
            return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
        perm = [(i, (i + 1) % size) for i in range(size)]
        return jax.lax.ppermute(x, axis, perm)

    del jnp
    return body


def measure_collectives(devices: Sequence[Any], sizes_bytes: Sequence[int], target_s: float,
                        repeats: int) -> list[dict[str, Any]]:
    """Seconds per execution of each collective kind at each payload size (bytes per
    device: the gathered result, the scattered input, the reduced or exchanged buffer,
    the sent block) over a 1-D mesh of all devices and each axis of a 2-D one."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    meshes: list[tuple[tuple[int, ...], tuple[str, ...], str]] = [((n,), ("a",), "a")]
    if n >= 4 and n % 2 == 0:
        meshes += [((2, n // 2), ("a", "b"), "a"), ((2, n // 2), ("a", "b"), "b")]
    rows = []
    for shape, names, axis in meshes:
        mesh = _mesh(devices, shape, names)
        size = mesh.shape[axis]
        if size < 2:
            continue
        for kind in KINDS:
            for nbytes in sizes_bytes:
                elems = max(nbytes // 4 // size, 1) * size
                local_elems = elems // size if kind == "all-gather" else elems
                body = _collective_body(kind, axis, size)

                def local(r, x, body=body):
                    return jax.lax.fori_loop(0, r, body, x)

                fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(names)),
                                           out_specs=P(names), check_vma=False))
                x = jax.device_put(jnp.ones((n * local_elems,), jnp.float32),
                                   NamedSharding(mesh, P(names)))
                t, r = _time_loop(fn, (x,), target_s, repeats)
                rows.append({"kind": kind, "axis_size": size, "mesh": list(shape),
                             "payload_bytes": 4 * elems, "seconds": t, "loops": r})
    return rows


def _steps_and_wire(kind: str, n: int, payload: float) -> tuple[float, float]:
    """(ring steps paying latency, bytes on the wire per device) of one execution, as
    :func:`jaxpar.planner.links.transfer_time` counts them."""
    if kind == "collective-permute":
        return 1.0, payload
    if kind == "all-reduce":
        return 2.0 * (n - 1), 2 * (n - 1) / n * payload
    return float(n - 1), (n - 1) / n * payload


def fit_collectives(rows: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(seconds per ring step, bytes/s) minimising the squared relative error of
    ``steps x latency + wire / bandwidth`` over the measured collectives."""
    a = np.array([[*_steps_and_wire(r["kind"], r["axis_size"], r["payload_bytes"])]
                  for r in rows])
    t = np.array([r["seconds"] for r in rows])
    w = a / t[:, None]
    (lat, inv_bw), *_ = np.linalg.lstsq(w, np.ones_like(t), rcond=None)
    if lat <= 0 or inv_bw <= 0:  # one of them is negligible: fit the other alone
        col = 1 if lat <= 0 else 0
        coef = float(np.linalg.lstsq(w[:, col:col + 1], np.ones_like(t), rcond=None)[0][0])
        lat, inv_bw = (1e-9, coef) if col == 1 else (coef, 1e-15)
    return float(max(lat, 1e-9)), float(1 / max(inv_bw, 1e-15))


def fit_matmuls(rows: Sequence[dict[str, Any]], hbm_bw: float,
                large_flops: float = LARGE_FLOPS) -> dict[str, Any]:
    """``f32_flops``, ``peak_flops`` (bf16), ``matmul_tile`` and ``op_overhead_s`` so
    that :func:`~jaxpar.planner.roofline.matmul_time` (efficiency 1) fits ``rows`` best
    in log time; the peaks are the median rates of the large shapes."""
    peaks = {}
    for dtype in ("float32", "bfloat16"):
        mine = [r for r in rows if r["dtype"] == dtype]
        large = [r for r in mine if 2 * r["m"] * r["k"] * r["n"] >= large_flops] or mine
        peaks[dtype] = float(np.median([r["flops_per_s"] for r in large])) if large else 0.0
    f32 = peaks["float32"] or peaks["bfloat16"]
    bf16 = peaks["bfloat16"] or f32
    best = (math.inf, 1, 0.0)
    overheads = [0.0, *np.logspace(-7, -3, 41)]
    for tile in TILES:
        for ov in overheads:
            chip = Chip("cpu-fit", bf16, 1.0, 1.0, 1.0, 1, hbm_bw=hbm_bw, f32_flops=f32,
                        matmul_tile=tile, matmul_efficiency=1.0, memory_efficiency=1.0,
                        op_overhead_s=float(ov))
            err = sum(math.log(matmul_time(chip, r["m"], r["k"], r["n"],
                                           act_bytes=4 if r["dtype"] == "float32" else 2)
                               / r["seconds"]) ** 2 for r in rows)
            if err < best[0] - 1e-12:
                best = (err, tile, float(ov))
    rms = math.exp(math.sqrt(best[0] / max(len(rows), 1))) - 1
    return {"f32_flops": f32, "peak_flops": bf16, "matmul_tile": best[1],
            "op_overhead_s": best[2], "rms_log_error": rms}


def _hbm_bytes(devices: Sequence[Any]) -> float:
    """Device memory: the runtime's limit where it reports one, else host RAM / devices."""
    try:
        stats = devices[0].memory_stats() or {}
    except (RuntimeError, NotImplementedError):
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GiB
    return float(ram) / len(devices)


def default_name(devices: Sequence[Any]) -> str:
    """``cpu8`` for 8 CPU devices; the device kind (``nvidia-h100-80gb-hbm3``) else."""
    d = devices[0]
    if d.platform == "cpu":
        return f"cpu{len(devices)}"
    kind = "".join(c if c.isalnum() else "-" for c in str(d.device_kind).lower())
    return "-".join(p for p in kind.split("-") if p) or d.platform


def calibrate(devices: Sequence[Any] | None = None, *, quick: bool = False) -> dict[str, Any]:
    """Measure ``devices`` (default: all) at once and return the catalog entry's fields
    (:class:`~jaxpar.planner.catalog.Chip`, without ``name``) plus ``measurements``, the
    raw timings and how well the fitted figures reproduce them.

    ``quick`` runs a smaller grid with shorter timings and smaller working sets (a few
    seconds, for tests).
    """
    import jax

    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    target, repeats = (0.01, 3) if quick else (0.04, 3)
    start = time.perf_counter()
    # A working set like a training step's (weights, gradients, optimizer state: tens of
    # MB a device): on a CPU a smaller one runs from the caches, several times faster.
    # (On a GPU or TPU: 1 GiB a device, past any cache, and the large matmuls too.)
    accelerator = devices[0].platform != "cpu"
    elements = (1 << 22) if quick else (1 << 28) if accelerator else (1 << 24)
    memory = measure_memory(devices, elements, target, 2 * repeats)
    hbm_bw = memory["bytes_per_s"]
    saved = measure_saved(devices, (1 << 18) if quick else (1 << 20))
    grid = QUICK_GRID if quick else MATMUL_GRID + (ACCELERATOR_GRID if accelerator else ())
    matmuls = measure_matmuls(devices, grid, ("float32", "bfloat16"), target, repeats,
                              working_set_bytes=(1 if quick else 4) * elements)
    fit = fit_matmuls(matmuls, hbm_bw,
                      ACCELERATOR_LARGE_FLOPS if accelerator and not quick else LARGE_FLOPS)
    colls: list[dict[str, Any]] = []
    lat, bw = 2e-5, 5e9
    if n > 1:
        sizes = (1 << 14, 1 << 20) if quick else (1 << 12, 1 << 16, 1 << 20, 1 << 22)
        colls = measure_collectives(devices, sizes, target, repeats)
        lat, bw = fit_collectives(colls)
        for r in colls:
            steps, wire = _steps_and_wire(r["kind"], r["axis_size"], r["payload_bytes"])
            r["fitted_s"] = steps * lat + wire / bw
    platform = devices[0].platform
    entry: dict[str, Any] = {
        "peak_flops": fit["peak_flops"], "f32_flops": fit["f32_flops"],
        "hbm_bytes": _hbm_bytes(devices), "hbm_bw": hbm_bw,
        "ici_bw": bw, "dcn_bw": bw, "domain": n, "torus_dims": 0,
        "ici_latency_s": lat, "dcn_latency_s": lat,
        "host_bw": hbm_bw if platform == "cpu" else 32e9,
        "matmul_tile": fit["matmul_tile"], "matmul_efficiency": 1.0,
        "memory_efficiency": 1.0, "collective_efficiency": 1.0,
        "overlap": 0.0 if platform == "cpu" else 1.0,
        "op_overhead_s": fit["op_overhead_s"], "saved_bw": saved["bytes_per_s"],
        "source": f"jaxpar calibrate on {n} {platform} devices "
                  f"({devices[0].device_kind}), {time.strftime('%Y-%m-%d')}",
    }
    chip = chip_from_mapping("calibrated", entry)  # checks the fields
    for r in matmuls:
        r["fitted_s"] = matmul_time(chip, r["m"], r["k"], r["n"],
                                    act_bytes=4 if r["dtype"] == "float32" else 2)
    entry["measurements"] = {
        "devices": n, "platform": platform, "device_kind": str(devices[0].device_kind),
        "quick": quick, "seconds": time.perf_counter() - start, "memory": memory,
        "saved_activations": saved,
        "matmuls": matmuls, "matmul_fit_rms_error": fit["rms_log_error"],
        "collectives": colls}
    return entry


def summary(entry: dict[str, Any]) -> str:
    """A table of the measured figures and how the fit reproduces the raw timings."""
    m = entry.get("measurements", {})
    lines = [f"{'figure':22} value",
             f"{'f32 matmul':22} {entry['f32_flops'] / 1e9:10.2f} GFLOP/s per device",
             f"{'bf16 matmul (peak)':22} {entry['peak_flops'] / 1e9:10.2f} GFLOP/s per device",
             f"{'matmul tile':22} {entry['matmul_tile']:10d}",
             f"{'op overhead':22} {entry['op_overhead_s'] * 1e6:10.2f} us",
             f"{'memory bandwidth':22} {entry['hbm_bw'] / 1e9:10.2f} GB/s per device",
             f"{'saved activations':22} {entry.get('saved_bw', 0) / 1e9:10.3f} GB/s per device",
             f"{'collective bandwidth':22} {entry['ici_bw'] / 1e9:10.2f} GB/s per device",
             f"{'collective latency':22} {entry['ici_latency_s'] * 1e6:10.2f} us per ring step",
             f"{'device memory':22} {entry['hbm_bytes'] / GiB:10.2f} GiB",
             f"{'overlap':22} {entry['overlap']:10.0f}"]
    if m.get("matmuls"):
        lines += ["", f"{'dtype':9} {'m':>5} {'k':>5} {'n':>5} {'measured':>11} "
                      f"{'fitted':>11} {'GFLOP/s':>8}"]
        for r in m["matmuls"]:
            lines.append(f"{r['dtype']:9} {r['m']:5d} {r['k']:5d} {r['n']:5d} "
                         f"{r['seconds'] * 1e6:9.1f}us {r['fitted_s'] * 1e6:9.1f}us "
                         f"{r['flops_per_s'] / 1e9:8.2f}")
    if m.get("collectives"):
        lines += ["", f"{'collective':19} {'axis':>4} {'bytes':>9} {'measured':>11} "
                      f"{'fitted':>11}"]
        for r in m["collectives"]:
            lines.append(f"{r['kind']:19} {r['axis_size']:4d} {r['payload_bytes']:9d} "
                         f"{r['seconds'] * 1e6:9.1f}us {r['fitted_s'] * 1e6:9.1f}us")
    if m:
        lines.append(f"\ncalibration took {m['seconds']:.1f} s")
    return "\n".join(lines)


def write_entry(entry: dict[str, Any], name: str, out: str | Path) -> Path:
    """Write ``entry`` as the catalog file ``out`` (``{name: figures}``, what
    :func:`~jaxpar.planner.catalog.load_catalog` reads) and its raw ``measurements`` as
    ``<out>.measurements.json`` beside it; returns the JSON's path."""
    import json

    import yaml

    out = Path(out)
    figures = {k: v for k, v in entry.items() if k != "measurements"}
    figures = {k: (float(v) if isinstance(v, (float, np.floating)) else v)
               for k, v in figures.items()}
    text = (f"# Written by jaxpar calibrate; raw timings in {out.name}.measurements.json.\n"
            f"# Use: jaxpar plan --catalog {out} --chips {name}:{figures['domain']} ...\n")
    out.write_text(text + yaml.safe_dump({name: figures}, sort_keys=False))
    raw = Path(f"{out}.measurements.json")
    raw.write_text(json.dumps(entry.get("measurements", {}), indent=1) + "\n")
    return raw
