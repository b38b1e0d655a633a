"""What a run's compiled training step holds per device, read from the compiled program."""

from __future__ import annotations

import jax

from experiments.training.config import Config
from experiments.training.trainer import prepare
from parallel import hlo


def state_memory(cfg: Config) -> dict:
    """Per-device bytes of the compiled step's parameters and optimizer state, and its peak."""
    run = prepare(cfg)
    state, batch = run.sharded.abstract_args()
    compiled = run.sharded.step.lower(state, batch).compile()
    per_device = hlo.input_bytes_per_device(compiled, (state, batch))[0]
    peak = hlo.memory_peak(compiled)
    return {"params_bytes_per_device": sum(jax.tree.leaves(per_device["params"])),
            "optimizer_bytes_per_device": sum(jax.tree.leaves(per_device["opt"])),
            "compiled_peak_bytes_per_device": peak.peak,
            "float32_model_bytes": 4 * sum(a.size for a in jax.tree.leaves(state["params"]))}
