"""SmoothQuant (ANCHORS §3): move activation outliers into the weights, offline.

For a Dense fed by an RMSNorm, s_j = max|X_j|^alpha / max|W_j|^(1-alpha) per input channel j;
X diag(s)^-1 comes for free by dividing the norm's scale by s, and diag(s) W is folded into the
kernel. The float function is unchanged (up to rounding); the int8 one gets activations whose
channels are evened out, which per-token and per-tensor scales handle much better.

The attention output projection `o` is smoothed too: its input is a per-head convex combination
of `v`'s output columns, so scaling v's output column j by 1/s_j scales o's input channel j by
1/s_j exactly (v is not rotated). `down` follows a GELU and cannot be smoothed offline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from quant.convert import NORM_FEEDS, get_module

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


def fold(model: nnx.Module, x_absmax: dict[str, jax.Array], alpha: float) -> dict[str, list]:
    """Fold the smoothing factors into the model's float parameters (new arrays, same module).

    x_absmax[path]: calibrated per-input-channel absmax of each Dense input, [layers, in].
    Returns the factors (as lists) by the Dense paths they smooth, for the report.
    """
    factors = {}
    for norm_path, consumers in NORM_FEEDS.items():
        norm = get_module(model, norm_path)
        kernels = [get_module(model, c).kernel for c in consumers]
        w_max = jnp.max(jnp.stack([_row_absmax(k[...]) for k in kernels]), axis=0)
        s = smoothing_factors(x_absmax[consumers[0]], w_max, alpha)
        dt = norm.scale[...].dtype
        norm.scale.set_value((norm.scale[...].astype(jnp.float32) / s).astype(dt))
        for k in kernels:
            k.set_value((k[...].astype(jnp.float32) * s[..., None]).astype(k[...].dtype))
        factors[norm_path] = s
    v, o = get_module(model, "blocks/attn/v").kernel, get_module(model, "blocks/attn/o").kernel
    s = smoothing_factors(x_absmax["blocks/attn/o"], _row_absmax(o[...]), alpha)
    v.set_value((v[...].astype(jnp.float32) / s[..., None, :]).astype(v[...].dtype))
    o.set_value((o[...].astype(jnp.float32) * s[..., None]).astype(o[...].dtype))
    factors["blocks/attn/o"] = s
    return {k: jax.device_get(f).tolist() for k, f in factors.items()}
