"""Train a language model on a (fake or real) device mesh.

  python -m experiments.train --workdir runs/small --preset small --steps 1500 --devices 8

Writes WORKDIR/config.json, WORKDIR/metrics.jsonl (one JSON object per logged step) and Orbax
checkpoints under WORKDIR/checkpoints/. Prints a JSON summary on its last line.
"""

from __future__ import annotations

import argparse
import json

from experiments.config import (
    PRESETS,
    ConfigError,
    Parser,
    add_override_flags,
    check_output_folder,
    config_from_args,
    fail,
)

PROG = "experiments.train"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="where config, metrics and checkpoints go")
    p.add_argument("--preset", default="small", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--resume", action="store_true", help="continue the run in WORKDIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_override_flags(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        check_output_folder("workdir", args.workdir, "the run")
    except ConfigError as e:
        fail(PROG, str(e))
    # JAX starts here, after the flags are checked: a refused flag never waits for it.
    import jax

    from experiments import runtime
    from experiments.guards import RunStopped
    from experiments.trainer import train_and_evaluate

    runtime.start(cfg.train.devices, cfg.model)

    try:
        summary = train_and_evaluate(cfg, args.workdir, resume=args.resume,
                                     progress=not args.no_progress)
    except ConfigError as e:
        fail(PROG, str(e))
    except RunStopped as e:  # a non-finite step, a checkpoint that could not be written
        fail(PROG, str(e), code=1)

    if jax.process_index() == 0:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
