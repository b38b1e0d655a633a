"""Our GPT family, which `--params` picks from, and how a model shape is described.

The GPT-3-style presets' (width, depth) points, depth interpolated log-linearly in width between
them (and extended along the end segments), head dim 128, d_ff = 4 d_model, byte vocabulary.
Every one of those presets is a member.
"""

from __future__ import annotations

import math

from model.config import MODEL_PRESETS, ModelConfig
from model.flops import param_count

FAMILY_PRESETS = ("1.3b", "7.5b", "128b", "1t")
HEAD_DIM = 128
WIDTH_STEP = 128  # widths searched are multiples of this (the head dim)


def _family_points() -> list[tuple[int, int]]:
    return [(MODEL_PRESETS[p].d_model, MODEL_PRESETS[p].n_layers) for p in FAMILY_PRESETS]


def family_depth(d_model: int) -> int:
    pts = _family_points()
    logd = math.log(d_model)
    i = 0
    while i < len(pts) - 2 and logd > math.log(pts[i + 1][0]):
        i += 1
    (d0, l0), (d1, l1) = pts[i], pts[i + 1]
    slope = (math.log(l1) - math.log(l0)) / (math.log(d1) - math.log(d0))
    return max(1, round(math.exp(math.log(l0) + slope * (logd - math.log(d0)))))


def family_shape(d_model: int, *, seq_len: int = 2048, dtype: str = "bfloat16",
                 remat: str = "full") -> ModelConfig:
    """The member of width d_model (a multiple of WIDTH_STEP)."""
    return ModelConfig(vocab_size=256, d_model=d_model, n_layers=family_depth(d_model),
                       n_heads=max(1, d_model // HEAD_DIM), d_ff=4 * d_model, max_len=seq_len,
                       param_dtype=dtype, compute_dtype=dtype, remat=remat)


def family_width_for(psi: float, max_width: int = 1 << 17) -> int:
    """The member width (multiple of WIDTH_STEP) whose parameter count is closest to psi."""
    lo, hi = 1, max_width // WIDTH_STEP
    while lo < hi:  # smallest width with at least psi parameters
        mid = (lo + hi) // 2
        if param_count(family_shape(mid * WIDTH_STEP)) >= psi:
            hi = mid
        else:
            lo = mid + 1
    cands = [w for w in (lo - 1, lo) if w >= 1]
    return WIDTH_STEP * min(cands, key=lambda w: abs(param_count(family_shape(w * WIDTH_STEP))
                                                     - psi))


def describe_shape(cfg: ModelConfig) -> str:
    kv = f", n_kv_heads {cfg.n_kv_heads}" if cfg.n_kv_heads else ""
    n = param_count(cfg)
    size = next(f"{n / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K"),
                                                              (1, "")) if n >= scale or scale == 1)
    return (f"d_model {cfg.d_model}, n_layers {cfg.n_layers}, n_heads {cfg.n_heads}{kv}, "
            f"d_ff {cfg.d_ff}, vocab {cfg.vocab_size} ({size} params)")
