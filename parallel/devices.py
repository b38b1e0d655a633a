"""Faking N CPU devices: `jax.config.update("jax_num_cpu_devices", n)` after `import jax`,
before the backend starts (the first JAX operation or `jax.devices()`).

The documented XLA route (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, set before
Python starts) keeps working: when it is present and no count is asked for, it is respected.
GPU and TPU backends ignore both and use their real devices.
"""

from __future__ import annotations

import os
import re

_XLA_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def xla_flags_device_count() -> int | None:
    """The device count XLA_FLAGS asks for, if it does."""
    found = _XLA_FLAG.search(os.environ.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else None


def usable_cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which a container or `taskset`
    narrows; os.cpu_count() where the platform has no affinity call)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def request_cpu_devices(n: int | None, default: int = 8) -> None:
    """Ask the CPU backend for n devices (None: XLA_FLAGS's count if set, else `default`).

    Raises RuntimeError if the backend has already started: the request would be ignored and
    the run would use the wrong number of devices.
    """
    if n is not None and n < 1:
        raise ValueError(f"devices={n}: must be a positive integer")
    if n is None and xla_flags_device_count() is not None:
        return
    # JAX is imported here, not at the top: launchers read the host's core count and XLA_FLAGS
    # through this module before JAX starts.
    import jax
    from jax._src import xla_bridge  # only to detect a started backend

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("request_cpu_devices() called after JAX started its backends")
    jax.config.update("jax_num_cpu_devices", n or default)
