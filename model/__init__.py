"""What is computed: Flax NNX models that speak only logical axis names."""

from model.config import MODEL_PRESETS, ModelConfig
from model.flops import param_count, train_flops_per_token
from model.transformer import DecoderLM

__all__ = ["MODEL_PRESETS", "ModelConfig", "DecoderLM", "param_count", "train_flops_per_token"]
