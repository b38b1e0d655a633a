"""The main job: train `small` on 8 fake CPU devices, checkpoint, reload, evaluate, summarise.

  python -m experiments.main_job                 # -> runs/main-<time>/
  python -m experiments.main_job --workdir DIR   # any other preset/override flags of train work too

Budget on a 2-core CPU: the whole job (training, checkpoint, reload, evaluation) within 10
minutes, reaching validation bits-per-byte <= 2.5 on the default corpus. Writes WORKDIR/summary.json
and WORKDIR/summary.png (loss curve) next to the run's config.json and metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import (
    ConfigError,
    Parser,
    check_output_file,
    check_output_folder,
    fail,
)
from experiments.cli.flags import add_override_flags, config_from_args

PROG = "experiments.main_job"
TARGET_BITS_PER_BYTE = 2.5
BUDGET_S = 600


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None)
    p.add_argument("--preset", default="small")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--record", default=None,
                   help="also write the summary (and loss plot) here, e.g. "
                        "experiments/results/main_job.json for the README")
    add_override_flags(p)
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.workdir is not None:
            check_output_folder("workdir", args.workdir, "the run")
        if args.record is not None:
            check_output_file("record", args.record)
    except ValueError as e:
        fail(PROG, str(e))
    workdir = Path(args.workdir or f"runs/main-{time.strftime('%Y%m%d-%H%M%S')}")
    jax, guards, restore, trainer, flops, run_summary = startup.begin(
        "jax", "experiments.training.guards", "experiments.training.restore",
        "experiments.training.trainer", "model.flops", "experiments.training.run_summary",
        devices=cfg.train.devices, model=cfg.model)
    t0 = time.perf_counter()

    try:
        trained = trainer.train_and_evaluate(cfg, workdir, progress=not args.no_progress)
    except ConfigError as e:
        fail(PROG, str(e))
    except guards.RunStopped as e:  # a non-finite step, a checkpoint that could not be written
        fail(PROG, str(e), code=1)
    t_train = time.perf_counter()
    # Reload from the Orbax checkpoint in a fresh layout and evaluate what was *stored*.
    model = restore.restore_params(workdir, cfg)
    params, step = model.params, model.step
    val_loss = trainer.make_eval_fn(model.graphdef, model.mesh,
                                    restore.validation_rows(cfg))(params)
    t_end = time.perf_counter()
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]  # first includes compile
    summary = {
        "preset": cfg.preset, "devices": jax.device_count(), "strategy": cfg.train.strategy,
        "params": trained["params"], "param_bytes": flops.param_bytes(params), "step": step,
        "val_loss": val_loss, "bits_per_byte": val_loss / 0.6931471805599453,
        "train_val_loss": trained["val_loss"],
        "train_s": t_train - t0, "reload_eval_s": t_end - t_train, "job_s": t_end - t0,
        "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
        "target_bits_per_byte": TARGET_BITS_PER_BYTE, "budget_s": BUDGET_S,
        "met_target": val_loss / 0.6931471805599453 <= TARGET_BITS_PER_BYTE
        and t_end - t0 <= BUDGET_S,
        "backend": jax.default_backend(),
    }
    title = f"{cfg.preset}: {summary['bits_per_byte']:.3f} bits/byte in {summary['job_s']:.0f} s"
    run_summary.write_summary(workdir, summary, title,
                              also=(args.record,) if args.record else ())
    print(f"\nmain job: {cfg.preset} ({summary['params']:,} params) on {summary['devices']} "
          f"devices, {step} steps\n  validation {summary['bits_per_byte']:.3f} bits/byte "
          f"(target <= {TARGET_BITS_PER_BYTE}) after reload from the Orbax checkpoint\n"
          f"  job time {summary['job_s']:.0f} s (train {summary['train_s']:.0f} s, reload + "
          f"evaluate {summary['reload_eval_s']:.1f} s; budget {BUDGET_S} s)\n"
          f"  wrote {workdir}/summary.json, summary.png, metrics.jsonl")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
