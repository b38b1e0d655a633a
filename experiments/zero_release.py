"""ZeRO-3 releases what it gathers: peak memory grows with depth by activations and shards only.

  python -m experiments.zero_release --json

Compiles a zero3 (and a zero3_auto) training step of one width at two depths (default d_model
1024, 4 vs 12 layers; bf16 mixed precision, remat=full, one micro-step, 4 sequences of 128 tokens
per device) and reads the compiler's per-device peak (argument + output + temp - alias). If
gathered weights were kept, every added layer would add its whole gathered weights (2 bytes x
one layer's params). With gather-then-release it only adds
  - the saved activation of the layer: the scan carry, B_local * T * d_model * 2 bytes, and
  - the layer's own shards: bf16 params + grads, fp32 master/mu/nu and their temporaries, all
    divided by N_d.
To tell the two apart without guessing the compiler's temporaries, the growth per added layer g
is measured at two device counts (default 4 and 8): g(N) = s / N + u, so the per-layer growth
that does not shrink with N_d is u = (n2 g(n2) - n1 g(n1)) / (n2 - n1).
`kept_gathered_layers` = (u - carry) / one layer's gathered weights: about 1 or more if the
gathered weights were kept, about 0 if released (`released` when below 0.5).

Measured on XLA:CPU, u is about 3 carries, not 1: the forward loop saves the bf16 carry stack
(1 carry per layer) and XLA:CPU, which widens bf16 to f32 around dynamic-update-slice, keeps an f32
copy of that stack for the backward loop (2 more). That is activation memory, still far below one
layer's gathered weights. The 8-device rows also give growth / (carry + 16 bytes x params / N_d).

Hardware: CPU, 8 fake devices, 8 compiles of a few seconds each.
Output: one JSON line, also written to experiments/results/zero_release.json (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from tqdm import tqdm

from experiments.cli.config import ConfigError, Parser, fail
from experiments.reporting.results_io import results_path, write_result
from experiments.zero.evidence import (
    ReleaseSetup,
    measure_depth,
    release_report,
)
from parallel.devices import request_cpu_devices

PROG = "experiments.zero_release"
DEFAULT_OUT = str(results_path("zero_release.json"))


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ReleaseSetup()
    p.add_argument("--d-model", type=int, default=defaults.d_model)
    p.add_argument("--n-heads", type=int, default=defaults.n_heads)
    p.add_argument("--d-ff", type=int, default=defaults.d_ff)
    p.add_argument("--depths", type=int, nargs=2, default=list(defaults.depths))
    p.add_argument("--devices", type=int, nargs=2, default=list(defaults.devices),
                   help="two device counts; the second is the headline (default 4 8)")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--seqs-per-device", type=int, default=defaults.seqs_per_device)
    p.add_argument("--strategies", nargs="+", default=["zero3", "zero3_prefetch", "zero3_auto"],
                   choices=["zero3", "zero3_prefetch", "zero3_auto"])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output file (default {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    setup = ReleaseSetup(args.d_model, args.n_heads, args.d_ff, tuple(args.depths),
                         tuple(sorted(args.devices)), args.seq_len, args.seqs_per_device)
    try:
        setup.validate()
    except ConfigError as e:
        fail(PROG, str(e))

    request_cpu_devices(max(setup.devices))

    jobs = [(s, layers, n) for s in args.strategies for layers in setup.depths
            for n in setup.devices]
    measured = {job: measure_depth(setup, *job)
                for job in tqdm(jobs, desc="compiling", file=sys.stderr)}
    results = []
    for strategy in args.strategies:
        peaks = {(layers, n): m["peak"] for (s, layers, n), m in measured.items()
                 if s == strategy}
        deepest = measured[(strategy, setup.depths[1], setup.devices[1])]
        results.append({**release_report(setup, strategy, peaks),
                        "layer_loop_elements_per_step": deepest["layer_loop_elements"]})
    out = {"results": results, "config": {**dataclasses.asdict(setup), "dtype": "bf16 mixed",
                                          "remat": "full", "micro_steps": 1,
                                          "peak": "argument + output + temp - alias"}}
    path = pathlib.Path(args.out)
    write_result(path, out)
    if not args.json:
        for r in results:
            print(f"{r['strategy']:>10}: growth/layer {r['growth_per_layer_bytes']} B; "
                  f"unsharded part {r['unsharded_growth_per_layer_bytes'] / 1e6:.2f} MB "
                  f"({r['unsharded_growth_in_carries']:.2f} carries) vs gathered layer "
                  f"{r['gathered_layer_bytes'] / 1e6:.2f} MB; kept gathered layers "
                  f"{r['kept_gathered_layers']:.3f}; released: {r['released']}")
    else:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
