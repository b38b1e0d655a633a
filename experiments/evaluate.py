"""Evaluate a trained checkpoint on the validation split.

  python -m experiments.evaluate --workdir runs/small --json

Restores the latest (or --step) Orbax checkpoint onto the requested mesh and prints validation
loss (nats/byte) and bits per byte; with --json the last line is one JSON object with at least
val_loss, bits_per_byte, param_bytes and step.
"""

from __future__ import annotations

import argparse
import json
import math

from experiments import runtime
from experiments.config import fail
from parallel.strategies import STRATEGIES

PROG = "experiments.evaluate"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--devices", type=int, default=None, help="fake CPU devices (default 8)")
    p.add_argument("--strategy", default=None, help=f"layout to restore into: {STRATEGIES}")
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.devices is not None and args.devices < 1:
        fail(PROG, f"devices={args.devices}: must be a positive integer")
    runtime.start(args.devices)
    from experiments.restore import load_config, restore_params
    from experiments.trainer import ConfigError, make_eval_fn, param_bytes

    try:
        cfg = load_config(args.workdir)
        over = {"devices": args.devices, "mesh": None}
        if args.strategy:
            over["strategy"] = args.strategy
        if args.eval_batches:
            over["eval_batches"] = args.eval_batches
        run, params, step = restore_params(args.workdir, cfg, **over)
    except ConfigError as e:
        fail(PROG, str(e))
    val_loss = make_eval_fn(run)(params)
    out = {"step": step, "val_loss": val_loss, "bits_per_byte": val_loss / math.log(2),
           "param_bytes": param_bytes(params), "devices": run.mesh.size,
           "strategy": run.cfg.train.strategy, "eval_tokens": sum(
               r.shape[0] * (r.shape[1] - 1) for r in run.val)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"step {step}: val loss {val_loss:.4f} nats/byte, {out['bits_per_byte']:.4f} "
              f"bits/byte ({out['param_bytes']:,} parameter bytes)")
    return out


if __name__ == "__main__":
    main()
