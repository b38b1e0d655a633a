"""Step time and per-device memory of each strategy on one mesh, measured in one run.

  python -m experiments.bench_strategies --preset small --devices 8 --json

Times the real jitted training step (after compilation, median of --steps timed steps, strategies
interleaved round-robin so machine noise hits them alike) and reads each compiled step's memory
analysis. Reports ratios to dp; the target is zero3 within 1.15x of dp's step time. Writes
experiments/results/strategy_speed.json (--out). Runs unchanged on a GPU/TPU host (omit --devices).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from tqdm import tqdm

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_devices, check_output_file, fail
from experiments.reporting.results_io import results_path, write_result
from experiments.training.config import PRESETS
from parallel.strategies import LABELS, from_label

PROG = "experiments.bench_strategies"


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--devices", type=int, default=None, help="fake CPU devices (default 8)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per strategy")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--strategies", default="dp,zero1,zero2,zero3,zero3_prefetch,zero3_auto",
                   help="zero3_prefetch = zero3 with the next layer's gather issued early")
    p.add_argument("--out", default=str(results_path("strategy_speed.json")))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.preset not in PRESETS:
        fail(PROG, f"preset={args.preset!r}: allowed {', '.join(PRESETS)}")
    if args.steps < 1:
        fail(PROG, f"steps={args.steps}: must be a positive integer")
    if args.warmup < 0:
        fail(PROG, f"warmup={args.warmup}: must be a non-negative integer")
    names = args.strategies.split(",")
    for n in names:
        if n not in LABELS:
            fail(PROG, f"strategies: {n!r} is not one of {', '.join(LABELS)}")
    try:
        if args.devices is not None:
            check_devices(args.devices)
        check_output_file("out", args.out)
    except ConfigError as e:
        fail(PROG, str(e))
    jax, trainer = startup.begin("jax", "experiments.training.trainer", devices=args.devices)
    base = PRESETS[args.preset]
    runs, states = {}, {}
    for name in names:
        strategy = from_label(name)
        cfg = dataclasses.replace(base, train=dataclasses.replace(
            base.train, strategy=strategy.name, devices=args.devices, prefetch=strategy.prefetch))
        run = trainer.prepare(cfg)
        runs[name], states[name] = run, trainer.init_sharded_state(run)
    batch = trainer.global_batch(runs[names[0]], runs[names[0]].sampler.next_batch)
    memory = {}
    for name in names:
        compiled = runs[name].step_fn.lower(states[name], batch).compile()
        m = compiled.memory_analysis()
        memory[name] = {"argument_bytes": m.argument_size_in_bytes,
                        "temp_bytes": m.temp_size_in_bytes,
                        "peak_bytes": m.argument_size_in_bytes + m.output_size_in_bytes
                        + m.temp_size_in_bytes - m.alias_size_in_bytes}
    times = {n: [] for n in names}
    for i in tqdm(range(args.warmup + args.steps), desc="steps (all strategies)"):
        for name in names:  # round-robin: noise lands on every strategy alike
            t = time.perf_counter()
            states[name], metrics = runs[name].step_fn(states[name], batch)
            jax.block_until_ready(metrics["loss"])
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    dp = statistics.median(times["dp"]) if "dp" in times else None
    results = []
    for name in names:
        med = statistics.median(times[name])
        results.append({"strategy": name, "median_step_s": med,
                        "min_step_s": min(times[name]),
                        "ratio_to_dp": med / dp if dp else None,
                        "tokens_per_s": base.train.batch_size * base.model.max_len / med,
                        **memory[name]})
    out = {"preset": args.preset, "devices": jax.device_count(),
           "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
           "steps": args.steps, "target": "zero3 median step <= 1.15x dp",
           "zero3_ratio": next((r["ratio_to_dp"] for r in results if r["strategy"] == "zero3"),
                               None), "results": results}
    write_result(args.out, out)
    if not args.json:
        for r in results:
            print(f"{r['strategy']:10s} {r['median_step_s'] * 1e3:8.1f} ms/step "
                  f"x{r['ratio_to_dp']:.2f}  peak {r['peak_bytes'] / 1e6:.1f} MB/device")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
