"""Inject the faults a long run meets and show that nothing is lost.

  python -m experiments.fault_injection --json [--seed N]

Each scenario (experiments/training/faults.py) trains the `tiny` preset on 8 fake CPU devices,
injects one fault, handles it the way a user would and compares with an uninterrupted reference
run of the same config and seed. A row's `outcome` is `recovered` (a resumed run reached the
last step with the reference's parameters, bit for bit) or `refused` (a fault the run must
refuse stopped it as described, saving nothing), or `not recovered` / `not refused`;
`lost_steps`, `retrained_steps`, `recovery_s` and `mocked` are described in that module. The
kill points are drawn from --seed (recorded in the output); --scenarios runs a subset (the
quick reproduction does). Writes experiments/results/fault_injection.json (--out); the last
stdout line is its JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.reporting.results_io import results_path, write_result

PROG = "experiments.fault_injection"
# The scenario names, in the table's order (experiments/training/faults.py SCENARIOS, which
# imports JAX: the names are repeated here so that a bad --scenarios is refused before it).
SCENARIOS = ("crash_and_resume", "killed_in_first_save", "preemption", "interrupted_checkpoint",
             "truncated_checkpoint", "altered_checkpoint", "disk_full_during_save", "resharding",
             "nonfinite", "nonfinite_update", "disk_too_small")


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=None,
                   help="draws the kill and SIGTERM points (default: a random seed, recorded)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated subset, run in the table's order (default: all)")
    p.add_argument("--out", default=str(results_path("fault_injection.json")))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    names = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    if not names or any(x not in SCENARIOS for x in names) or len(set(names)) != len(names):
        fail(PROG, f"scenarios={args.scenarios!r}: a comma-separated list of distinct names "
                   f"from {', '.join(SCENARIOS)}")
    try:
        check_output_file("out", args.out)
    except ConfigError as e:
        fail(PROG, str(e))
    (faults,) = startup.begin("experiments.training.faults", devices=8)
    assert faults.SCENARIOS == SCENARIOS
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    out = faults.run(names, seed)
    write_result(args.out, out)
    if not args.json:
        for r in out["results"]:
            print(f"{r['scenario']:24s} {r['injected']:48s} {r['outcome']:13s} "
                  f"lost={r['lost_steps']} retrained={r['retrained_steps']} "
                  f"{r['recovery_s']:.1f} s")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
