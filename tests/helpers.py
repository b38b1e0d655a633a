"""Small shared pieces for the tests: a synthetic batch stream and a step runner."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from experiments.config import PRESETS
from experiments.optim import make_optimizer
from parallel.mesh import make_mesh
from parallel.state import abstract_model, init_state
from parallel.strategies import Strategy
from parallel.train_step import StepConfig, make_train_step

TINY = PRESETS["tiny"]


def synthetic_batches(n: int, micro: int, batch: int, seq_len: int, seed: int = 0):
    """Token batches with learnable structure (a noisy byte-increment sequence)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, 256, (micro, batch, 1))
        seq = (start + np.arange(seq_len + 1)) % 256
        noise = rng.random(seq.shape) < 0.1
        seq = np.where(noise, rng.integers(0, 256, seq.shape), seq)
        out.append(seq.astype(np.int32))
    return out


def run_steps(strategy: str, devices: int, batches, mesh: str | None = None, model=None,
              train=None):
    """Per-step losses and final params (host numpy) of `len(batches)` training steps."""
    model = model or TINY.model
    train = train or TINY.train
    tx = make_optimizer(train)
    graphdef, axes, _ = abstract_model(model)
    abstract_state = jax.eval_shape(lambda: init_state(model, tx, train.seed))
    micro, batch, length = batches[0].shape
    step, shardings, batch_sharding = make_train_step(
        graphdef, axes, abstract_state, model, Strategy(strategy), make_mesh(devices, mesh), tx,
        StepConfig(global_batch=batch, seq_len=length - 1, micro_steps=micro,
                   clip_norm=train.clip_norm))
    state = jax.jit(lambda: init_state(model, tx, train.seed), out_shardings=shardings)()
    losses = []
    for b in batches:
        state, metrics = step(state, jax.device_put(b, batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state["params"])


def max_tree_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def with_model(**kw):
    return dataclasses.replace(TINY.model, **kw)
