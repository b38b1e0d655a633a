"""SmoothQuant's migration strength chosen per layer and site, on the calibration data.

SmoothQuant's alpha trades the activations' difficulty against the weights': alpha 0 leaves the
outliers in the inputs, alpha 1 moves all of it into the weights. One alpha for the whole model
is the paper's recipe, but a Llama-family model's sites differ: `down`'s input holds the
"massive activations" while q/k/v's is evened out by its RMSNorm. Here every site of every layer
(`Site`: the Dense layers sharing one smoothed input) gets the alpha from `ALPHA_GRID` whose
int8 product is closest to the float one on the calibration rows, as measured on the float
model's own inputs to that site:

    error(alpha) = sum over the site's Dense c of |Q(X / s) Q(s W_c) - X W_c|^2 / |X W_c|^2

with s the site's factors for alpha, Q the quantisers the int8 model uses (per-token
activations, per-channel or per-tensor weights), the product the int8 Dense's own (int8 × int8
summed exactly in int32, then scaled) and X the float input. The float function is unchanged
by any alpha (the folds are exact), so every site can be chosen on its own. One eager pass over
the calibration rows, like calibration's, with the rows joined into few large batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from quant.calibrate import tapped_pass
from quant.convert import get_module
from quant.dense import int8_matmul
from quant.quantizers import quantize, token_scale, weight_scale
from quant.smoothquant import Site

# A grid of 0.1 steps around the paper's 0.5. On SmolLM2-135M-Instruct a finer grid reaching
# 0.95 chose more extreme values and gave a worse perplexity (docs/smollm2.md).
ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def _candidate_errors(x: jax.Array, kernels: tuple[jax.Array, ...], factors: jax.Array,
                      weights: str) -> tuple[jax.Array, jax.Array]:
    """Squared error of each candidate's int8 product [candidates, consumers] and the float
    products' squared norms [consumers], for x [tokens, in], kernels [in, out], factors
    [candidates, in]."""
    x = x.astype(jnp.float32)
    kernels = tuple(w.astype(jnp.float32) for w in kernels)
    floats = tuple(x @ w for w in kernels)  # the same for every candidate: computed once

    def one(s):
        xs = x * (1.0 / s)[None, :]
        s_x = token_scale(xs)
        x_q = quantize(xs, s_x)
        errs = []
        for w, y in zip(kernels, floats, strict=True):
            ws = w * s[:, None]
            s_w = weight_scale(ws, weights)  # [1, out]
            # the int8 Dense's own product: an exact int32 sum, then the two scales
            d = int8_matmul(x_q, quantize(ws, s_w)).astype(jnp.float32) * (s_x * s_w) - y
            errs.append(jnp.sum(d * d))
        return jnp.stack(errs)

    refs = jnp.stack([jnp.sum(jnp.square(y)) for y in floats])
    return jax.lax.map(one, factors), refs


_candidate_errors_jit = jax.jit(_candidate_errors, static_argnames="weights")


class _ErrorSink:
    """Accumulates each site's candidate errors as the tapped model reports its Dense inputs."""

    def __init__(self, sites: dict[str, Site], kernels: dict[str, jax.Array],
                 candidates: dict[str, jax.Array], weights: str):
        self.layer: int | None = None
        self.readers = {site.consumers[0]: name for name, site in sites.items()}
        self.sites, self.kernels, self.candidates, self.weights = sites, kernels, candidates, \
            weights
        self.err: dict[str, np.ndarray] = {}  # [candidates, layers, consumers]
        self.ref: dict[str, np.ndarray] = {}  # [layers, consumers]

    def record(self, name: str, x: jax.Array, y: jax.Array) -> None:
        site = self.readers.get(name)
        if site is None or self.layer is None:
            return
        layer = self.layer
        cands = self.candidates[site]  # [candidates, layers, in]
        kernels = tuple(self.kernels[c][layer] for c in self.sites[site].consumers)
        err, ref = _candidate_errors_jit(x.reshape(-1, x.shape[-1]), kernels,
                                         cands[:, layer], self.weights)
        if site not in self.err:
            n_layers = cands.shape[1]
            self.err[site] = np.zeros((cands.shape[0], n_layers, len(kernels)))
            self.ref[site] = np.zeros((n_layers, len(kernels)))
        self.err[site][:, layer] += np.asarray(err, np.float64)
        self.ref[site][layer] += np.asarray(ref, np.float64)


# Calibration batches are joined into calls of up to this many tokens: each call quantises
# every candidate's scaled weights once, whatever its token count, so separate calls per short
# row would repeat that weight work once per row.
MERGE_TOKENS = 4096


def _merged(batches) -> list[np.ndarray]:
    """Consecutive batches of one row shape joined, up to MERGE_TOKENS tokens per batch."""
    out: list[np.ndarray] = []
    group: list[np.ndarray] = []
    for rows in batches:
        rows = np.asarray(rows)
        if group and (rows.shape[1:] != group[0].shape[1:]
                      or sum(r.size for r in group) + rows.size > MERGE_TOKENS):
            out.append(np.concatenate(group))
            group = []
        group.append(rows)
    if group:
        out.append(np.concatenate(group))
    return out


def search_alphas(graphdef, params, batches, sites: dict[str, Site], weights: str = "channel",
                  grid: tuple[float, ...] = ALPHA_GRID) -> dict[str, list[float]]:
    """Per site, one alpha per layer from `grid` (the first of equals: the smaller), chosen on
    the float model (graphdef, params) over the calibration batches ([B, T+1] token rows)."""
    model = nnx.merge(graphdef, params)
    kernels = {c: get_module(model, c).kernel[...] for site in sites.values()
               for c in site.consumers}
    candidates = {name: jnp.stack([site.factors(a) for a in grid])
                  for name, site in sites.items()}
    sink = _ErrorSink(sites, kernels, candidates, weights)
    tapped_pass(graphdef, params, _merged(batches), sink)
    chosen = {}
    for name in sites:
        rel = np.sum(sink.err[name] / np.maximum(sink.ref[name], 1e-30)[None], axis=-1)
        chosen[name] = [float(grid[i]) for i in np.argmin(rel, axis=0)]  # [layers]
    return chosen


def site_alphas(qcfg, graphdef, params, batches, sites: dict[str, Site]
                ) -> float | dict[str, list[float]]:
    """What a SmoothQuant fold takes as alpha under `qcfg` (a QuantConfig): its one `alpha`, or
    with `alpha_search` one per layer by site, searched here on the float model."""
    if not qcfg.alpha_search:
        return qcfg.alpha
    return search_alphas(graphdef, params, batches, sites, qcfg.weights)
