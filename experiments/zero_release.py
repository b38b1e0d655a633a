"""ZeRO-3 releases what it gathers: peak memory grows with depth by activations and shards only.

  python -m experiments.zero_release --json

Compiles the training step of each strategy (zero3, zero3_prefetch, zero3_auto) and of a
control (`zero3_keep_gathered`: zero3 whose backward pass keeps every gathered layer) at one
width and two depths (default d_model 1024, 4 vs 12 layers; bf16 mixed precision, remat=full,
one micro-step, 4 sequences of 128 tokens per device) and reads the compiler's per-device peak
(argument + output + temp - alias). Keeping the gathered weights adds, per added layer, a whole
gathered layer (2 bytes x one layer's params) that does not shrink with the device count N_d.
Gather-then-release only adds
  - the saved activation of the layer: the scan carry, B_local * T * d_model * 2 bytes, and
  - the layer's own shards: bf16 params + grads, fp32 master/mu/nu and their temporaries, all
    divided by N_d.
To tell the two apart without guessing the compiler's temporaries, the growth per added layer g
is measured at two device counts (default 8 and 32) and fitted as g(N) = u + s / N with u, s
>= 0 (non-negative least squares: a part of memory cannot be negative). `kept_gathered_layers`
= max(0, u - carry) / one layer's gathered weights: about 0 when released, 1 or more when kept;
`released` when below 0.5. The control must come out not released, or the check proves nothing.

XLA:CPU widens bf16 to f32 around some buffers, so u may hold a few carries and the control
more than one gathered layer per layer; both are far from the threshold on either side.

Every runnable preset users train under zero3 is also read as shipped ("shipped": its own
scan_unroll, remat, depth and batch, on 8 devices, beside the control on the same config): its
backward pass must gather every layer again and its peak stay below the control's. Each row
also holds the step's collective volume per step (in Psi) beside comm_volume's expectation, and a
preset with an unrolled layer scan is compiled once more with scan_unroll=1 (the loop that
releases), to show its peak beside the shipped one's.

Hardware: CPU, fake devices, compile-only (a few seconds per compile).
Output: one JSON line, also written to experiments/results/zero_release.json (--out); the
control's rows are under "controls".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from tqdm import tqdm

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.reporting.results_io import results_path, write_result
from experiments.zero.settings import (
    KEEP_GATHERED,
    RELEASE_STRATEGIES,
    SHIPPED_DEVICES,
    SHIPPED_ZERO3_PRESETS,
    ReleaseSetup,
)

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
    p.add_argument("--strategies", nargs="+", default=list(RELEASE_STRATEGIES),
                   choices=list(RELEASE_STRATEGIES))
    p.add_argument("--controls", nargs="*", default=[KEEP_GATHERED], choices=[KEEP_GATHERED],
                   help="variants that must come out not released (default the one control; "
                        "give the flag alone for none)")
    p.add_argument("--shipped", nargs="*", default=list(SHIPPED_ZERO3_PRESETS),
                   choices=list(SHIPPED_ZERO3_PRESETS),
                   help="runnable presets whose zero3 step is also read as shipped, beside the "
                        "control on the same config (default all; give the flag alone for none)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output file (default {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    setup = ReleaseSetup(args.d_model, args.n_heads, args.d_ff, tuple(args.depths),
                         tuple(sorted(args.devices)), args.seq_len, args.seqs_per_device)
    try:
        setup.validate()
        check_output_file("out", args.out)
    except ConfigError as e:
        fail(PROG, str(e))
    (evidence,) = startup.begin("experiments.zero.evidence",
                                devices=max(*setup.devices, SHIPPED_DEVICES))

    variants = [*args.strategies, *args.controls]
    jobs = [(s, layers, n) for s in variants for layers in setup.depths for n in setup.devices]
    measured = {job: evidence.measure_depth(setup, *job)
                for job in tqdm(jobs, desc="compiling", file=sys.stderr)}
    rows = {}
    for strategy in variants:
        peaks = {(layers, n): m["peak"] for (s, layers, n), m in measured.items()
                 if s == strategy}
        deepest = measured[(strategy, setup.depths[1], setup.devices[1])]
        rows[strategy] = {**evidence.release_report(setup, strategy, peaks),
                          "layer_loop_elements_per_step": deepest["layer_loop_elements"]}
    shipped = [evidence.shipped_release(preset, SHIPPED_DEVICES)
               for preset in tqdm(args.shipped, desc="shipped presets", file=sys.stderr)]
    model = dataclasses.asdict(setup.model(setup.depths[1]))
    del model["n_layers"]
    out = {"results": [rows[s] for s in args.strategies],
           "controls": [rows[s] for s in args.controls],
           "shipped": shipped,
           "config": {**dataclasses.asdict(setup), "dtype": "bf16 mixed", "remat": "full",
                      "micro_steps": 1, "peak": "argument + output + temp - alias",
                      "fit": "g(N) = u + s / N, u and s >= 0 (non-negative least squares)",
                      "model": model}}
    path = pathlib.Path(args.out)
    write_result(path, out)
    if not args.json:
        for r in out["results"] + out["controls"]:
            print(f"{r['strategy']:>19}: growth/layer {r['growth_per_layer_bytes']} B; "
                  f"unsharded part {r['unsharded_growth_per_layer_bytes'] / 1e6:.2f} MB "
                  f"({r['unsharded_growth_in_carries']:.2f} carries) vs gathered layer "
                  f"{r['gathered_layer_bytes'] / 1e6:.2f} MB; kept gathered layers "
                  f"{r['kept_gathered_layers']:.3f}; released: {r['released']}")
        for r in shipped:
            unroll1 = (f"; with scan_unroll 1: peak {r['unroll1_peak_bytes']} B, gathered "
                       f"{r['unroll1_layer_param_gathers']:.2f} times"
                       if "unroll1_peak_bytes" in r else "")
            print(f"{r['preset']:>19} as shipped: layers gathered {r['layer_param_gathers']:.2f}"
                  f" times per step (control {r['control_layer_param_gathers']:.2f}); peak "
                  f"{r['peak_bytes']} B (control {r['control_peak_bytes']} B); released: "
                  f"{r['released']}{unroll1}")
    else:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
