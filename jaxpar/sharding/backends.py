"""Which backends JAX starts: not libtpu's on a host without a TPU.

libtpu is installed for ``jaxpar compile --target tpu-...``, which compiles for a TPU slice
on any host. JAX's backend discovery then tries the TPU on every host too: libtpu loads,
finds no TPU, and prints half a dozen lines (``Failed to find host bounds``, an ``E0000
... INVALID_ARGUMENT ... TPU_WORKER_HOSTNAMES`` error with its trace) before JAX quietly
falls back to the CPU or GPU. No log-level variable reaches them: they come before
libtpu's logging starts.

:func:`skip_absent_tpu` (called by ``import jaxpar``) keeps that start from happening: on a
host with no TPU attached, JAX's ``tpu`` backend is registered again with a factory that
says so instead of loading libtpu. It changes nothing on a TPU host, when the user chose
the platforms (``JAX_PLATFORMS``, ``jax_platforms`` naming ``tpu``), forced the TPU
(``JAX_FORCE_TPU_INIT``) or described one (``TPU_ACCELERATOR_TYPE``, ``TPU_WORKER_*``).
The TPU compiler itself (``jax.experimental.topologies``) loads libtpu without the backend
factory; :func:`libtpu_start_summarised` counts what its start prints into one line.

Imports no JAX: ``import jaxpar`` and the command's ``--help`` stay fast.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.machinery
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

TPU_PCI_DEVICE_IDS = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f",
                                "0x0076"})
"""PCI device ids of Google's TPU chips, v3 to v7 (the ones ``jax._src.hardware_utils``
knows); the vendor is Google's, ``0x1ae0``. Google's other devices (gVNIC, NVMe disks)
share the vendor and are not TPUs."""

TPU_ENV = ("JAX_FORCE_TPU_INIT", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES",
           "TPU_WORKER_ID", "TPU_TOPOLOGY")
"""Environment variables that say this process is meant for a TPU, whatever the
hardware check finds."""

_XLA_BRIDGE = "jax._src.xla_bridge"


def tpu_attached(dev: str = "/dev", pci: str = "/sys/bus/pci/devices",
                 env: Mapping[str, str] | None = None) -> bool:
    """Whether this host may have a TPU: a TPU device file (``/dev/accel*``, as TPU v2-v5p
    expose them, or a numbered ``/dev/vfio`` group, as v5e and later do), a Google TPU chip
    on the PCI bus, or one of :data:`TPU_ENV` set. Errs towards yes: a wrong yes only
    leaves libtpu's start-up lines, a wrong no would hide a TPU."""
    env = os.environ if env is None else env
    if any(env.get(name) for name in TPU_ENV):
        return True
    if glob.glob(f"{dev}/accel*") or any(p.name.isdigit() for p in Path(dev, "vfio").glob("*")):
        return True
    for vendor in glob.glob(f"{pci}/*/vendor"):
        try:
            if (Path(vendor).read_text().strip() == "0x1ae0" and Path(vendor).with_name(
                    "device").read_text().strip() in TPU_PCI_DEVICE_IDS):
                return True
        except OSError:
            continue
    return False


def _no_tpu_here(start_libtpu: Callable[[], Any]) -> Any:
    """The ``tpu`` backend factory on a host without a TPU: libtpu is started only when
    the platforms were set to name ``tpu`` after :func:`skip_absent_tpu` ran."""
    import jax

    if "tpu" in (jax.config.jax_platforms or "").split(","):
        return start_libtpu()
    raise RuntimeError("no TPU is attached to this host, so jaxpar did not start libtpu "
                       "(JAX_PLATFORMS=tpu starts it anyway)")


def _register_absent_tpu(xla_bridge: ModuleType) -> None:
    """Replace JAX's ``tpu`` backend factory by :func:`_no_tpu_here`, at its priority."""
    registration = getattr(xla_bridge, "_backend_factories", {}).get("tpu")
    if registration is None or getattr(registration.factory, "func", None) is _no_tpu_here:
        return  # this JAX registers no TPU backend, or it is replaced already
    with contextlib.suppress(RuntimeError):  # raised once the backends started: too late
        xla_bridge.register_backend_factory(
            "tpu", partial(_no_tpu_here, registration.factory),
            priority=registration.priority, fail_quietly=True)


class _AfterImport:
    """A one-shot import hook: runs ``then(module)`` once ``name`` has been imported (JAX
    registers its backends when ``jax._src.xla_bridge`` runs)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def run_then(module: ModuleType) -> None:
            run(module)
            self.then(module)

        spec.loader.exec_module = run_then  # type: ignore[method-assign]
        return spec


def skip_absent_tpu(env: Mapping[str, str] | None = None, attached: bool | None = None) -> bool:
    """Keep JAX from starting libtpu on a host without a TPU (see the module's docstring);
    returns whether it will. Before ``import jax`` it waits for JAX's backends to be
    registered; afterwards it acts at once. Must come before JAX starts a backend.

    Args:
      env: the environment to read (default ``os.environ``).
      attached: whether a TPU is attached (default :func:`tpu_attached`).
    """
    env = os.environ if env is None else env
    if env.get("JAX_PLATFORMS") or (tpu_attached(env=env) if attached is None else attached):
        return False
    if _XLA_BRIDGE in sys.modules:
        _register_absent_tpu(sys.modules[_XLA_BRIDGE])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_XLA_BRIDGE, _register_absent_tpu))
    return True


@contextlib.contextmanager
def libtpu_start_summarised(what: str = "starting the TPU compiler") -> Iterator[None]:
    """Hold back what is written to stderr (file descriptor 2, where libtpu writes) inside
    the block, then print one line counting it: libtpu's start-up lines on a host without
    a TPU (no ``TPU_WORKER_HOSTNAMES``, no accelerator type) do not matter to a compiler.
    If the block raises, the lines are dropped: the exception carries libtpu's reason, and
    a user's error stays one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        count = sum(1 for line in held.read().splitlines() if line.strip())
    if count:
        print(f"jaxpar: libtpu printed {count} line{'s' if count > 1 else ''} {what} (it "
              "looks for a TPU to run on; compiling for one needs none)", file=sys.stderr)


__all__ = ["TPU_ENV", "TPU_PCI_DEVICE_IDS", "libtpu_start_summarised", "skip_absent_tpu",
           "tpu_attached"]
