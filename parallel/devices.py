"""Faking N CPU devices. Must run before the first `import jax` of the process."""

from __future__ import annotations

import os
import re
import sys

_FLAG = "--xla_force_host_platform_device_count"


def request_cpu_devices(n: int) -> None:
    """Ask XLA's host platform for n devices (ignored by GPU/TPU backends).

    Raises RuntimeError if JAX's backend has already started, because the flag would then be
    silently ignored and the run would train on the wrong number of devices.
    """
    if n < 1:
        raise ValueError(f"devices={n}: must be a positive integer")
    if "jax" in sys.modules:
        from jax._src import xla_bridge  # noqa: PLC0415 - only to detect a started backend

        if xla_bridge.backends_are_initialized():
            raise RuntimeError("request_cpu_devices() called after JAX started its backends")
    flags = re.sub(rf"{_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()
