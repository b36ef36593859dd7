"""Test set-up: 8 simulated CPU devices, created before any backend starts."""

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests need 8 simulated CPU devices"
    return devs
