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
import dataclasses
import json
import time

import numpy as np
from tqdm import tqdm

from experiments.cli import runtime
from experiments.cli.config import PRESETS, Parser, fail
from experiments.reporting.results_io import results_path, write_result
from experiments.training.data import SequenceSampler, load_corpus, pack
from experiments.training.optim import make_optimizer
from experiments.training.pretrained_init import truncated_model
from parallel.sharded_run import max_tree_diff, run_label
from parallel.strategies import LABELS

PROG = "experiments.equivalence"
FP32_TOLERANCE = 1e-5
PRECISIONS = ("float32", "bfloat16")


def _subset(field: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    """The comma-separated names in `value`, each one of `allowed` (bad input: exit 2)."""
    names = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad or not names or len(set(names)) != len(names):
        fail(PROG, f"{field}={value!r}: a comma-separated list of distinct names from "
                   f"{', '.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> dict:
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
    p.add_argument("--out", default=str(results_path("equivalence.json")))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1:
        fail(PROG, f"steps={args.steps}: must be a positive integer")
    if args.devices < 1 or args.devices & (args.devices - 1):
        fail(PROG, f"devices={args.devices}: must be a power of two")
    if args.preset not in PRESETS:
        fail(PROG, f"preset={args.preset!r}: allowed {', '.join(PRESETS)}")
    if args.layers < 1:
        fail(PROG, f"layers={args.layers}: must be a positive integer")
    strategies = _subset("strategies", args.strategies, LABELS) if args.strategies else \
        [s for s in LABELS if not (args.model and s == "zero3_auto")]
    precisions_kept = _subset("precisions", args.precisions, PRECISIONS) if args.precisions \
        else (["float32"] if args.model else list(PRECISIONS))
    if args.model and precisions_kept != ["float32"]:
        fail(PROG, f"precisions={args.precisions!r}: --model runs float32 only")
    allowed_counts = tuple(str(n) for n in (1, 2, 4, 8) if n <= args.devices)
    counts = [int(n) for n in _subset("device_counts", args.device_counts, allowed_counts)] \
        if args.device_counts else None
    runtime.start(args.devices)
    if args.model:
        return pretrained(args, strategies, counts or [args.devices])

    base = PRESETS[args.preset]
    train = base.train
    tx = make_optimizer(train)
    rows = pack(load_corpus(None)[0], base.model.max_len)
    sampler = SequenceSampler(rows, seed=0)
    batch = max(train.batch_size, args.devices)
    batches = [sampler.next_batch(batch).reshape(args.micro_steps, -1, rows.shape[1])
               for _ in range(args.steps)]
    meshes = [(n, None) for n in (1, 2, 4, 8) if n <= args.devices]
    if args.devices >= 8:
        meshes.append((8, "data=2,fsdp=4"))
    if counts:
        meshes = [(n, m) for n, m in meshes if n in counts]
    precisions = {"float32": base.model, "bfloat16": dataclasses.replace(
        base.model, param_dtype="bfloat16", compute_dtype="bfloat16")}
    precisions = {d: cfg for d, cfg in precisions.items() if d in precisions_kept}
    results = []
    cells = [(d, s, n, m) for d in precisions for s in strategies for n, m in meshes]
    t0 = time.perf_counter()
    refs = {d: run_label("dp", 1, batches, precisions[d], tx, seed=train.seed,
                           clip_norm=train.clip_norm) for d in precisions}
    for dtype, strategy, n, mesh in tqdm(cells, desc="equivalence"):
        ref_losses, ref_params = refs[dtype]
        losses, params = run_label(strategy, n, batches, precisions[dtype], tx, seed=train.seed,
                                   clip_norm=train.clip_norm, mesh_spec=mesh)
        results.append({"strategy": strategy, "devices": n, "mesh": mesh or f"data=1,fsdp={n}",
                        "dtype": dtype, "max_loss_diff": float(np.abs(losses - ref_losses).max()),
                        "max_param_diff": max_tree_diff(params, ref_params),
                        "final_loss": float(losses[-1])})
    fp32 = [r["max_loss_diff"] for r in results if r["dtype"] == "float32"]
    out = {"preset": args.preset, "steps": args.steps, "global_batch": batch,
           "micro_steps": args.micro_steps, "reference": "dp on 1 device, same precision",
           "fp32_tolerance": FP32_TOLERANCE,
           # None when the grid has no fp32 run: nothing to hold to the tolerance.
           "fp32_max_loss_diff": max(fp32) if fp32 else None,
           "fp32_all_within_tolerance": all(d <= FP32_TOLERANCE for d in fp32) if fp32 else None,
           "seconds": time.perf_counter() - t0, "results": results}
    write_result(args.out, out)
    if not args.json:
        for r in results:
            print(f"{r['dtype']:8s} {r['strategy']:10s} {r['mesh']:14s} "
                  f"loss diff {r['max_loss_diff']:.2e}  param diff {r['max_param_diff']:.2e}")
    print(json.dumps(out))
    return out


def pretrained(args, strategies: list[str], counts: list[int]) -> dict:
    """Each strategy on each device count against dp on one device, from pretrained weights."""
    cfg, params, rows = truncated_model("smollm2", args.layers)
    train = PRESETS["smollm2"].train
    tx = make_optimizer(train)
    sampler = SequenceSampler(rows, seed=0)
    batch = args.devices * args.micro_steps
    batches = [sampler.next_batch(batch).reshape(args.micro_steps, -1, rows.shape[1])
               for _ in range(args.steps)]
    t0 = time.perf_counter()
    ref_losses, ref_params = run_label("dp", 1, batches, cfg, tx, seed=0,
                                       clip_norm=train.clip_norm, init_params=params)
    results = []
    for strategy, n in tqdm([(s, n) for s in strategies for n in counts], desc="equivalence"):
        losses, out = run_label(strategy, n, batches, cfg, tx, seed=0,
                                clip_norm=train.clip_norm, init_params=params)
        results.append({"strategy": strategy, "devices": n,
                        "max_loss_diff": float(np.abs(losses - ref_losses).max()),
                        "max_param_diff": max_tree_diff(out, ref_params),
                        "losses": losses.tolist()})
    out = {"model": f"smollm2, first {args.layers} blocks (pretrained), fp32",
           "steps": args.steps, "global_batch": batch, "micro_steps": args.micro_steps,
           "seq_len": cfg.max_len, "reference": "dp on 1 device",
           "reference_losses": ref_losses.tolist(), "fp32_tolerance": FP32_TOLERANCE,
           "max_loss_diff": max(r["max_loss_diff"] for r in results),
           "all_within_tolerance": all(r["max_loss_diff"] <= FP32_TOLERANCE for r in results),
           "seconds": time.perf_counter() - t0, "results": results}
    if args.out == str(results_path("equivalence.json")):
        args.out = str(results_path("equivalence_smollm2.json"))
    write_result(args.out, out)
    print(json.dumps({k: v for k, v in out.items() if k != "results"}))
    return out


if __name__ == "__main__":
    main()
