"""Faking N CPU devices: `jax.config.update("jax_num_cpu_devices", n)` after `import jax`,
before the backend starts (the first JAX operation or `jax.devices()`).

The documented XLA route (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, set before
Python starts) keeps working: when it is present and no count is asked for, it is respected.
GPU and TPU backends ignore both and use their real devices. What can be read before JAX is
imported (the host's cores, XLA_FLAGS's count) lives in the JAX-free `parallel.host`.
"""

from __future__ import annotations

import jax
from jax._src import xla_bridge  # only to detect a started backend

from parallel.host import xla_flags_device_count


def request_cpu_devices(n: int | None, default: int = 8) -> None:
    """Ask the CPU backend for n devices (None: XLA_FLAGS's count if set, else `default`).

    Raises RuntimeError if the backend has already started with another count: the request
    would be ignored and the run would use the wrong number of devices. One started with n
    devices already (a second launcher in the same process) has what was asked for.
    """
    if n is not None and n < 1:
        raise ValueError(f"devices={n}: must be a positive integer")
    if n is None and xla_flags_device_count() is not None:
        return
    if xla_bridge.backends_are_initialized():
        if len(jax.devices("cpu")) == (n or default):
            return
        raise RuntimeError("request_cpu_devices() called after JAX started its backends")
    jax.config.update("jax_num_cpu_devices", n or default)
