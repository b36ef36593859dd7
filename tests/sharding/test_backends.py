"""jaxpar.sharding.backends: on a host without a TPU, JAX does not start libtpu (whose
failed start prints ``E0000 ... TPU_WORKER_HOSTNAMES`` errors), whichever of ``jax`` and
``jaxpar`` is imported first; libtpu's lines when the TPU compiler starts become one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar.sharding import backends
from jaxpar.sharding.backends import libtpu_start_summarised, skip_absent_tpu, tpu_attached

ROOT = Path(__file__).resolve().parents[2]
LIBTPU_SAYS = ("E0000", "TPU_WORKER_HOSTNAMES", "libtpu", "InitGoogle", "host bounds")


def test_a_tpu_is_seen_in_dev_pci_or_the_environment(tmp_path):
    dev, pci = tmp_path / "dev", tmp_path / "pci"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "vfio").touch()  # the VFIO control file alone is no TPU
    for slot, device in [("0000:00:04.0", "0x0042"), ("0000:00:05.0", "0x001f")]:
        (pci / slot).mkdir(parents=True)  # Google's gVNIC and NVMe disk: not TPUs
        (pci / slot / "vendor").write_text("0x1ae0\n")
        (pci / slot / "device").write_text(f"{device}\n")
    assert not tpu_attached(str(dev), str(pci), env={})
    assert tpu_attached(str(dev), str(pci), env={"TPU_ACCELERATOR_TYPE": "v5litepod-8"})
    (pci / "0000:00:06.0").mkdir()
    (pci / "0000:00:06.0" / "vendor").write_text("0x1ae0\n")
    (pci / "0000:00:06.0" / "device").write_text("0x006f\n")  # a TPU v6e chip
    assert tpu_attached(str(dev), str(pci), env={})
    (dev / "vfio" / "0").touch()  # v5e and later: a numbered VFIO group
    assert tpu_attached(str(dev), str(tmp_path / "none"), env={})
    (dev / "vfio" / "0").unlink()
    (dev / "accel0").touch()  # v2 to v5p
    assert tpu_attached(str(dev), str(tmp_path / "none"), env={})


def test_chosen_platforms_or_a_tpu_leave_jax_alone(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    assert not skip_absent_tpu(env={"JAX_PLATFORMS": "tpu"}, attached=False)
    assert not skip_absent_tpu(env={}, attached=True)
    bridge = sys.modules["jax._src.xla_bridge"]
    before = dict(bridge._backend_factories)
    monkeypatch.setattr(bridge, "_backend_factories", before)
    assert skip_absent_tpu(env={}, attached=False)
    assert bridge._backend_factories["tpu"].factory.func is backends._not_here


@pytest.mark.skipif(tpu_attached(), reason="a TPU is attached: libtpu starts for real")
def test_no_libtpu_lines_on_a_host_without_a_tpu():
    """The README's order (jax, then jaxpar) and the other, and a step jitted and run: stderr
    has none of libtpu's start-up errors. Without jaxpar, JAX's discovery prints them."""
    pytest.importorskip("libtpu", reason="the TPU compiler (pip install 'jax[tpu]')")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # JAX chooses
    step = "print(jax.jit(lambda x: x * 2)(jax.numpy.arange(3)).sum(), jax.devices()[0].platform)"
    said = {}
    for name, code in [("jax alone", f"import jax\n{step}"),
                       ("jax first", f"import jax\nimport jaxpar\n{step}"),
                       ("jaxpar first", f"import jaxpar\nimport jax\n{step}")]:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=120)
        assert done.returncode == 0 and done.stdout.split()[0] == "6", (name, done.stderr)
        said[name] = [w for w in LIBTPU_SAYS if w in done.stderr]
    assert said["jax alone"], "libtpu printed nothing: this check would prove nothing"
    assert said["jax first"] == said["jaxpar first"] == [], said


def test_libtpu_start_lines_are_counted_into_one(capfd):
    with libtpu_start_summarised():
        os.write(2, b"WARNING: Logging before InitGoogle() is written to STDERR\n"
                    b"E0000 00:00:1 common_lib.cc:554] INVALID_ARGUMENT: TPU_WORKER_HOSTNAMES\n")
    err = capfd.readouterr().err
    assert err == ("jaxpar: libtpu printed 2 lines starting the TPU compiler (it looks for a "
                   "TPU to run on; compiling for one needs none)\n")
    with libtpu_start_summarised():
        pass  # libtpu loaded already: nothing printed, nothing said
    with pytest.raises(ValueError), libtpu_start_summarised():
        os.write(2, b"E0000 refused\n")
        raise ValueError("the topology")  # the error says why: the lines are dropped
    assert capfd.readouterr().err == ""


CUDA_SAYS = ("cudart_stub", "cuda drivers", "Unable to load CUDA", "plugin configuration")


@pytest.mark.skipif(backends.gpu_attached(), reason="a GPU is attached: the plugin starts")
def test_no_cuda_plugin_lines_on_a_host_without_a_gpu():
    """With jax's CUDA plugin installed (for ``jaxpar compile --target h100:8``), a process
    that imports jaxpar, loads JAX's GPU kernels' modules (Pallas) and runs a step prints
    nothing of the plugin's: no driver lines, no failed registration. Without jaxpar, JAX
    prints both. Imported after jax, jaxpar comes too late for the driver lines (JAX's
    import loads those modules) but not for the failed registration; the GPU compiler
    still registers (the topology of 8 H100s is there)."""
    pytest.importorskip(backends.CUDA_PLUGIN, reason="jax's CUDA plugin")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    step = ("import jax.experimental.pallas\n"
            "print(jax.jit(lambda x: x * 2)(jax.numpy.arange(3)).sum(), "
            "jax.devices()[0].platform)")
    said = {}
    for name, code in [("jax alone", f"import jax\n{step}"),
                       ("jax first", f"import jax\nimport jaxpar\n{step}"),
                       ("jaxpar first", f"import jaxpar\nimport jax\n{step}\n"
                                        "from jaxpar.analysis.targets import gpu_target\n"
                                        "print(len(gpu_target('h100:8').devices))")]:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=120)
        assert done.returncode == 0 and done.stdout.split()[:2] == ["6", "cpu"], (
            name, done.stderr)
        said[name] = [w for w in CUDA_SAYS if w in done.stderr]
    assert said["jax alone"], "the plugin printed nothing: this check would prove nothing"
    assert said["jaxpar first"] == [], said
    assert not set(said["jax first"]) & {"Unable to load CUDA", "plugin configuration"}, said
    assert done.stdout.split()[-1] == "8"

