"""Host offload: training state kept in host memory and brought to the device when needed.

Three systems, each a choice of *memory kind* for part of the state (every JAX sharding
names one: ``device``, or ``pinned_host`` for host memory the accelerator reaches by DMA):

- **Optimizer state on the host** (ZeRO-Offload): the f32 master weights and the
  optimizer's moments, ZeRO-sharded as usual, live in host memory between steps, the
  largest tensors first up to a fraction of their bytes (Megatron's offload fraction).
  Each step streams the offloaded part through device memory for the update and back
  (:func:`to_space`), or, with ``host_update``, runs the whole update on the host
  (:func:`on_host`): gradients go down, new weights come up, the state never enters device
  memory.
- **Weights streamed from the host** (ZeRO-Infinity, weight streaming): the stacked
  decoder layers' weights live in host memory; the layer loop brings each layer's shard to
  the device as it runs (:func:`stream_layer`), again for the backward pass, so about two
  layers' weights are on the device at a time. It composes with FSDP (the shard streams,
  then is all-gathered) and with LoRA (frozen base weights stream, adapters stay).
- **Activations saved to the host**: a remat policy (``offload:<names>``, see
  :mod:`jaxpar.sharding.remat`) sends chosen checkpoint names to host memory instead of
  keeping or recomputing them.

On TPU and GPU XLA turns the transfers into asynchronous copies overlapped with compute.
JAX's CPU devices expose the same memory kinds, so all of it compiles and runs on CPU
(where the two spaces are the same RAM) and can be tested there; only the speed needs an
accelerator.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import compute_on as _compute_on_module
from jax.experimental.compute_on import compute_on
from jax.sharding import Mesh, NamedSharding

from jaxpar.errors import JaxparError
from jaxpar.sharding.annotations import logical_names
from jaxpar.sharding.remat import never_saving

HOST = "pinned_host"
"""The memory kind offloaded state lives in."""
STREAMED = "streamed_weights"
"""The checkpoint name of a streamed layer's device copy: never saved for the backward
pass (the layer streams it in again), so at most a layer or two are ever on the device."""


def check_supported(mesh: Mesh) -> None:
    """Refuse offload on devices without host memory."""
    kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
    if HOST not in kinds:
        raise JaxparError(f"host offload needs the memory kind {HOST!r}, which "
                          f"{mesh.devices.flat[0].platform} devices lack (they have "
                          f"{', '.join(sorted(kinds))})")


def largest_first(shapes: Any, fraction: float) -> Any:
    """A tree of bools like ``shapes``: which leaves to offload so that at least
    ``fraction`` of the bytes move, the largest tensors first. Scalars (step counters)
    always stay on the device; ``fraction`` 1 moves every other leaf."""
    leaves, treedef = jax.tree.flatten(shapes)
    sizes = [x.size * x.dtype.itemsize if getattr(x, "ndim", 0) else 0 for x in leaves]
    goal = fraction * sum(sizes)
    chosen, moved = [False] * len(leaves), 0
    for i in sorted(range(len(leaves)), key=lambda i: -sizes[i]):
        if moved >= goal or not sizes[i]:
            break
        chosen[i], moved = True, moved + sizes[i]
    return jax.tree.unflatten(treedef, chosen)


def in_memory(shardings: Any, mask: Any, kind: str = HOST) -> Any:
    """``shardings`` with the leaves ``mask`` marks moved to memory ``kind``."""
    return jax.tree.map(lambda s, m: s.with_memory_kind(kind) if m else s, shardings, mask,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def is_on_host(x: Any) -> bool:
    """Whether a traced or concrete array lives in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def to_space(tree: Any, space: jax.memory.Space) -> Any:
    """Inside traced code: every array of ``tree`` moved to memory ``space`` (its sharding
    kept); arrays already there are left alone."""
    def move(x):
        if not hasattr(x, "dtype") or jax.typeof(x).memory_space == space:
            return x
        return jax.device_put(x, space)

    return jax.tree.map(move, tree)


def to_device(tree: Any) -> Any:
    """:func:`to_space` to device memory."""
    return to_space(tree, jax.memory.Space.Device)


def on_host(fn: Any, out: jax.memory.Space = jax.memory.Space.Device) -> Any:
    """``fn`` compiled to run on the host (``compute_on("device_host")``), its results
    left in memory ``out``. Give it arguments in host memory (:func:`to_host`) for
    nothing to cross to the device but what it returns there."""
    return host_compute(jax.jit(fn), out=out)


