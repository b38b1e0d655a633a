"""Training speed of the real train step: tokens/s, model FLOP/s against this machine's matmul
peak, where the step's time goes, and (optionally) PyTorch eager on the same model.

  python -m experiments.bench_train --preset small --devices 1 --json
  python -m experiments.bench_train --preset small --devices 8 --json
  python -m experiments.bench_train --devices 1 --torch-python REFVENV/bin/python

Times the trainer's jitted step (experiments.training.trainer.prepare -> parallel/sharded_run.py),
the median of --rounds x --steps timed steps after --warmup, each step waiting for its loss. With
--torch-python (default $SHARDQ_TORCH_PYTHON), experiments/reference/torch_train_reference.py runs
under that interpreter between our rounds (ours, torch, ours, torch, ...) and the ratio of the two
medians is recorded. Writes the entry for this device count into
experiments/results/bench_train.json (--out); the other device counts' entries there are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import (
    TORCH_PYTHON_ENV,
    ConfigError,
    Parser,
    check_output_file,
    fail,
)
from experiments.reporting.results_io import results_path, write_result
from experiments.training.config import PRESETS

PROG = "experiments.bench_train"


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--devices", type=int, default=1, help="fake CPU devices (default 1)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (interleaved with torch's)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2, help="steps traced for the breakdown")
    p.add_argument("--torch-python", default=os.environ.get(TORCH_PYTHON_ENV) or None,
                   help="interpreter with torch for the eager reference (never the project's; "
                        f"default ${TORCH_PYTHON_ENV} if set, else no PyTorch side)")
    p.add_argument("--ablate", action="store_true",
                   help="instead: time the step against each optimisation undone (paired), "
                        "written to --changes-out")
    p.add_argument("--out", default=str(results_path("bench_train.json")))
    p.add_argument("--changes-out", default=str(results_path("bench_train_changes.json")))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.preset not in PRESETS:
        fail(PROG, f"preset={args.preset!r}: allowed {', '.join(PRESETS)}")
    for name in ("devices", "steps", "rounds", "profile_steps"):
        if getattr(args, name) < 1:
            fail(PROG, f"{name}={getattr(args, name)}: must be a positive integer")
    if args.warmup < 1:  # the first call compiles: it must never be timed
        fail(PROG, f"warmup={args.warmup}: must be >= 1")
    if args.torch_python is not None and not os.access(args.torch_python, os.X_OK):
        fail(PROG, f"torch_python={args.torch_python!r}: not an executable file")
    try:
        check_output_file("out", args.out)
        check_output_file("changes_out", args.changes_out)
    except ConfigError as e:
        fail(PROG, str(e))
    (train_speed,) = startup.begin("experiments.speed.training", devices=args.devices)

    base = PRESETS[args.preset]
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, devices=args.devices))
    if args.ablate:
        result = train_speed.ablate(cfg, steps=args.steps, rounds=args.rounds,
                                    warmup=args.warmup)
        _merge(Path(args.changes_out), args.devices, result,
               "python -m experiments.bench_train --ablate --devices {1,8}")
        for c in result["changes"]:
            print(f"{c['change']:16s} x{c['speedup']:.2f} wall, x{c['cpu_speedup']:.2f} CPU")
        print(json.dumps(result))
        return result
    try:
        result = train_speed.bench(cfg, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                                   profile_steps=args.profile_steps,
                                   torch_python=args.torch_python)
    except ConfigError as e:
        fail(PROG, str(e))
    _merge(Path(args.out), args.devices, result, "python -m experiments.bench_train --devices "
           "{1,8} --torch-python TORCH_PYTHON")
    if not args.json:
        torch = result.get("torch")
        print(f"{result['tokens_per_s']:,.0f} tokens/s, {result['fraction_of_peak']:.1%} of the "
              f"matmul peak" + (f", {torch['ratio']:.2f}x torch eager" if torch else ""))
    print(json.dumps(result))
    return result


def _merge(path: Path, devices: int, result: dict, command: str) -> None:
    """Write `result` as the entry for this device count; other counts' entries are kept."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    runs = {**doc.get("runs", {}), str(devices): result}
    write_result(path, {"command": command,
                        "runs": dict(sorted(runs.items(), key=lambda kv: int(kv[0])))})


if __name__ == "__main__":
    main()
