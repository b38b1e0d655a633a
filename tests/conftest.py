"""Test session set-up: 8 fake CPU devices for the whole pytest process, strict numerics.

The device count must be set before JAX's backend starts, which is why this runs at import
time of conftest. Single-device references run on a 1-device mesh inside the same process.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from parallel.devices import request_cpu_devices  # noqa: E402

request_cpu_devices(8)

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def n_devices() -> int:
    assert len(jax.devices()) == 8, "tests expect 8 fake CPU devices"
    return 8
