"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights, offline.

For a Dense fed by an RMSNorm, s_j = max|X_j|^alpha / max|W_j|^(1-alpha) per input channel j;
X diag(s)^-1 comes for free by dividing the norm's scale by s, and diag(s) W is folded into the
kernel. The float function is unchanged (up to rounding); the int8 one gets activations whose
channels are evened out, which per-token and per-tensor scales handle much better.

The attention output projection `o` is smoothed too: its input is a per-head convex combination
of `v`'s output columns, so scaling v's output column j by 1/s_j scales o's input channel j by
1/s_j exactly (v is not rotated). Under grouped-query attention one v column feeds the same
channel of every query head in its group, so those o rows share one factor (the group's max).

`down` after a GELU cannot be smoothed offline; after SwiGLU its input is silu(gate x) * (up x),
linear in up's output, so scaling up's output column j by 1/s_j scales down's input channel j
by 1/s_j exactly: the fold the Llama family's "massive activations" (a few channels of down's
input hundreds of times the median) need most.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from quant.convert import get_module

SCALE_LIMITS = (1e-5, 1e5)  # keeps a near-dead channel from blowing up the other side


def smoothing_factors(x_absmax: jax.Array, w_absmax: jax.Array, alpha: float) -> jax.Array:
    """s [..., in] with the guards: a channel that is zero on either side keeps s = 1."""
    x = x_absmax.astype(jnp.float32)
    w = w_absmax.astype(jnp.float32)
    ok = (x > 0) & (w > 0)
    s = jnp.where(ok, jnp.power(jnp.where(ok, x, 1.0), alpha)
                  / jnp.power(jnp.where(ok, w, 1.0), 1.0 - alpha), 1.0)
    return jnp.clip(s, *SCALE_LIMITS)


def _row_absmax(kernel: jax.Array) -> jax.Array:
    """max over the output axis: [..., in]."""
    return jnp.max(jnp.abs(kernel.astype(jnp.float32)), axis=-1)


def norm_feeds(model: nnx.Module) -> dict[str, tuple[str, ...]]:
    """Which pre-norm feeds which Dense (SmoothQuant folds 1/s into the norm, s into them)."""
    mlp = ("blocks/mlp/gate", "blocks/mlp/up") if hasattr(model.blocks.mlp, "gate") \
        else ("blocks/mlp/up",)
    return {"blocks/attn_norm": ("blocks/attn/q", "blocks/attn/k", "blocks/attn/v"),
            "blocks/mlp_norm": mlp}


def _group_max(a: jax.Array, groups: int, head_dim: int) -> jax.Array:
    """[..., heads * head_dim] -> [..., kv_heads * head_dim]: max over the query heads that
    share one key/value head (query head n uses kv head n // groups)."""
    lead = a.shape[:-1]
    heads = a.shape[-1] // head_dim
    a = a.reshape(*lead, heads // groups, groups, head_dim)
    return jnp.max(a, axis=-2).reshape(*lead, -1)


def _expand_groups(s: jax.Array, groups: int, head_dim: int) -> jax.Array:
    """Inverse layout of `_group_max`: each kv head's factors repeated for its query heads."""
    lead = s.shape[:-1]
    s = s.reshape(*lead, -1, 1, head_dim)
    return jnp.broadcast_to(s, (*lead, s.shape[-3], groups, head_dim)).reshape(*lead, -1)


def _scale(kernel: nnx.Param, factor: jax.Array) -> None:
    k = kernel[...]
    kernel.set_value((k.astype(jnp.float32) * factor).astype(k.dtype))


def fold(model: nnx.Module, x_absmax: dict[str, jax.Array], alpha: float) -> dict[str, list]:
    """Fold the smoothing factors into the model's float parameters (new arrays, same module).

    x_absmax[path]: calibrated per-input-channel absmax of each Dense input, [layers, in].
    Returns the factors (as lists) by the Dense paths they smooth, for the report.
    """
    factors = {}
    for norm_path, consumers in norm_feeds(model).items():
        norm = get_module(model, norm_path)
        kernels = [get_module(model, c).kernel for c in consumers]
        w_max = jnp.max(jnp.stack([_row_absmax(k[...]) for k in kernels]), axis=0)
        s = smoothing_factors(x_absmax[consumers[0]], w_max, alpha)
        dt = norm.scale[...].dtype
        norm.scale.set_value((norm.scale[...].astype(jnp.float32) / s).astype(dt))
        for k in kernels:
            _scale(k, s[..., :, None])
        factors[norm_path] = s

    cfg = model.cfg
    groups = cfg.n_heads // cfg.kv_heads
    v, o = get_module(model, "blocks/attn/v").kernel, get_module(model, "blocks/attn/o").kernel
    x_v = _group_max(jnp.asarray(x_absmax["blocks/attn/o"]), groups, cfg.head_dim)
    w_v = _group_max(_row_absmax(o[...]), groups, cfg.head_dim)
    s_v = smoothing_factors(x_v, w_v, alpha)  # [layers, kv_heads * head_dim]
    _scale(v, 1.0 / s_v[..., None, :])
    _scale(o, _expand_groups(s_v, groups, cfg.head_dim)[..., :, None])
    factors["blocks/attn/o"] = s_v

    if hasattr(model.blocks.mlp, "gate"):  # SwiGLU: down's input is linear in up's output
        up = get_module(model, "blocks/mlp/up").kernel
        down = get_module(model, "blocks/mlp/down").kernel
        s = smoothing_factors(x_absmax["blocks/mlp/down"], _row_absmax(down[...]), alpha)
        _scale(up, 1.0 / s[..., None, :])
        _scale(down, s[..., :, None])
        factors["blocks/mlp/down"] = s
    return {k: jax.device_get(f).tolist() for k, f in factors.items()}
