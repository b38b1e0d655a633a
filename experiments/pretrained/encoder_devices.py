"""How many CPU devices the MiniLM encoder splits a batch over when none are asked for (JAX-free:
launchers choose before JAX starts)."""

from __future__ import annotations

from parallel.host import usable_cpu_cores, xla_flags_device_count

# Encoding is data parallel over CPU devices; each device executes on its own thread, so one
# device per core keeps both busy (one device leaves a core idle between the ops that XLA:CPU
# runs single-threaded, 8 on 2 cores split each batch into slivers): measured in
# docs/inference_speed.md.
MAX_DEVICES = 8


def default_devices() -> int:
    """XLA_FLAGS's count if it sets one, else one per usable core, at most MAX_DEVICES."""
    return xla_flags_device_count() or max(1, min(MAX_DEVICES, usable_cpu_cores()))
