"""Timed calls with Python's garbage collector paused.

A full collection walks every object the process holds; in a benchmark process holding many
models and compiled programs it takes longer than a short timed call, and it lands in whichever
call allocates the object that crosses the collector's threshold: one run of one variant, at
random. `timeit` pauses the collector for the same reason. Collections still run between the
timed calls.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

import jax


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off inside the block, and as it was after."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def timed_call(fn: Callable, *args) -> tuple[object, float]:
    """(fn(*args), once its arrays are ready; the seconds that took), the collector paused."""
    with gc_paused():
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        return out, time.perf_counter() - t0
