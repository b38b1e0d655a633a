"""How close is the planner's compiled peak to the peak a real step reaches?

  python -m experiments.plan_accuracy --json [--quick] [--out FILE]

For each configuration (a `d_model` 384, 4-layer shape on 8 fake CPU devices, every strategy
the planner considers, remat none and full, bf16 mixed precision and two float32 rows) a fresh
process compiles the step the way the planner does, then allocates the state and runs one
step, reading the executed peak from its resident set (XLA:CPU keeps no memory statistics;
experiments/zero/peak_check.py says how the resident set is read). Error = planner peak / executed
peak - 1; the goal is |error| <= 10% for every row. Each row also records the peak of the
executable that ran (default compiler options), which the planner's faster code-generation
options must not change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.reporting.results_io import results_path, write_result

PROG = "experiments.plan_accuracy"
DEFAULT_OUT = str(results_path("plan_accuracy.json"))
GOAL = 0.10


def configs(quick: bool):
    (peak_check,) = startup.load("experiments.zero.peak_check")
    CheckConfig = peak_check.CheckConfig
    rows = [CheckConfig(s, r) for s in ("dp", "zero1", "zero2", "zero3")
            for r in ("none", "full")]
    rows += [CheckConfig("zero3_prefetch", "full"), CheckConfig("dp", "none", dtype="float32"),
             CheckConfig("zero3", "none", dtype="float32")]
    if quick:
        rows = [CheckConfig("zero3", "full", d_model=192, n_heads=3, d_ff=768),
                CheckConfig("zero2", "none", d_model=192, n_heads=3, d_ff=768)]
    return rows


def worker(spec: str) -> None:
    """One configuration in this (fresh) process; prints its JSON row (for {"baseline": N}:
    the runtime's own first-run cost on N devices)."""
    (peak_check,) = startup.load("experiments.zero.peak_check")
    spec = json.loads(spec)
    if "baseline" in spec:
        startup.begin(devices=spec["baseline"])
        print(json.dumps(peak_check.runtime_baseline(spec["baseline"])))
        return
    cfg = peak_check.CheckConfig(**spec)
    startup.begin(devices=cfg.devices)
    print(json.dumps(peak_check.check(cfg)))


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two small configurations")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return {}
    try:
        check_output_file("out", args.out)
    except ConfigError as e:
        fail(PROG, str(e))

    (peak_check,) = startup.load("experiments.zero.peak_check")
    rows, failures = [], []
    start = time.perf_counter()
    todo = configs(args.quick)
    root = pathlib.Path(__file__).resolve().parent.parent

    def fresh_process(spec: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", PROG, "--worker", json.dumps(spec)],
                              capture_output=True, text=True, cwd=root,
                              env={**os.environ, **peak_check.MMAP_ENV, "PYTHONPATH": str(root)})

    # The runtime's own cost of a first run on these devices, measured the same way (a control:
    # what no compiled peak can hold).
    done = fresh_process({"baseline": todo[0].devices})
    baseline = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    for i, cfg in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {cfg.name} ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
        proc = fresh_process(dataclasses.asdict(cfg))
        if proc.returncode != 0:
            failures.append({"name": cfg.name, "stderr": proc.stderr.strip()[-2000:]})
            print(f"  failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if failures and not rows:
        fail(PROG, f"every configuration failed; first: {failures[0]['stderr'][-300:]}", code=1)
    worst = max(abs(r["error"]) for r in rows)
    out = {
        "results": rows, "failures": failures, "max_abs_error": worst, "goal": GOAL,
        "within_goal": worst <= GOAL and not failures,
        "max_abs_executable_vs_planner": max(abs(r["executable_vs_planner"]) for r in rows),
        "runtime_baseline": baseline,
        "method": "executed peak per device = (anonymous resident memory (RssAnon) growth "
                  "allocating the state and batch + its largest value sampled every ms during "
                  "the first step above the value before it) / devices; one fresh process per "
                  "row, glibc mmap threshold 128 KiB; XLA:CPU has no memory statistics. Split, "
                  "in a second step: glibc's bytes in use (mallinfo2), blocks of 128 KiB or "
                  "more (XLA's arrays and temporaries) and smaller ones (the runtime's)",
        "wall_s": round(time.perf_counter() - start, 1),
        "command": "python -m " + PROG + (" --quick" if args.quick else ""),
    }
    path = write_result(args.out, out)
    for r in rows:
        print(f"{r['name']:<48} planner {r['planner_peak_bytes'] / 1e6:8.2f} MB  executed "
              f"{r['executed_peak_bytes'] / 1e6:8.2f} MB  error {r['error']:+.1%}",
              file=sys.stderr)
    print(f"max |error| {worst:.1%} (goal {GOAL:.0%}); written to {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    if failures:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
