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

The other decoder families' fields keep every fold exact:
- q/k/v biases (Qwen2): a bias is added after the kernel, so the norm -> q/k/v fold
  ((x / s) (s W) + b = x W + b) leaves it alone; the v -> o fold scales v's output column j,
  bias included, by 1/s_j (v's output is x W + b as a whole), so v's bias is divided too, and
  o's input stays a convex combination of the scaled columns;
- q/k RMSNorm per head (Qwen3) acts on q's and k's outputs, after the fold on their input; it
  is never a fold site itself (its scale multiplies a per-head normalised vector that feeds the
  rotary map, not a Dense's input channels), so it stays as it is;
- a head size other than d_model / n_heads only changes the layout `_group_max` reads;
- a (1 + w) RMSNorm (Gemma) multiplies by 1 + w, so the fold divides that: w' = (1 + w) / s - 1,
  exact up to the rounding of the subtraction; Gemma's post-attention and post-MLP norms act on
  o's and down's outputs, after their inputs are smoothed, so the v -> o and up -> down folds
  (GeGLU's down input gelu(gate x) * (up x) is linear in up's output, as SwiGLU's) stay exact
  and the post-norms are never fold sites (a norm of an output has no Dense input to scale).
A bias on `up` (no supported family has one) would be divided like v's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial

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


def _divide_outputs(dense: nnx.Module, s: jax.Array) -> None:
    """Divide a Dense's output column j by s_j: its kernel's column and, if it has one, its
    bias (s [..., out])."""
    _scale(dense.kernel, 1.0 / s[..., None, :])
    if getattr(dense, "bias", None) is not None:
        _scale(dense.bias, 1.0 / s)


@dataclasses.dataclass(frozen=True)
class Site:
    """One place a smoothing factor vector is folded (per layer): the Dense layers that read the
    smoothed input (`consumers`; the first one's calibrated input is the site's), and the
    factors a migration strength gives, [layers, in] in the consumers' input layout. alpha is a
    float or an array broadcasting against [layers, in] (one value per layer: [layers, 1])."""
    consumers: tuple[str, ...]
    factors: Callable[[float | jax.Array], jax.Array]


def input_site(model: nnx.Module, consumers: tuple[str, ...],
               x_absmax: dict[str, jax.Array]) -> Site:
    """The site smoothing the one input the `consumers` share (their kernels' rows take s): the
    input's calibrated absmax against the largest kernel row over them."""
    w_max = jnp.max(jnp.stack([_row_absmax(get_module(model, c).kernel[...])
                               for c in consumers]), axis=0)
    return Site(tuple(consumers), partial(smoothing_factors,
                                          jnp.asarray(x_absmax[consumers[0]]), w_max))


def smoothing_sites(model: nnx.Module, x_absmax: dict[str, jax.Array]) -> dict[str, Site]:
    """The decoder's smoothing sites by the name `fold` reports their factors under: the two
    pre-norms, v -> o, and (SwiGLU) up -> down. Computed from the float weights as they are now:
    call it before folding."""
    sites = {norm_path: input_site(model, consumers, x_absmax)
             for norm_path, consumers in norm_feeds(model).items()}
    cfg = model.cfg
    groups = cfg.n_heads // cfg.kv_heads
    o = get_module(model, "blocks/attn/o").kernel
    x_v = _group_max(jnp.asarray(x_absmax["blocks/attn/o"]), groups, cfg.head_dim)
    w_v = _group_max(_row_absmax(o[...]), groups, cfg.head_dim)

    def o_factors(alpha):  # one factor per v column, repeated for the query heads sharing it
        return _expand_groups(smoothing_factors(x_v, w_v, alpha), groups, cfg.head_dim)

    sites["blocks/attn/o"] = Site(("blocks/attn/o",), o_factors)
    if hasattr(model.blocks.mlp, "gate"):  # Sw/GeGLU: down's input is linear in up's output
        sites["blocks/mlp/down"] = input_site(model, ("blocks/mlp/down",), x_absmax)
    return sites


def alpha_of(alpha: float | Mapping[str, Sequence[float]], site: str):
    """The migration strength for a site: a float for every site, or one per layer by site."""
    if isinstance(alpha, Mapping):
        return jnp.asarray(alpha[site], jnp.float32)[:, None]  # [layers, 1]
    return alpha


def fold(model: nnx.Module, x_absmax: dict[str, jax.Array],
         alpha: float | Mapping[str, Sequence[float]]) -> dict[str, list]:
    """Fold the smoothing factors into the model's float parameters (new arrays, same module).

    x_absmax[path]: calibrated per-input-channel absmax of each Dense input, [layers, in].
    alpha: one migration strength, or per site (`smoothing_sites`' names) one per layer
    (quant/alpha_search.py). Returns the factors (as lists) by site, for the report.
    """
    cfg = model.cfg
    sites = smoothing_sites(model, x_absmax)
    factors = {name: site.factors(alpha_of(alpha, name)) for name, site in sites.items()}
    for norm_path in norm_feeds(model):
        s = factors[norm_path]
        norm = get_module(model, norm_path)
        dt = norm.scale[...].dtype
        offset = getattr(norm, "offset", 0.0)  # 1.0 for a (1 + w) norm: (1 + w) / s - 1
        scaled = (norm.scale[...].astype(jnp.float32) + offset) / s - offset
        norm.scale.set_value(scaled.astype(dt))
        for c in sites[norm_path].consumers:
            _scale(get_module(model, c).kernel, s[..., :, None])

    groups = cfg.n_heads // cfg.kv_heads
    s_o = factors["blocks/attn/o"]
    # v's columns: the first query head of each group holds its kv head's factors
    s_v = s_o.reshape(*s_o.shape[:-1], cfg.kv_heads, groups, cfg.head_dim)[..., 0, :]
    s_v = s_v.reshape(*s_o.shape[:-1], -1)
    _divide_outputs(get_module(model, "blocks/attn/v"), s_v)
    _scale(get_module(model, "blocks/attn/o").kernel, s_o[..., :, None])
    factors["blocks/attn/o"] = s_v

    if "blocks/mlp/down" in sites:
        s = factors["blocks/mlp/down"]
        _divide_outputs(get_module(model, "blocks/mlp/up"), s)
        _scale(get_module(model, "blocks/mlp/down").kernel, s[..., :, None])
    return {k: jax.device_get(f).tolist() for k, f in factors.items()}
