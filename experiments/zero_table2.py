"""The ZeRO paper's Table 2 by search, and the planning table for today's devices.

  python -m experiments.zero_table2 --json [--quick] [--no-cache] [--out FILE]

Largest member of our GPT family (experiments/zero/plan_family.py: the GPT-3-style presets'
width/depth curve, head dim 128, d_ff = 4 d_model) whose training step fits a device, per ZeRO
stage:
- 64 devices of 32 GB (the paper's Table 2 row): model state only (the paper's count at our
  members' exact Psi) beside the paper's 2B / 7.6B / 14.4B / 128B, and with activations: a
  bisection over widths, each step the real bf16 training step compiled for 64 fake CPU devices
  (seq 1024, one sequence per device per micro-step, two micro-steps, remat full), fitting
  when XLA:CPU's compiled peak is within the memory;
- 80 GB and 141 GB devices, 8 to 1024 devices: model state only for every cell; compiled with
  activations for --compiled-devices (default 8, 64 and 1024: each compiled cell is a bisection
  of compiles; the cells between follow the same curves).
Writes experiments/results/zero_table2.json and zero_table2.png (largest model vs devices, per
stage, log-log). Compiles are cached in --cache (default runs/plan-cache). GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, check_output_folder, fail
from experiments.reporting import plots
from experiments.reporting.results_io import project_relative, results_path, write_result
from experiments.zero.settings import STAGES

PROG = "experiments.zero_table2"
DEFAULT_OUT = str(results_path("zero_table2.json"))
DEVICE_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
MEMORIES_GB = (80, 141)


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="compile only the 32 GB x 64 row (8 devices for the planning table "
                        "are formula only)")
    p.add_argument("--compiled-devices", type=int, nargs="*", default=[8, 64, 1024],
                   help="planning-table device counts searched by compiling (default 8 64 "
                        "1024)")
    p.add_argument("--cache", default="runs/plan-cache", help="compile results cache folder")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    compiled_devices = [] if args.quick else sorted(set(args.compiled_devices))
    for n in compiled_devices:
        if n not in DEVICE_COUNTS:
            fail(PROG, f"compiled-devices={n}: allowed {', '.join(map(str, DEVICE_COUNTS))}")
    try:
        check_output_file("out", args.out, "the table")
        if not args.no_cache:
            check_output_folder("cache", args.cache, "the compile cache")
    except ConfigError as e:
        fail(PROG, str(e))

    capacity, estimate = startup.begin("experiments.zero.capacity",
                                       "experiments.zero.plan_estimate",
                                       devices=max([64, *compiled_devices]))
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    search = capacity.CompiledSearch(
        cache=None if args.no_cache else estimate.CompileCache(args.cache), progress=say)
    start = time.perf_counter()
    table2 = []
    for stage in STAGES:
        say(f"Table 2: {stage}, 64 devices x 32 GB ({time.perf_counter() - start:.0f} s)")
        row = capacity.table2_row(stage, 64, 32e9, search)
        row["paper_printed_psi"] = capacity.PAPER_TABLE2_64X32GB[stage]
        table2.append(row)
    planning = _planning_rows(capacity, search, compiled_devices,
                              lambda line: say(f"{line} ({time.perf_counter() - start:.0f} s)"))
    png = pathlib.Path(args.out).with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plots.zero_table2_planning(planning, png)
    s = search.setting
    out = {
        "table2": table2, "planning": planning,
        "config": {"family": "GPT-style presets' width/depth curve, head dim 128, d_ff 4 d, "
                             "byte vocabulary, widths in multiples of 128 (and of N)",
                   "seq_len": s.seq_len, "micro_batch": s.micro_batch,
                   "micro_steps": s.micro_steps, "remat": s.remat, "dtype": s.dtype,
                   "state_only": "ZeRO paper bytes (2 + 2 + 12 per parameter, split by stage) "
                                 "at the member's exact Psi",
                   "compiled": "XLA:CPU compiled peak per device <= memory, fake CPU devices",
                   "gb": "1e9 bytes"},
        "compiles": search.compiles, "wall_s": round(time.perf_counter() - start, 1),
        "plot": project_relative(png),
        "command": "python -m " + PROG + (" --quick" if args.quick else ""),
    }
    path = write_result(args.out, out)
    for r in table2:
        got = r["compiled_psi"]
        print(f"{r['stage']:>6}: paper {r['paper_printed_psi'] / 1e9:6.1f}B  state-only "
              f"{r['state_psi'] / 1e9:7.2f}B  with activations "
              f"{got / 1e9 if got else 0:7.2f}B", file=sys.stderr)
    say(f"{search.compiles} compiles in {out['wall_s']} s; written to {path} and {png}")
    if args.json:
        print(json.dumps(out))
    return out


def _planning_rows(capacity, search, compiled_devices: list[int], say) -> list[dict]:
    """The planning table: every (memory, device count, stage) cell, compiled where asked."""
    planning = []
    found: dict = {}
    for mem in MEMORIES_GB:
        for n in DEVICE_COUNTS:
            for stage in STAGES:
                compile_it = n in compiled_devices
                if compile_it:
                    say(f"planning: {stage}, {n} devices x {mem} GB")
                # Fits at fewer devices (sharded stages) or less memory: a lower bracket.
                lo = max((w for (s, m, k), w in found.items()
                          if s == stage and m <= mem and k <= n), default=0)
                row = capacity.table2_row(stage, n, mem * 1e9, search if compile_it else None,
                                          lo=lo)
                if compile_it and row["compiled_width"]:
                    found[(stage, mem, n)] = row["compiled_width"]
                planning.append(row)
    return planning


if __name__ == "__main__":
    main()
