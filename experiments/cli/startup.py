"""How a launcher reaches its JAX-side code: flags first, then start-up, then imports.

A launcher module imports only JAX-free code at its top (flags, configs, checks), so `--help` and
a refused flag answer at once, without the seconds JAX, Flax and Orbax take to import. Once its
flags are checked, the launcher calls `begin` (start the runtime, then import) or `load` (import
only, for launchers that never start a backend), naming the library modules it needs; they come
back in the order named. This is the only place in `experiments/` that imports inside a function.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from model.config import ModelConfig  # JAX-free


def load(*modules: str) -> tuple[ModuleType, ...]:
    """Import `modules` (dotted names) and return them in that order."""
    return tuple(importlib.import_module(m) for m in modules)


def begin(*modules: str, devices: int | None = 1,
          model: ModelConfig | None = None) -> tuple[ModuleType, ...]:
    """Start the JAX runtime, then import `modules` and return them in order.

    `devices`: fake CPU devices to ask for (None: leave the count alone); `model`: the run's model
    config, refused in one line (exit 2) when the started backend cannot run it. The runtime
    module itself imports JAX, so it is imported here too, not at the launcher's top.
    """
    (runtime,) = load("experiments.cli.runtime")
    runtime.start(devices, model)
    return load(*modules)
