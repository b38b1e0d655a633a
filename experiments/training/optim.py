"""AdamW with linear warm-up and cosine decay (gradient clipping lives in the train step)."""

from __future__ import annotations

import jax
import optax

from experiments.training.config import TrainConfig


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def _decay_mask(params):
    # Weight decay on matmul kernels only; norms and the embedding table are left alone.
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    # Clipping by the *global* norm needs a cross-device sum under sharding, so the train step
    # does it; the optimizer itself is purely elementwise and runs on any shard.
    return optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=1e-8,
                       weight_decay=cfg.weight_decay, mask=_decay_mask)
