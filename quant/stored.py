"""A trained model's int8 form, stored or made on demand: what the evaluate, sample and
quantize commands share.

`quantize_with_meta` quantises float parameters on given calibration batches and returns what
the int8 checkpoint stores beside them; `save_atomic` writes that checkpoint so it appears whole
or not at all; `load_or_quantize` reads the checkpoint a mode wrote, or quantises in memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
from jax.sharding import Mesh

from model import ModelConfig
from quant import checkpoint as qckpt
from quant.convert import QuantConfig, QuantError, quantized_fraction
from quant.pipeline import quantize


def quantize_with_meta(graphdef, params: dict, qcfg: QuantConfig, batches: list,
                       model_cfg: ModelConfig, calibration: dict,
                       meta_extra: dict | None = None) -> tuple:
    """(int8 graphdef, int8 params, plan, report, checkpoint metadata); nothing is written.
    `calibration` describes where the batches came from (stored for reproducibility)."""
    graphdef, qparams, plan, report = quantize(graphdef, jax.device_get(params), qcfg, batches)
    report["calibration"] = calibration
    meta = {"quant_config": qcfg.to_json(), "plan": plan, "model": dataclasses.asdict(model_cfg),
            "calibration": calibration, **(meta_extra or {})}
    return graphdef, qparams, plan, report, meta


def is_stored(path: str | Path) -> bool:
    """Whether `path` holds what `save_atomic` writes (the only non-empty folder it should be
    asked to replace: callers that take the folder from a user check this first)."""
    return (Path(path) / "ckpt").is_dir() and (Path(path) / "report.json").is_file()


def save_atomic(out: Path, qparams: dict, meta: dict, report: dict) -> Path:
    """Write checkpoint + report next to `out`, then move them in place in one rename."""
    tmp = out.with_name(out.name + ".writing")
    shutil.rmtree(tmp, ignore_errors=True)
    qckpt.save(tmp, qparams, meta)
    (tmp / "report.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # the finished checkpoint appears at once, or not at all
    return out


def load_or_quantize(workdir, mode: str, model_cfg: ModelConfig, graphdef, params: dict, *,
                     mesh: Mesh | None, sharded: bool, step: int | None,
                     calibration: Callable[[int], tuple[list, dict]]):
    """(int8 graphdef, int8 params, quantized_fraction, source) for evaluation or sampling.

    Reads WORKDIR/quant/MODE when `experiments.quantize` wrote it (onto `mesh`, sharded or
    replicated); otherwise quantises in memory with the mode's defaults, calibrating on
    `calibration(n) -> (batches, description)`. QuantError (one line) on a checkpoint that
    does not fit the model or the step.
    """
    path = qckpt.quant_dir(workdir, mode)
    if (path / "ckpt").is_dir():
        qgraphdef, qparams, meta = qckpt.load(path, model_cfg, mesh, sharded)
        written = meta["quant_config"].get("mode")
        if written != mode:  # a folder renamed or copied by hand
            raise QuantError(f"{str(path)!r}: holds a {written!r} checkpoint, not {mode!r}; "
                             f"run experiments.quantize --mode {mode}")
        if step is not None and meta.get("source_step") != step:
            raise QuantError(f"{str(path)!r}: quantised from step {meta.get('source_step')}, "
                             f"not step {step}; run experiments.quantize again")
        return qgraphdef, qparams, quantized_fraction(params, meta["plan"]), "checkpoint"
    qcfg = QuantConfig(mode=mode)
    batches, calib = calibration(qcfg.calib_batches)
    qgraphdef, qparams, plan, _, _ = quantize_with_meta(graphdef, params, qcfg, batches, model_cfg,
                                                        calib)
    return qgraphdef, qparams, quantized_fraction(params, plan), "in-memory"
