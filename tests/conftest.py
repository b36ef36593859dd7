"""Test set-up: 8 simulated CPU devices, created before any backend starts, unoptimised CPU
code generation, and one XLA compilation cache for the session.

Many tests compile the same programs (the small reference model's step on the same mesh,
in this process and in every ``jaxpar`` subprocess and notebook kernel the tests start):
a persistent compilation cache, fresh for each session and shared through the
environment, compiles each once. Tests that read what the compiler says (XLA's warnings)
take the :func:`fresh_compile` fixture, which turns the cache off around them.
"""

import atexit
import gc
import os
import shutil
import tempfile

import jax
import pytest

# The TPU compiler (libtpu) is installed for the tests that compile for TPU topologies;
# nothing runs on a TPU here, so JAX (and every jaxpar subprocess) starts on the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
jax.config.update("jax_num_cpu_devices", 8)
# The programs here are tiny: compiling them, mostly LLVM optimising the CPU code, costs far
# more than running them. LLVM optimisation off halves the suite; the HLO passes (SPMD
# partitioning, collectives, buffer assignment: what the tests read) are unchanged.
# XLA:CPU's newer fusion emitters (MLIR) take twice as long to compile a fusion as the
# classic elemental emitters, for nothing these tests read: fusion and every HLO pass stay
# the same, only how a fusion is lowered to LLVM changes (a test's compile time measured
# 10 -> 5 s, its wall time 18 -> 14 s).
# Inherited by every subprocess and notebook kernel the tests start; benchmarks do not set it.
UNOPTIMISED = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), UNOPTIMISED]).strip()

# pytest-xdist workers inherit the controller's cache (and leave removing it to it).
_CACHE = os.environ.get("JAXPAR_TEST_XLA_CACHE")
if not _CACHE:
    _CACHE = tempfile.mkdtemp(prefix="jaxpar-tests-xla-cache-")
    os.environ["JAXPAR_TEST_XLA_CACHE"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": _CACHE,
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
os.environ.update(CACHE_ENV)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Tracing and lowering make many short-lived objects; the collector's default thresholds
# walk the long-lived ones (jax, flax, the test modules) over and over: 3-4% of the CPU in
# a perf profile of tests/parallel/test_zero.py. Frozen after the imports, and collected
# less often: that file 48 -> 44 s.
def pytest_configure(config):
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


@pytest.fixture
def fresh_compile():
    """Compile everything in this test afresh, so XLA's warnings reach stderr."""
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests need 8 simulated CPU devices"
    return devs
