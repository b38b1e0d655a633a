"""What is computed: Flax NNX models that speak only logical axis names.

The config names are imported at once; the model and its counts on first use, so that checking a
config (`experiments.cli.config`) never imports JAX.
"""

import importlib

from model.config import MODEL_PRESETS, ModelConfig

_LAZY = {"DecoderLM": "model.transformer", "param_count": "model.flops",
         "train_flops_per_token": "model.flops"}

__all__ = ["MODEL_PRESETS", "ModelConfig", "DecoderLM", "param_count", "train_flops_per_token"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
