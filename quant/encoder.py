"""Quantising the BERT encoder (model/bert.py) with the decoder's machinery.

Every mode but SmoothQuant needs nothing new: the encoder's blocks are `Dense` modules under
"blocks/...", and it accepts quant/calibrate.py's call (token rows only, the padding mask is
derived from the pad id; `runner` runs the layers eagerly), so `quant.pipeline.quantize`
runs as is.

SmoothQuant does not carry over: quant/smoothquant.py folds 1/s into the scale of the pre-norm
that feeds q/k/v (`smoothquant.norm_feeds`). In a post-LN encoder that norm's output is also
the residual stream, so the fold would change the function. Here instead:
  - v -> o is folded exactly as in the decoder (o's input is a convex combination of v's output
    rows per head; v's bias is divided too, since attention weights sum to one);
  - q/k/v (one shared factor), up and down get a `Smooth` wrapper: s folded into the kernel rows
    and x * (1/s) applied to the input at run time. That multiply is elementwise on the tensor
    the per-token quantiser reads anyway, so XLA fuses it into the quantisation pass. `down`
    (after the GELU, where BERT's outliers live) is smoothed this way too.
The wrapped Dense keeps its path with "/inner" appended, so the default rule "blocks/*" still
selects it and calibration taps it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from model.layers import _lead, param
from quant import pipeline
from quant.alpha_search import site_alphas
from quant.calibrate import calibrate
from quant.convert import QuantConfig, check_finite, get_module, set_module
from quant.smoothquant import Site, alpha_of, input_site

# Dense paths sharing one input -> one smoothing factor per group (applied at run time).
RUNTIME_GROUPS = (("blocks/attn/q", "blocks/attn/k", "blocks/attn/v"), ("blocks/mlp/up",),
                  ("blocks/mlp/down",))


class Smooth(nnx.Module):
    """inner(x * inv_scale): the input side of SmoothQuant when no norm can absorb it."""

    def __init__(self, inner: nnx.Module, inv_scale: jax.Array, axes: tuple):
        self.inner = inner
        self.inv_scale = param(inv_scale, axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.inner(x * _lead(self.inv_scale[...].astype(x.dtype), x.ndim))


@dataclasses.dataclass(frozen=True)
class _AlreadySmoothed(QuantConfig):
    """The same config, telling quant.pipeline that the smoothing is done (by fold_encoder)."""

    @property
    def smooth(self) -> bool:
        return False


def encoder_sites(model: nnx.Module, x_absmax: dict) -> dict[str, Site]:
    """The encoder's smoothing sites (v -> o, and the run-time groups) by the name
    `fold_encoder` reports their factors under; from the float weights as they are now."""
    groups = (("blocks/attn/o",), *RUNTIME_GROUPS)
    return {group[0]: input_site(model, group, x_absmax) for group in groups}


def fold_encoder(model: nnx.Module, x_absmax: dict,
                 alpha: float | dict[str, list[float]]) -> dict[str, list]:
    """Smooth the encoder in place (float function unchanged up to rounding); returns factors.
    alpha: one migration strength, or one per layer by site (quant/alpha_search.py)."""
    sites = encoder_sites(model, x_absmax)
    factors = {name: site.factors(alpha_of(alpha, name)) for name, site in sites.items()}
    v, o = get_module(model, "blocks/attn/v"), get_module(model, "blocks/attn/o")
    s = factors["blocks/attn/o"]
    v.kernel.set_value(v.kernel[...] / s[..., None, :])
    v.bias.set_value(v.bias[...] / s)
    o.kernel.set_value(o.kernel[...] * s[..., None])
    for group in RUNTIME_GROUPS:
        s = factors[group[0]]
        denses = [get_module(model, p) for p in group]
        axes = tuple(denses[0].kernel.get_metadata()["out_sharding"][:-1])  # (layers, in-axis)
        for path, d in zip(group, denses, strict=True):
            d.kernel.set_value(d.kernel[...] * s[..., None])
            set_module(model, path, Smooth(d, 1.0 / s, axes))
    return {k: jax.device_get(f).tolist() for k, f in factors.items()}


def quantize(graphdef, params: dict, qcfg: QuantConfig, batches,
             error_report: bool = True) -> tuple:
    """(quantised graphdef, params, plan, report) of a BertEncoder, for every mode
    (error_report: see quant.pipeline.quantize)."""
    if not qcfg.smooth:
        return pipeline.quantize(graphdef, params, qcfg, batches, error_report)
    qcfg.validate()
    check_finite(params, "parameter")
    batches = pipeline.as_batches(batches)
    stats = calibrate(graphdef, params, batches(), outlier_threshold=qcfg.outlier_threshold)
    model = nnx.merge(graphdef, params)
    alpha = site_alphas(qcfg, graphdef, params, batches(), encoder_sites(model, stats["absmax"]))
    factors = fold_encoder(model, stats["absmax"], alpha)
    smoothed_def, smoothed = nnx.split(model)
    done = _AlreadySmoothed(**dataclasses.asdict(qcfg))
    qdef, qparams, plan, report = pipeline.quantize(smoothed_def, nnx.to_pure_dict(smoothed),
                                                    done, batches, error_report)
    if qcfg.alpha_search:
        report["alpha"] = alpha
    report["smoothing"] = {k: {"min": float(np.min(v)), "max": float(np.max(v))}
                           for k, v in factors.items()}
    return qdef, qparams, plan, report


def calibration_rows(tokens: np.ndarray, batch: int) -> list[np.ndarray]:
    """Padded token batches in calibrate()'s layout: [B, T + 1] (it drops the last column)."""
    rows = np.concatenate([tokens, np.zeros((tokens.shape[0], 1), tokens.dtype)], axis=1)
    return [rows[i:i + batch] for i in range(0, len(rows), batch)]
