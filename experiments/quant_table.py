"""Every int8 mode on one trained run: validation loss, bits/byte, bytes in memory and on disk.

  python -m experiments.quant_table --workdir runs/main

Quantises the run in each mode (writing WORKDIR/quant/MODE like `experiments.quantize`),
evaluates it on the run's validation batches (the loss, and how far its next-token
distributions lie from the float model's: mean KL(float || int8) and the share of positions
with the same most likely byte, `experiments/pretrained/divergence.py`), and writes the table to
experiments/results/quant_eval.json (one row per mode, the float model first). Besides the
modes, four variants: naive per-tensor W8A8 (per-tensor weights *and* activations), w8a8 with
the embedding and output head quantised too (the smallest checkpoint), the outlier split with
room for a quarter of the input columns in float, and smoothquant with the paper's one alpha
(0.5) at every site instead of the alpha chosen per layer and site.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, fail
from experiments.reporting.results_io import project_relative, results_path, write_result
from experiments.training import lineage
from experiments.training.config import load_config
from experiments.training.loss_names import loss_measures
from quant.modes import MODES, PAPER_ALPHA, QuantConfig, QuantError

PROG = "experiments.quant_table"
OUT = results_path("quant_eval.json")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--alpha", type=float, default=None,
                   help="SmoothQuant's migration strength at every site (default: chosen per "
                        "layer and site, quant/alpha_search.py)")
    p.add_argument("--modes", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--out", default=str(OUT))
    return p


def variants(modes: str | None = None) -> list[tuple[str, str, dict]]:
    """(row name, mode, QuantConfig overrides) of each row, or of those named in `modes`
    (comma-separated)."""

    rows = [(m, m, {}) for m in MODES]
    rows += [("w8a8-tensor-naive", "w8a8-tensor", {"weights": "tensor"}),
             ("w8a8+head+embed", "w8a8", {"rules": ("blocks/*", "head", "embed")}),
             # room for every column over the threshold where the default capacity is short
             # (small's last MLP input)
             ("w8a8-outlier-cap0.25", "w8a8-outlier", {"outlier_capacity": 0.25}),
             # the paper's recipe beside the searched default
             (f"smoothquant-alpha{PAPER_ALPHA:g}", "smoothquant", {"alpha": PAPER_ALPHA})]
    if modes:
        keep = set(modes.split(","))
        rows = [r for r in rows if r[0] in keep]
    return rows


def most_outlier_cols(layer_rows: list[dict]) -> dict[str, int]:
    """{module: the most input columns over the outlier threshold in one batch, any layer}."""
    most: dict[str, int] = {}
    for r in layer_rows:
        if "outlier_cols_max" in r:
            most[r["module"]] = max(most.get(r["module"], 0), r["outlier_cols_max"])
    return most


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:  # before the backend starts
        QuantConfig(mode="smoothquant", alpha=args.alpha,
                    calib_batches=args.calib_batches).validate()
        # bits per byte where the run's tokens are bytes, perplexity where they are not
        byte_tokens = lineage.origin(load_config(args.workdir).train.init).byte_tokens
    except (QuantError, ConfigError) as e:
        fail(PROG, str(e))
    jax, divergence, restore, trainer, qckpt, convert, pipeline, stored = startup.begin(
        "jax", "experiments.pretrained.divergence", "experiments.training.restore",
        "experiments.training.trainer", "quant.checkpoint", "quant.convert", "quant.pipeline",
        "quant.stored", devices=None)
    try:
        model = restore.restore_params(args.workdir)
        val = restore.validation_rows(model.cfg)
        calib_rows, calibration = restore.calibration_rows(model.cfg, args.calib_batches)
    except ConfigError as e:
        fail(PROG, str(e))
    cfg, step = model.cfg, model.step
    params = jax.device_get(model.params)
    float_loss = trainer.make_eval_fn(model.graphdef, model.mesh, val)(params)
    with tempfile.TemporaryDirectory() as tmp:
        float_disk = qckpt.save_float_reference(Path(tmp) / "float", params)
    rows = [{"mode": "none", "val_loss": float_loss,
             **loss_measures(float_loss, byte_tokens, prefix=""),
             "rel_to_float": 0.0, "param_bytes": pipeline.param_bytes(params),
             "quantized_fraction": 0.0, "disk_bytes": float_disk}]
    for name, mode, over in variants(args.modes):
        t0 = time.perf_counter()
        alpha = {"alpha": args.alpha} if QuantConfig(mode=mode).smooth else {}
        qcfg = QuantConfig(**{"mode": mode, "calib_batches": args.calib_batches, **alpha,
                              **over})
        try:
            graphdef, qparams, plan, report, meta = stored.quantize_with_meta(
                model.graphdef, params, qcfg, calib_rows, cfg.model, calibration,
                {"source_step": step})
        except QuantError as e:
            fail(PROG, str(e))
        out = stored.save_atomic(qckpt.quant_dir(args.workdir, name), qparams, meta, report)
        quant_s = time.perf_counter() - t0
        loss = trainer.make_eval_fn(graphdef, model.mesh, val)(qparams)
        diverged = divergence.make_batch_divergence_fn(graphdef, model.graphdef, model.mesh,
                                                       val)(qparams, params)
        qb, fb = pipeline.dense_bytes(qparams, plan)
        disk = qckpt.disk_bytes(out / "ckpt")
        rows.append({"mode": name, "quant_mode": mode, "val_loss": loss,
                     **loss_measures(loss, byte_tokens, prefix=""),
                     "rel_to_float": (loss - float_loss) / float_loss, "divergence": diverged,
                     "param_bytes": pipeline.param_bytes(qparams),
                     "quantized_fraction": convert.quantized_fraction(params, plan),
                     "dense_bytes_ratio": qb / fb, "disk_bytes": disk,
                     "disk_ratio_vs_fp32": float_disk / disk,
                     "float_layers": sum(len(e.get("float_layers", [])) for e in plan.values()),
                     "max_layer_rel_err": max(r["rel_err"] for r in report["layers"]
                                              if r.get("rel_err") is not None),
                     # the most input columns at or over the outlier threshold in one batch, and
                     # the layers where that exceeded the outlier split's capacity
                     "max_outlier_cols": most_outlier_cols(report["layers"]),
                     "over_capacity": [f"{r['module']}/{r['layer']}" for r in report["layers"]
                                       if r.get("over_capacity")],
                     "quantize_seconds": quant_s})
        if qcfg.smooth:  # per site one alpha per layer when searched
            rows[-1]["alpha"] = report.get("alpha", qcfg.alpha)
        print(json.dumps(rows[-1]), flush=True)
    table = {"workdir": project_relative(args.workdir), "step": step,
             "preset": cfg.preset, "calib_batches": args.calib_batches, "alpha": args.alpha,
             "eval_tokens": sum(r.shape[0] * (r.shape[1] - 1) for r in val),
             "backend": jax.default_backend(), "rows": rows}
    write_result(args.out, table)
    print(json.dumps({"written": args.out, "modes": len(rows)}))
    return table


if __name__ == "__main__":
    main()
