"""What the host offers before JAX starts: its usable CPU cores and the XLA_FLAGS device count.

JAX-free, so that launchers can size their fake CPU devices while checking their flags.
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
