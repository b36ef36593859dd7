"""Host memory for offloaded state, settled before the accelerator runtime starts.

State a plan keeps in host memory (optimizer state, streamed weights, saved activations:
:mod:`jaxpar.parallel.offload`) lives in memory the runtime pins for DMA. On GPUs XLA
draws it from one pool per process, 64 GiB unless ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``
says otherwise, read once when the backend starts: a plan that needs more fails at its
first step with "Out of host memory", whatever the machine's RAM. :func:`size_host_pool`
reads the plan's host bytes from the planner, sizes the pool to them (with a margin),
and refuses in one line, before anything is built, a plan the host cannot hold: more
than :data:`~jaxpar.planner.catalog.HOST_POOL_SHARE` of its RAM, or more than a pool the
user set by hand.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.parallel.offload import GPU_POOL_ENV
from jaxpar.planner.catalog import HOST_POOL_SHARE
from jaxpar.planner.prediction import predict
from jaxpar.sharding.backends import local_gpu_count  # noqa: F401 - jaxpar train reads it here

MARGIN = 1.1
"""The pool is the plan's host bytes times this, plus :data:`SLACK_GIB` (staging buffers
and the allocator's rounding)."""
SLACK_GIB = 2
GIB = 2**30


def ram_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def offloads(config: Any) -> bool:
    """Whether ``config``'s plan keeps anything in host memory."""
    plan = config.plan
    return bool(plan.offload_optimizer or plan.offload_params
                or plan.remat == "offload_dots" or plan.remat.startswith("offload:"))


def host_bytes_per_process(config: Any, local_devices: int, processes: int = 1) -> float:
    """The planner's host bytes for ``config`` on ``local_devices`` devices in each of
    ``processes`` processes: one device's share times the devices of a process."""
    memory = predict(config, local_devices * processes, backend="gpu")["memory"]
    return float(memory["host_bytes"]) * local_devices


def size_host_pool(config: Any, local_devices: int, processes: int = 1, *,
                   environ: MutableMapping[str, str] | None = None,
                   ram: int | None = None) -> int | None:
    """Size the runtime's pinned host pool for ``config`` (see the module docstring):
    returns the GiB set in ``environ`` (default ``os.environ``; call before JAX starts
    its backend), the user's own setting when it suffices, or None when the plan keeps
    nothing in host memory.

    Raises:
      JaxparError: the plan's host bytes exceed :data:`HOST_POOL_SHARE` of ``ram``
        (default: this machine's), or a pool the user set is smaller than them.
    """
    environ = os.environ if environ is None else environ
    if not offloads(config):
        return None
    need = host_bytes_per_process(config, max(local_devices, 1), processes)
    ram = ram_bytes() if ram is None else ram
    usable = HOST_POOL_SHARE * ram
    devices = f"{max(local_devices, 1)} device{'s' * (local_devices > 1)}"
    if need > usable:
        raise JaxparError(
            f"the plan keeps {need / GIB:.1f} GiB in host memory per process ({devices}), "
            f"more than the {usable / GIB:.1f} GiB this host can pin "
            f"({HOST_POOL_SHARE:.0%} of its {ram / GIB:.1f} GiB of RAM): offload less "
            "(plan.offload_optimizer, plan.offload_params, plan.remat) or use more hosts")
    given = environ.get(GPU_POOL_ENV)
    if given is not None:
        try:
            limit = int(given)
        except ValueError:
            raise JaxparError(f"{GPU_POOL_ENV}={given!r} is not a whole number of GiB") from None
        if limit * GIB < need:
            raise JaxparError(
                f"{GPU_POOL_ENV}={limit} pins {limit} GiB of host memory, less than the "
                f"{need / GIB:.1f} GiB the plan keeps there per process: raise it, or unset "
                "it and jaxpar sizes it")
        return limit
    limit = min(math.ceil(need * MARGIN / GIB) + SLACK_GIB, max(int(usable // GIB), 1))
    environ[GPU_POOL_ENV] = str(limit)
    return limit


MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEVICE_MEM_FRACTION = 0.95
"""The share of each GPU's memory the runtime takes for jaxpar's runs. JAX's default,
0.75, leaves 20 of an H100's 79 GiB unused, while the planner plans for the catalog's
80 GB (74.5 GiB, 94% of what the device reports): a plan at 65 GiB a device would fit by
the planner and fail at its first step with an out-of-memory error."""


def size_device_pool(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Have the GPU runtime preallocate :data:`DEVICE_MEM_FRACTION` of each GPU's memory,
    unless the user chose (``XLA_PYTHON_CLIENT_MEM_FRACTION``, or no preallocation with
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` or another allocator); returns the fraction
    set, or None. Call before JAX starts its backend."""
    environ = os.environ if environ is None else environ
    if (MEM_FRACTION_ENV in environ or environ.get("XLA_PYTHON_CLIENT_ALLOCATOR")
            or environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0")):
        return None
    environ[MEM_FRACTION_ENV] = f"{DEVICE_MEM_FRACTION:g}"
    return environ[MEM_FRACTION_ENV]
