"""Automatic precision per layer: keep in float the Dense layers whose int8 output error on
calibration data exceeds a budget, and say so in a per-layer report.

The error of a layer is the relative RMS error ||y_int8 - y_float|| / ||y_float|| of its output
over all calibration tokens, both computed from the same float input (so errors do not compound
through the network and each layer is judged on its own).
"""

from __future__ import annotations

import numpy as np


def over_budget(rel_err, budget: float) -> list[int]:
    """Layer indices (or [0] for an unstacked Dense) whose error exceeds the budget."""
    err = np.atleast_1d(np.asarray(rel_err, np.float64))
    return [int(i) for i in np.nonzero(~(err <= budget))[0]]  # a NaN error is over budget


def choose_float_layers(plan: dict, rel_err: dict, budget: float) -> dict:
    """A copy of the plan with `float_layers` filled from the measured errors."""
    out = {}
    for path, entry in plan.items():
        entry = dict(entry)
        if entry["kind"] == "dense" and path in rel_err:
            entry["float_layers"] = over_budget(rel_err[path], budget)
        out[path] = entry
    return out


def layer_rows(plan: dict, stats: dict) -> list[dict]:
    """One row per (module, layer): error, outlier columns (mean share, most in one batch, and
    for w8a8-outlier whether they ever exceeded the capacity), input range, precision kept."""
    rows = []
    for path, entry in plan.items():
        if entry["kind"] != "dense":
            block = entry.get("block")
            rows.append({"module": path, "layer": None, "precision": "int8",
                         "note": f"embedding rows, one scale per {block} values" if block
                         else "embedding rows, per-row scales"})
            continue
        err = np.atleast_1d(stats.get("rel_err", {}).get(path, np.nan))
        amax = np.asarray(stats["absmax"][path])
        amax = amax.max(axis=-1, keepdims=amax.ndim == 1).reshape(-1)
        outl = np.atleast_1d(stats["outlier_cols"][path])
        outl_max = np.atleast_1d(stats["outlier_cols_max"][path])
        capacity = entry.get("outlier_capacity")
        for i in range(len(amax)):
            rows.append({
                "module": path, "layer": i if len(amax) > 1 or path.startswith("blocks")
                else None,
                "rel_err": float(err[i]) if i < len(err) else None,
                "input_absmax": float(amax[i]),
                "outlier_col_fraction": float(outl[i]),
                "outlier_cols_max": int(outl_max[i]),
                # w8a8-outlier: more columns over the threshold than the float path takes
                # (the surplus was multiplied in int8 on some calibration batch).
                **({"outlier_capacity": capacity,
                    "over_capacity": bool(outl_max[i] > capacity)} if capacity else {}),
                "act": entry["act"],
                "precision": "float" if i in entry["float_layers"] else "int8"})
    return rows
