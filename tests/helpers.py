"""Small shared pieces for the tests: a synthetic batch stream and a step runner."""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import equivalence
from experiments.config import PRESETS
from experiments.equivalence import max_tree_diff

TINY = PRESETS["tiny"]
__all__ = ["TINY", "max_tree_diff", "run_steps", "synthetic_batches", "with_model"]


def synthetic_batches(n: int, micro: int, batch: int, seq_len: int, seed: int = 0):
    """Token batches with learnable structure (a noisy byte-increment sequence)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, 256, (micro, batch, 1))
        seq = (start + np.arange(seq_len + 1)[None, None, :]) % 256
        noise = rng.random(seq.shape) < 0.1
        seq = np.where(noise, rng.integers(0, 256, seq.shape), seq)
        out.append(seq.astype(np.int32))
    return out


def run_steps(strategy: str, devices: int, batches, mesh: str | None = None, model=None,
              train=None):
    return equivalence.run_steps(strategy, devices, batches, mesh, model or TINY.model,
                                 train or TINY.train)


def with_model(**kw):
    return dataclasses.replace(TINY.model, **kw)
