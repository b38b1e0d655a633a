"""Every strategy and mesh against a single-device run: same global batch, same seed.

  python -m experiments.equivalence --devices 8 --steps 20 --json

For each strategy (dp, zero1, zero2, zero3, zero3_prefetch, zero3_auto), each device count
1, 2, 4, 8 and a 2x4 (data x fsdp) hybrid mesh, in fp32 and in mixed precision (bf16 working
params and compute, fp32 master weights), reports the largest per-step loss difference and the
largest final-parameter difference against the single-device dp run of the same precision.
Batches are real text from the default corpus. Writes experiments/results/equivalence.json
(--out) and prints its JSON last. --strategies, --device-counts and --precisions pick a part
of the grid (the quick reproduction: every strategy on 2 devices in fp32); with --model
smollm2-truncated the first --layers blocks of the pretrained SmolLM2 run every strategy but
zero3_auto on --devices devices in fp32 (--strategies and --device-counts pick a part there too).
"""

from __future__ import annotations

import argparse
import json

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.reporting.results_io import results_path, write_result
from experiments.training.config import PRESETS
from parallel.strategies import LABELS

PROG = "experiments.equivalence"
PRECISIONS = ("float32", "bfloat16")  # the keys of strategy_equivalence.grid's models
DEFAULT_OUT = str(results_path("equivalence.json"))


def _subset(field: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    """The comma-separated names in `value`, each one of `allowed` (bad input: exit 2)."""
    names = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad or not names or len(set(names)) != len(names):
        fail(PROG, f"{field}={value!r}: a comma-separated list of distinct names from "
                   f"{', '.join(allowed)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (largest mesh)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-steps", type=int, default=2, help="gradient accumulation")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model", default=None, choices=("smollm2-truncated",),
                   help="instead of a preset: SmolLM2's first --layers blocks from its "
                        "pretrained weights, fp32, 8 devices against 1 (results: "
                        "equivalence_smollm2.json)")
    p.add_argument("--layers", type=int, default=2, help="blocks kept with --model")
    p.add_argument("--strategies", default=None,
                   help="comma-separated subset of the strategies (default: all; with --model "
                        "all but zero3_auto)")
    p.add_argument("--device-counts", default=None,
                   help="comma-separated device counts (powers of two up to --devices; "
                        "default: all of them, and the 2x4 hybrid mesh with 8)")
    p.add_argument("--precisions", default=None,
                   help="comma-separated subset of float32,bfloat16 (default: both; with "
                        "--model float32 only)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--json", action="store_true")
    return p


def _check(args: argparse.Namespace) -> tuple[list[str], list[str], list[int] | None]:
    """The flags checked (bad input: exit 2): the strategies, precisions and device counts."""
    if args.steps < 1:
        fail(PROG, f"steps={args.steps}: must be a positive integer")
    if args.devices < 1 or args.devices & (args.devices - 1):
        fail(PROG, f"devices={args.devices}: must be a power of two")
    if args.preset not in PRESETS:
        fail(PROG, f"preset={args.preset!r}: allowed {', '.join(PRESETS)}")
    if args.layers < 1:
        fail(PROG, f"layers={args.layers}: must be a positive integer")
    if args.micro_steps < 1:
        fail(PROG, f"micro_steps={args.micro_steps}: must be a positive integer")
    try:
        check_output_file("out", args.out)
    except ConfigError as e:
        fail(PROG, str(e))
    strategies = _subset("strategies", args.strategies, LABELS) if args.strategies else \
        [s for s in LABELS if not (args.model and s == "zero3_auto")]
    precisions = _subset("precisions", args.precisions, PRECISIONS) if args.precisions \
        else (["float32"] if args.model else list(PRECISIONS))
    if args.model and precisions != ["float32"]:
        fail(PROG, f"precisions={args.precisions!r}: --model runs float32 only")
    allowed_counts = tuple(str(n) for n in (1, 2, 4, 8) if n <= args.devices)
    counts = [int(n) for n in _subset("device_counts", args.device_counts, allowed_counts)] \
        if args.device_counts else None
    return strategies, precisions, counts


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    strategies, precisions, counts = _check(args)
    (equivalence,) = startup.begin("experiments.training.strategy_equivalence",
                                   devices=args.devices)
    if args.model:
        out = equivalence.pretrained(layers=args.layers, steps=args.steps,
                                     micro_steps=args.micro_steps, devices=args.devices,
                                     strategies=strategies, counts=counts or [args.devices])
        path = (str(results_path("equivalence_smollm2.json")) if args.out == DEFAULT_OUT
                else args.out)
        write_result(path, out)
        print(json.dumps({k: v for k, v in out.items() if k != "results"}))
        return out
    out = equivalence.grid(PRESETS[args.preset], steps=args.steps, micro_steps=args.micro_steps,
                           devices=args.devices, strategies=strategies, counts=counts,
                           precisions=precisions)
    write_result(args.out, out)
    if not args.json:
        for r in out["results"]:
            print(f"{r['dtype']:8s} {r['strategy']:10s} {r['mesh']:14s} "
                  f"loss diff {r['max_loss_diff']:.2e}  param diff {r['max_param_diff']:.2e}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
