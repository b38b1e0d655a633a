"""Rotary frequencies as transformers computes them (float32), with Llama 3's scaling and
LongRoPE: numpy only, so the GGUF reader uses them before JAX starts."""

from __future__ import annotations

import numpy as np

from model.config import ModelConfig


def _wavelength_powers(base: float, dim: int) -> np.ndarray:
    """[dim / 2] float32 base ** (2i / dim), the divisors of transformers' rotary frequencies."""
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return np.float32(base) ** exps


def rope_freqs(base: float, head_dim: int) -> np.ndarray:
    """[head_dim / 2] float32 rotary frequencies as transformers computes them."""
    return (np.float32(1.0) / _wavelength_powers(base, head_dim)).astype(np.float32)


def llama3_freqs(cfg: ModelConfig) -> np.ndarray:
    """The rotary frequencies of `cfg.rope_base` under Llama 3's RoPE scaling
    (`cfg.rope_scale_factor`), in float32 as transformers computes them; unscaled when the
    scaling is off."""
    freqs = rope_freqs(cfg.rope_base, cfg.head_dim)
    if not cfg.rope_scale_factor:
        return freqs
    f32 = np.float32
    factor, low, high = (f32(cfg.rope_scale_factor), f32(cfg.rope_low_freq_factor),
                         f32(cfg.rope_high_freq_factor))
    original = f32(cfg.rope_original_max_len)
    wavelen = f32(2 * np.pi) / freqs
    scaled = np.where(wavelen > original / low, freqs / factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    blended = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, blended, scaled).astype(f32)


def longrope_freqs(cfg: ModelConfig) -> np.ndarray:
    """[rope_dim / 2] float32 LongRoPE frequencies, each divided by its short factor where the
    model runs with a context (`max_len`) of at most `rope_original_max_len`, by its long one
    beyond (llama.cpp picks by its context so; transformers by each sequence's length, which
    is the same for any sequence the context holds when that is the shorter)."""
    factors = (cfg.rope_long_factors if cfg.max_len > cfg.rope_original_max_len
               else cfg.rope_short_factors)
    ext = np.asarray(factors, np.float32)
    powers = _wavelength_powers(cfg.rope_base, cfg.rope_dim)
    return (np.float32(1.0) / (ext * powers)).astype(np.float32)


def attention_rope(cfg: ModelConfig) -> tuple[np.ndarray | None, float]:
    """(frequencies, or None for the plain ones of `cfg.rope_base`; the factor sin and cos are
    multiplied by) of a model without `layer_pattern`."""
    if cfg.rope_short_factors is not None:
        return longrope_freqs(cfg), cfg.rope_attention_factor
    if cfg.rope_scale_factor:
        return llama3_freqs(cfg), 1.0
    return None, 1.0