def host_compute(fn: Any, *, out: jax.memory.Space = jax.memory.Space.Device,
                 wrap: Any = None) -> Any:
    """``fn`` under ``compute_on("device_host")``, its results in memory ``out``, in
    either of JAX's call conventions: ``compute_on(f, *, compute_type,
    out_memory_spaces)`` (JAX 0.11; JAX 0.10 has it as ``compute_on2``), or the older
    ``compute_on(compute_type)`` context, whose results are in device memory (``out``
    host then moves them). ``wrap`` replaces JAX's ``compute_on`` (for tests of both
    conventions)."""
    if wrap is None:
        wrap = getattr(_compute_on_module, "compute_on2", None) or compute_on
    try:
        params = inspect.signature(wrap).parameters
    except (TypeError, ValueError):
        params = {}
    if "out_memory_spaces" in params:
        return wrap(fn, compute_type="device_host", out_memory_spaces=out)
    run = wrap("device_host")(fn)
    if out == jax.memory.Space.Device:
        return run
    return lambda *args: to_space(run(*args), out)


def to_host(tree: Any) -> Any:
    """:func:`to_space` to host memory."""
    return to_space(tree, jax.memory.Space.Host)


def stream_layer(layer_state: Any) -> Any:
    """Inside a layer loop: the layer's weights that live in host memory, brought to the
    device (their shard, as stored: FSDP gathers it afterwards), each named
    :data:`STREAMED` so the backward pass streams it again instead of keeping it."""
    def fetch(x):
        if not hasattr(x, "dtype") or not is_on_host(x):
            return x
        return checkpoint_name(jax.device_put(x, jax.memory.Space.Device), STREAMED)

    return jax.tree.map(fetch, layer_state)


SAVE_ALL_BUT_STREAMED = never_saving(None, (STREAMED,))
"""A checkpoint policy that keeps everything for the backward pass but streamed weights."""


def host_bytes(tree: Any) -> tuple[int, int]:
    """Bytes one device (the first) holds of the arrays in ``tree``: (in device memory, in
    host memory)."""
    device = host = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            shard = x.addressable_shards[0].data
            size = shard.size * shard.dtype.itemsize
            if x.sharding.memory_kind == HOST:
                host += size
            else:
                device += size
    return device, host


GPU_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
"""What XLA's GPU client sizes its pinned host pool from (GiB, 64 unless set), once, as
the backend starts (:mod:`jaxpar.runs.host_memory` sets it for ``jaxpar train``)."""
GPU_POOL_DEFAULT_GIB = 64


def pinned_bytes(shapes: Any, shardings: Any) -> int:
    """Bytes one device's shards of the arrays ``shapes`` (shapes or arrays) hold in host
    memory, placed by the tree ``shardings``."""
    total = 0
    for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(
            shardings, is_leaf=lambda v: isinstance(v, NamedSharding)), strict=True):
        if isinstance(s, NamedSharding) and s.memory_kind == HOST:
            total += math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def check_gpu_pool(mesh: Mesh, per_device: int, environ: Any = None) -> None:
    """Refuse, in one line, offloaded state larger than the GPU runtime's pinned host
    pool (the state of the mesh's devices in this process, against
    :data:`GPU_POOL_ENV`); other platforms have no such pool."""
    environ = os.environ if environ is None else environ
    if mesh.devices.flat[0].platform != "gpu" or not per_device:
        return
    local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    given = environ.get(GPU_POOL_ENV)
    limit = int(given) if given and given.strip().isdigit() else GPU_POOL_DEFAULT_GIB
    need = per_device * local
    if need > limit * 2**30:
        raise JaxparError(
            f"the offloaded state needs {need / 2**30:.1f} GiB of pinned host memory in this "
            f"process, more than the GPU runtime's pool of {limit} GiB ({GPU_POOL_ENV}, read "
            "when JAX started): set it before JAX starts (jaxpar train does, "
            "jaxpar.size_host_pool(config, devices) sizes it from a config)")


def streamed_mask(state: Any) -> Any:
    """A tree of bools like the ``nnx.State`` ``state``: the weights
    ``offload_params`` keeps in host memory, the matrices stacked over the ``layers``
    axis. LoRA adapters stay on the device (they are small and trained), and so do the
    layers' vectors (norm scales, biases: small, and a TPU cannot slice one 16-bit row
    out of host memory)."""
    def one(variable: nnx.Variable) -> Any:
        names = logical_names(variable) or ()
        stream = (isinstance(variable, nnx.Param) and not isinstance(variable, nnx.LoRAParam)
                  and bool(names) and names[0] == "layers" and jnp.ndim(variable.get_value()) >= 3)
        return variable.replace(stream)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
