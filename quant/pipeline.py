"""Float parameters + calibration batches -> quantised model, plan and per-layer report.

Passes over the calibration data (each a few eager batches):
  1. (smoothquant, auto, w8a8-static) per-channel input ranges of the float model;
     SmoothQuant folds its factors (unless one alpha is given, after a pass that picks each
     site's alpha, quant/alpha_search.py), static mode turns the ranges into per-layer scales;
  2. (auto, or when the error report is asked for: the default) each int8 Dense against its
     float twin on the float model's inputs: the error report, and for auto the layers kept
     in float (the model is then rebuilt with them).
Each pass runs its batches eagerly, so it costs compilations as well as compute: a caller that
only wants the model (embedding texts) skips pass 2 with error_report=False. The batches may be
given as a recipe (a zero-argument callable): they are then built on the first pass that reads
them, so a mode that runs no pass costs its caller no tokenising either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.flops import param_bytes
from quant import auto as auto_precision
from quant.alpha_search import site_alphas
from quant.calibrate import calibrate
from quant.convert import QuantConfig, apply_plan, check_finite, make_plan
from quant.smoothquant import fold, smoothing_sites


class CalibrationBatches:
    """Calibration batches read on demand: given a sequence, or a zero-argument callable that
    builds one, `batches()` builds them on its first call and returns the same list after;
    `read` says how many a pass has read (0: none ran)."""

    def __init__(self, source: Sequence | Callable[[], Sequence]):
        self._source, self._rows = source, None

    def __call__(self) -> list:
        if self._rows is None:
            self._rows = list(self._source() if callable(self._source) else self._source)
        return self._rows

    @property
    def read(self) -> int:
        return 0 if self._rows is None else len(self._rows)


def as_batches(batches) -> CalibrationBatches:
    return batches if isinstance(batches, CalibrationBatches) else CalibrationBatches(batches)


def quantize(graphdef, params: dict, qcfg: QuantConfig, batches,
             error_report: bool = True) -> tuple:
    """(quantised graphdef, quantised params (pure dict), plan, report); without error_report
    (and not auto) the report has no per-layer "layers" rows. `batches`: a sequence, a
    zero-argument callable that builds one, or CalibrationBatches; only the passes that run read
    them (see the module docstring), and report["calib_batches"] counts what they read."""
    qcfg.validate()
    check_finite(params, "parameter")
    plan = make_plan(qcfg, nnx.merge(graphdef, params))
    report: dict = {"mode": qcfg.mode, "config": qcfg.to_json()}
    batches = as_batches(batches)
    act_absmax = None
    if qcfg.smooth or qcfg.act == "static":
        stats = calibrate(graphdef, params, batches(), outlier_threshold=qcfg.outlier_threshold)
        if qcfg.smooth:
            model = nnx.merge(graphdef, params)
            alpha = site_alphas(qcfg, graphdef, params, batches(),
                                smoothing_sites(model, stats["absmax"]))
            if qcfg.alpha_search:
                report["alpha"] = alpha
            factors = fold(model, stats["absmax"], alpha)
            params = nnx.to_pure_dict(nnx.state(model))
            report["smoothing"] = {k: {"min": float(np.min(v)), "max": float(np.max(v))}
                                   for k, v in factors.items()}
            # The folded model's inputs are the old ones divided by s: calibrate again.
            stats = calibrate(graphdef, params, batches(),
                              outlier_threshold=qcfg.outlier_threshold)
        act_absmax = {p: np.max(a, axis=-1) for p, a in stats["absmax"].items()}

    def build(plan):
        return apply_plan(nnx.merge(graphdef, params), plan, qcfg, act_absmax)

    qmodel = build(plan)
    if error_report or qcfg.auto:
        stats = calibrate(graphdef, params, batches(), twins=qmodel,
                          outlier_threshold=qcfg.outlier_threshold)
        if qcfg.auto:
            plan = auto_precision.choose_float_layers(plan, stats["rel_err"], qcfg.error_budget)
            qmodel = build(plan)
        report["layers"] = auto_precision.layer_rows(plan, stats)
    report["calib_batches"] = batches.read
    qgraphdef, qstate = nnx.split(qmodel)
    # Device arrays throughout: a leaf the plan leaves alone (a norm's scale) comes back as the
    # caller gave it, and a numpy leaf is copied to the device again at every call of a step.
    qparams = jax.tree.map(jnp.asarray, nnx.to_pure_dict(qstate))
    check_finite(qparams, "quantised parameter")
    return qgraphdef, qparams, plan, report


def dense_bytes(qparams: dict, plan: dict) -> tuple[int, int]:
    """(bytes of the quantised Dense kernels incl. scales, bytes of the same kernels in fp32)."""
    q = f = 0
    for path, entry in plan.items():
        if entry["kind"] != "dense":
            continue
        node = qparams
        for key in path.split("/"):
            node = node[key]
        q += param_bytes(node)  # everything the int8 Dense stores: scales, float fallback
        f += node["kernel_q"].size * 4
    return q, f
