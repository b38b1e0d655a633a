"""Quantise a trained run to int8 and write the checkpoint and a per-layer error report.

  python -m experiments.quantize --workdir runs/main --mode w8a8
  python -m experiments.quantize --workdir runs/main --mode smoothquant --alpha 0.5
  python -m experiments.quantize --workdir runs/main --mode auto --error-budget 0.02

Writes WORKDIR/quant/MODE/ckpt (Orbax: int8 kernels, float32 scales, JSON metadata) and
WORKDIR/quant/MODE/report.json; the last stdout line is a JSON summary. Calibration uses the
first --calib-batches batches of the run's *training* sampler from position 0 (pinned: the same
batches every time). Modes: w8, w8a8-tensor, w8a8, w8a8-static, smoothquant, w8a8-outlier, auto.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

from experiments import runtime
from experiments.config import fail

PROG = "experiments.quantize"
MODES = ("w8", "w8a8-tensor", "w8a8", "w8a8-static", "smoothquant", "w8a8-outlier", "auto")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--mode", required=True, help=f"one of {', '.join(MODES)}")
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    p.add_argument("--weights", default="channel", help="weight scales: channel | tensor")
    p.add_argument("--clip-search", action="store_true",
                   help="search the weight clipping ratio that minimises the squared error")
    p.add_argument("--outlier-threshold", type=float, default=6.0,
                   help="w8a8-outlier: |x| at or above which an input column is multiplied in "
                        "float")
    p.add_argument("--outlier-capacity", type=float, default=0.0625,
                   help="w8a8-outlier: largest share of a layer's input columns that may take "
                        "the float path (static shapes need a cap)")
    p.add_argument("--error-budget", type=float, default=0.02,
                   help="auto: relative output error above which a layer stays float")
    p.add_argument("--include", default="blocks/*",
                   help="comma-separated path rules of modules to quantise, e.g. "
                        "'blocks/*,head,embed' (default: every Dense of the blocks)")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--devices", type=int, default=None)
    return p


def quant_config(args: argparse.Namespace):
    from quant.convert import QuantConfig

    return QuantConfig(mode=args.mode, weights=args.weights, clip_search=args.clip_search,
                       alpha=args.alpha, outlier_threshold=args.outlier_threshold,
                       outlier_capacity=args.outlier_capacity,
                       error_budget=args.error_budget, calib_batches=args.calib_batches,
                       rules=tuple(r.strip() for r in args.include.split(",") if r.strip()))


def calibration_batches(run, n: int) -> tuple[list, dict]:
    """The first n training batches from a fresh sampler (same run seed): pinned, reproducible."""
    sampler = dataclasses.replace(run.sampler, position=0)
    batch = run.cfg.train.batch_size // run.cfg.train.micro_steps
    rows = [sampler.next_batch(batch) for _ in range(n)]
    return rows, {"source": "train split", "sampler_seed": sampler.seed, "start_position": 0,
                  "batches": n, "batch_size": batch, "seq_len": int(rows[0].shape[1] - 1)}


def quantize_run(run, params, qcfg, meta_extra: dict | None = None):
    """(graphdef, qparams, plan, report, meta) for a restored run (nothing written)."""
    import jax

    from quant.pipeline import quantize

    batches, calib = calibration_batches(run, qcfg.calib_batches)
    graphdef, qparams, plan, report = quantize(run.graphdef, jax.device_get(params), qcfg,
                                               batches)
    report["calibration"] = calib
    meta = {"quant_config": qcfg.to_json(), "plan": plan,
            "model": dataclasses.asdict(run.cfg.model), "calibration": calib,
            **(meta_extra or {})}
    return graphdef, qparams, plan, report, meta


def load_or_quantize(workdir, run, params, mode: str, step: int | None = None):
    """(run with the int8 graphdef, int8 params, quantized_fraction, source) for evaluation.

    Reads WORKDIR/quant/MODE when `experiments.quantize` wrote it (onto the run's mesh, sharded
    if the run's strategy shards parameters); otherwise quantises in memory with the defaults.
    Raises ConfigError (one-line message) on a checkpoint that does not fit the run.
    """
    from experiments.trainer import ConfigError
    from parallel.strategies import Strategy
    from quant import checkpoint as qckpt
    from quant.convert import QuantConfig, QuantError, quantized_fraction

    path = qckpt.quant_dir(workdir, mode)
    try:
        if (path / "ckpt").is_dir():
            sharded = Strategy(run.cfg.train.strategy).shards_params
            graphdef, qparams, meta = qckpt.load(path, run.cfg.model, run.mesh, sharded)
            written = meta["quant_config"].get("mode")
            if written != mode:  # a folder renamed or copied by hand
                raise QuantError(f"{str(path)!r}: holds a {written!r} checkpoint, not {mode!r}; "
                                 f"run experiments.quantize --mode {mode}")
            if step is not None and meta.get("source_step") != step:
                raise QuantError(f"{str(path)!r}: quantised from step {meta.get('source_step')}, "
                                 f"not step {step}; run experiments.quantize again")
            plan, source = meta["plan"], "checkpoint"
        else:
            graphdef, qparams, plan, _, _ = quantize_run(run, params, QuantConfig(mode=mode))
            source = "in-memory"
    except QuantError as e:
        raise ConfigError(str(e)) from None
    return (dataclasses.replace(run, graphdef=graphdef), qparams,
            quantized_fraction(params, plan), source)


def write_checkpoint(out, qparams: dict, meta: dict, report: dict):
    """Write checkpoint + report next to `out`, then move them in place in one rename."""
    from quant import checkpoint as qckpt

    tmp = out.with_name(out.name + ".writing")
    shutil.rmtree(tmp, ignore_errors=True)
    qckpt.save(tmp, qparams, meta)
    (tmp / "report.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # the finished checkpoint appears at once, or not at all
    return out


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.mode not in MODES:
        fail(PROG, f"mode={args.mode!r}: allowed {', '.join(MODES)}")
    runtime.start(args.devices)
    from experiments.restore import load_config, restore_params
    from experiments.trainer import ConfigError
    from quant import checkpoint as qckpt
    from quant.convert import QuantError, quantized_fraction
    from quant.pipeline import dense_bytes, param_bytes

    try:
        qcfg = quant_config(args)
        qcfg.validate()
        cfg = load_config(args.workdir)
        run, params, step = restore_params(args.workdir, cfg, args.step, devices=args.devices,
                                           mesh=None)
        _, qparams, plan, report, meta = quantize_run(run, params, qcfg, {"source_step": step})
    except (ConfigError, QuantError) as e:
        fail(PROG, str(e))
    out = write_checkpoint(qckpt.quant_dir(args.workdir, args.mode), qparams, meta, report)
    over = [r for r in report["layers"] if r.get("over_capacity")]
    for r in over:  # correct either way; the surplus columns just went through int8
        print(f"{PROG}: warning: {r['module']} layer {r['layer']}: {r['outlier_cols_max']} input "
              f"columns reached the outlier threshold in a calibration batch, the float path "
              f"takes {r['outlier_capacity']}; raise --outlier-capacity to take them all",
              file=sys.stderr)
    q_bytes, f_bytes = dense_bytes(qparams, plan)
    summary = {"mode": args.mode, "path": str(out), "source_step": step,
               "param_bytes": param_bytes(qparams), "float_param_bytes": param_bytes(params),
               "quantized_fraction": quantized_fraction(params, plan),
               "dense_bytes_ratio": q_bytes / f_bytes, "disk_bytes": qckpt.disk_bytes(out / "ckpt"),
               "float_layers": {p: e["float_layers"] for p, e in plan.items()
                                if e.get("float_layers")},
               "max_rel_err": max((r["rel_err"] for r in report["layers"]
                                   if r.get("rel_err") is not None), default=None)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
