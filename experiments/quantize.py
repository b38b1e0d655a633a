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
import json
import sys

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_devices, fail
from experiments.cli.flags import add_field_flags, field_overrides
from experiments.training.config import load_config
from quant.modes import MODES, QuantConfig, QuantError

PROG = "experiments.quantize"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--devices", type=int, default=None)
    add_field_flags(p, QuantConfig, title="quantisation (default: QuantConfig's value)",
                    aliases={"rules": "--include"})
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.override_mode is None:
        fail(PROG, f"mode: required; allowed {', '.join(MODES)}")
    if args.devices is not None:  # runtime.start checks it too, after JAX is imported
        try:
            check_devices(args.devices)
        except ConfigError as e:
            fail(PROG, str(e))
    try:
        qcfg = QuantConfig(**field_overrides(args, QuantConfig))
        qcfg.validate()
        cfg = load_config(args.workdir)
    except (ConfigError, QuantError) as e:
        fail(PROG, str(e))
    # JAX starts here, after the flags and the work dir's config are checked.
    restore, qckpt, convert, pipeline, stored = startup.begin(
        "experiments.training.restore", "quant.checkpoint", "quant.convert", "quant.pipeline",
        "quant.stored", devices=args.devices)
    try:
        model = restore.restore_params(args.workdir, cfg, step=args.step, devices=args.devices)
        batches, calibration = restore.calibration_rows(model.cfg, qcfg.calib_batches)
        _, qparams, plan, report, meta = stored.quantize_with_meta(
            model.graphdef, model.params, qcfg, batches, model.cfg.model, calibration,
            {"source_step": model.step})
    except (ConfigError, QuantError) as e:
        fail(PROG, str(e))
    step = model.step
    out = stored.save_atomic(qckpt.quant_dir(args.workdir, qcfg.mode), qparams, meta, report)
    over = [r for r in report["layers"] if r.get("over_capacity")]
    for r in over:  # correct either way; the surplus columns just went through int8
        print(f"{PROG}: warning: {r['module']} layer {r['layer']}: {r['outlier_cols_max']} input "
              f"columns reached the outlier threshold in a calibration batch, the float path "
              f"takes {r['outlier_capacity']}; raise --outlier-capacity to take them all",
              file=sys.stderr)
    q_bytes, f_bytes = pipeline.dense_bytes(qparams, plan)
    summary = {"mode": qcfg.mode, "path": str(out), "source_step": step,
               "param_bytes": pipeline.param_bytes(qparams),
               "float_param_bytes": pipeline.param_bytes(model.params),
               "quantized_fraction": convert.quantized_fraction(model.params, plan),
               "dense_bytes_ratio": q_bytes / f_bytes, "disk_bytes": qckpt.disk_bytes(out / "ckpt"),
               "float_layers": {p: e["float_layers"] for p, e in plan.items()
                                if e.get("float_layers")},
               "max_rel_err": max((r["rel_err"] for r in report["layers"]
                                   if r.get("rel_err") is not None), default=None)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
