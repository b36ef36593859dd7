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
from collections.abc import Callable, Iterator, Mapping, MutableMapping
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


def _not_here(platform: str, start: Callable[[], Any]) -> Any:
    """The ``platform`` backend factory on a host without that device: the backend is
    started only when the platforms were set to name it after :func:`skip_absent_tpu`
    (or :func:`quiet_absent_gpu`) ran."""
    import jax

    if platform in (jax.config.jax_platforms or "").split(","):
        return start()
    raise RuntimeError(f"no {platform.upper()} is attached to this host, so jaxpar did not "
                       f"start its backend (JAX_PLATFORMS={platform} starts it anyway)")


def _register_absent(xla_bridge: ModuleType, platform: str = "tpu") -> None:
    """Replace JAX's ``platform`` backend factory by :func:`_not_here`, at its priority."""
    registration = getattr(xla_bridge, "_backend_factories", {}).get(platform)
    if registration is None or getattr(registration.factory, "func", None) is _not_here:
        return  # this JAX registers no such backend, or it is replaced already
    with contextlib.suppress(RuntimeError):  # raised once the backends started: too late
        xla_bridge.register_backend_factory(  # (the plugin's C API kept: JAX registers
            platform, partial(_not_here, platform, registration.factory),  # custom calls
            priority=registration.priority, fail_quietly=True,  # with it)
            c_api=getattr(registration, "c_api", None))


def _register_absent_tpu(xla_bridge: ModuleType) -> None:
    _register_absent(xla_bridge, "tpu")


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


def local_gpu_count(env: Mapping[str, str] | None = None, dev: str = "/dev") -> int:
    """NVIDIA GPUs this process will see, without starting a runtime:
    ``CUDA_VISIBLE_DEVICES`` if set, else the ``/dev/nvidiaN`` device files."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return 0 if ids[:1] == ["-1"] else len(ids)
    return len(glob.glob(f"{dev}/nvidia[0-9]*"))


def gpu_attached(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process may see an NVIDIA GPU (:func:`local_gpu_count`)."""
    return local_gpu_count(env) > 0


class _QuietLoader:
    """A module loader whose module starts with stderr dropped (file descriptor 2)."""

    def __init__(self, loader: Any):
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        with _stderr_dropped():
            return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with _stderr_dropped():
            self.loader.exec_module(module)


class _QuietImports:
    """An import hook: the modules of package ``name`` load with stderr dropped."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name and not fullname.startswith(self.name + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader,
                                                                    "exec_module"):
            spec.loader = _QuietLoader(spec.loader)
        return spec


@contextlib.contextmanager
def _stderr_dropped() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


CUDA_PLUGIN = "jax_cuda12_plugin"
"""The package of jax's CUDA plugin (installed by ``jaxpar[gpu-compile]``)."""


CUDA_PLUGIN_ENTRY = "jax_plugins.xla_cuda12"
"""The module through which JAX finds the plugin and registers its backend."""


def _plugin_registered_quietly(plugin: ModuleType) -> None:
    """Wrap the plugin's ``initialize`` (what JAX calls to register it): with stderr
    dropped, and then with its backend factory replaced by :func:`_not_here`."""
    initialize = plugin.initialize

    def quietly() -> None:
        with _stderr_dropped():
            initialize()
        if _XLA_BRIDGE in sys.modules:
            _register_absent(sys.modules[_XLA_BRIDGE], "cuda")

    plugin.initialize = quietly


def quiet_absent_gpu(env: MutableMapping[str, str] | None = None,
                     attached: bool | None = None) -> bool:
    """On a host without a GPU, keep jax's CUDA plugin (installed to compile for GPUs,
    ``jaxpar compile --target h100:8``) from saying so: its modules print ``cudart_stub.cc
    ... Could not find cuda drivers on your machine`` whenever JAX loads its GPU kernels'
    modules, and its registration fails with a traceback on the missing CUDA runtime.
    Here the plugin registers without checking the runtime (the GPU compiler needs none),
    its modules load with stderr dropped, and its backend is not started unless the
    platforms name ``cuda``. Returns whether it does so; must come before JAX looks for
    its plugins. Changes nothing on a host with a GPU."""
    env = os.environ if env is None else env
    if gpu_attached(env=env) if attached is None else attached:
        return False
    env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if not any(isinstance(f, _QuietImports) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietImports(CUDA_PLUGIN))
    if CUDA_PLUGIN_ENTRY in sys.modules:
        _plugin_registered_quietly(sys.modules[CUDA_PLUGIN_ENTRY])
    elif not any(isinstance(f, _AfterImport) and f.name == CUDA_PLUGIN_ENTRY
                 for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(CUDA_PLUGIN_ENTRY, _plugin_registered_quietly))
    return True


@contextlib.contextmanager
def start_summarised(who: str = "libtpu", what: str = "starting the TPU compiler",
                     why: str = "it looks for a TPU to run on; compiling for one needs none"
                     ) -> Iterator[None]:
    """Hold back what is written to stderr (file descriptor 2, where libtpu and jax's CUDA
    plugin write) inside the block, then print one line counting it: ``who``'s start-up
    lines on a host without its device (libtpu's without ``TPU_WORKER_HOSTNAMES``, the
    plugin's without a CUDA driver) do not matter to a compiler. If the block raises, the
    lines are dropped: the exception carries the reason, and a user's error stays one
    line."""
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
        print(f"jaxpar: {who} printed {count} line{'s' if count > 1 else ''} {what} ({why})",
              file=sys.stderr)


def libtpu_start_summarised(what: str = "starting the TPU compiler"
                            ) -> contextlib.AbstractContextManager[None]:
    """:func:`start_summarised` for libtpu."""
    return start_summarised("libtpu", what)


__all__ = ["CUDA_PLUGIN", "TPU_ENV", "TPU_PCI_DEVICE_IDS", "gpu_attached",
           "libtpu_start_summarised", "local_gpu_count", "quiet_absent_gpu", "skip_absent_tpu",
           "start_summarised", "tpu_attached"]
