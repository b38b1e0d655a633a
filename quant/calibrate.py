"""Calibration: run the float model on real batches and record what each Dense sees.

Per Dense input and layer: the per-input-channel absmax (SmoothQuant, static scales) and the
share of outlier columns; with twins (the candidate int8 model), the relative RMS error of each
int8 Dense's output against its float output *on the same float input* (automatic precision).

Variable mutations inside the model's layer scan do not escape it, so calibration runs the
layers eagerly through the model's `runner` argument, one layer at a time, with every
Dense wrapped in a `Tap` that reports to a sink. Slow per op, but it is a few batches, once.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.layers import Dense
from quant.convert import QuantError, get_module, linear_modules, set_module

_SINK: Sink | None = None  # the active recorder (eager calibration only)


class Tap(nnx.Module):
    """A Dense that reports its input and output to the active sink."""

    def __init__(self, inner: Dense, name: str):
        self.inner, self.name = inner, name

    def __call__(self, x):
        y = self.inner(x)
        if _SINK is not None:
            _SINK.record(self.name, x, y)
        return y


@dataclasses.dataclass
class Sink:
    twins: nnx.Module | None = None  # the candidate quantised model, same paths
    outlier_threshold: float = 6.0
    layer: int | None = None
    absmax: dict = dataclasses.field(default_factory=dict)
    outlier_cols: dict = dataclasses.field(default_factory=dict)
    sq_err: dict = dataclasses.field(default_factory=dict)
    sq_ref: dict = dataclasses.field(default_factory=dict)
    token_absmax: dict = dataclasses.field(default_factory=dict)  # per batch: [tokens]
    token_argmax: dict = dataclasses.field(default_factory=dict)  # its channel, per token
    _twin_cache: dict = dataclasses.field(default_factory=dict)

    def _twin(self, name: str, layer: int | None):
        if self.twins is None:
            return None
        key = (name, layer)
        if key not in self._twin_cache:
            module = get_module(self.twins, name)
            if isinstance(module, Dense):  # not quantised under this plan
                twin = None
            elif layer is None:
                twin = module
            else:
                graphdef, state = nnx.split(module)
                twin = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], state))
            self._twin_cache[key] = twin
        return self._twin_cache[key]

    def record(self, name: str, x: jax.Array, y: jax.Array) -> None:
        key = (name, self.layer)
        x2 = jnp.abs(x.reshape(-1, x.shape[-1]).astype(jnp.float32))
        col = np.asarray(jnp.max(x2, axis=0))
        self.token_absmax.setdefault(key, []).append(np.asarray(jnp.max(x2, axis=1)))
        self.token_argmax.setdefault(key, []).append(np.asarray(jnp.argmax(x2, axis=1)))
        self.absmax[key] = np.maximum(self.absmax.get(key, col), col)
        n_out = int(np.sum(col >= self.outlier_threshold))  # columns over it in this batch
        self.outlier_cols[key] = self.outlier_cols.get(key, []) + [n_out]
        twin = self._twin(name, self.layer)
        if twin is not None:
            diff = twin(x).astype(jnp.float32) - y.astype(jnp.float32)
            self.sq_err[key] = self.sq_err.get(key, 0.0) + float(jnp.sum(diff * diff))
            ref = y.astype(jnp.float32)
            self.sq_ref[key] = self.sq_ref.get(key, 0.0) + float(jnp.sum(ref * ref))


@contextlib.contextmanager
def recording(sink: Sink):
    global _SINK
    previous, _SINK = _SINK, sink
    try:
        yield sink
    finally:
        _SINK = previous


def eager_layer_runner(sink: Sink):
    """A runner (model/layer_stack.py) that runs the layers one by one, telling the sink which."""

    def runner(run_layer, stacked, x, positions):
        n_layers = jax.tree.leaves(stacked)[0].shape[0]
        for i in range(n_layers):
            sink.layer = i
            x = run_layer(jax.tree.map(lambda a, i=i: a[i], stacked), x, positions)
        sink.layer = None
        return x

    return runner


def tapped_pass(graphdef, params, batches, sink) -> list[str]:
    """Run the float model eagerly over the batches ([B, T+1] token rows; the last column is
    dropped) with every Dense reporting its input and output to `sink` (a `Sink`, or any object
    with a `layer` attribute, set to the running layer, and `record(name, x, y)`). Returns the
    tapped Dense paths."""
    model = nnx.merge(graphdef, params)
    paths = [p for p, m in linear_modules(model).items() if isinstance(m, Dense)]
    for p in paths:
        set_module(model, p, Tap(get_module(model, p), p))
    runner = eager_layer_runner(sink)
    with recording(sink):
        for rows in batches:
            model(jnp.asarray(rows[:, :-1]), runner=runner)
    return paths


def _stack(per_key: dict, paths, reduce) -> dict:
    """{(path, layer): v} -> {path: array stacked over layers (or the value, unstacked)}."""
    out = {}
    for path in paths:
        keys = sorted((k for k in per_key if k[0] == path), key=lambda k: (k[1] is None, k[1]))
        if not keys:
            continue
        vals = [reduce(per_key[k]) for k in keys]
        out[path] = np.stack(vals) if keys[0][1] is not None else vals[0]
    return out


def calibrate(graphdef, params, batches, twins: nnx.Module | None = None,
              outlier_threshold: float = 6.0) -> dict:
    """Statistics of every Dense input over the batches ([B, T+1] token rows).

    Returns {"absmax": {path: [layers, in] or [in]}, "outlier_cols": {path: [layers] or
    scalar} (mean share of input columns with |x| >= threshold in a batch), "outlier_cols_max"
    (the most such columns in one batch, a count), "rel_err": {path: [layers] or scalar} (only
    with twins)}.
    """
    sink = Sink(twins=twins, outlier_threshold=outlier_threshold)
    paths = tapped_pass(graphdef, params, batches, sink)
    absmax = _stack(sink.absmax, paths, lambda v: v)
    mean_cols = _stack(sink.outlier_cols, paths, lambda v: float(np.mean(v)))
    stats = {"absmax": absmax,
             "outlier_cols": {p: v / absmax[p].shape[-1] for p, v in mean_cols.items()},
             "outlier_cols_max": _stack(sink.outlier_cols, paths, lambda v: int(np.max(v))),
             "token_absmax": _stack(sink.token_absmax, paths, np.concatenate),
             "token_argmax": _stack(sink.token_argmax, paths, np.concatenate)}
    if twins is not None:
        rel = {k: float(np.sqrt(sink.sq_err[k] / max(sink.sq_ref[k], 1e-30))) for k in sink.sq_err}
        stats["rel_err"] = _stack(rel, paths, lambda v: v)
    for path, a in stats["absmax"].items():
        if not np.all(np.isfinite(a)):
            raise QuantError(f"calibration: the input of {path} holds non-finite values "
                             f"(NaN or inf) on the calibration data")
    return stats
