"""Small shared pieces for the tests: a synthetic batch stream and a step runner."""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.config import PRESETS
from experiments.optim import make_optimizer
from parallel.sharded_run import max_tree_diff, run_label

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


def run_steps(label: str, devices: int, batches, mesh: str | None = None, model=None,
              train=None):
    """Per-step losses and final params of one strategy label on `devices` devices."""
    train = train or TINY.train
    return run_label(label, devices, batches, model or TINY.model, make_optimizer(train),
                     seed=train.seed, clip_norm=train.clip_norm, mesh_spec=mesh)


def with_model(**kw):
    return dataclasses.replace(TINY.model, **kw)
