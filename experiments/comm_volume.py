"""Communication volume per step and device of each strategy, read from the compiled program.

  python -m experiments.comm_volume --json

Compiles the real training step (one micro-step, fp32) for 8 fake CPU devices on mesh fsdp=8 per
strategy and sums the collectives of the compiled HLO (parallel/hlo.py), each times the trip
counts of the while loops around it, in units of Psi (parameter count). Convention (ring):
all-reduce of M elements = 2M, all-gather = output elements, reduce-scatter = input elements.

Expected (ZeRO, Rajbhandari et al. 2020): dp = zero1 = zero2 = 2 Psi, zero3 = 3 Psi (within 5%), and
zero3's parameter all-gathers inside the layer scan's while loop (forward + backward re-gather).

Model: the `small` preset's width with 6 layers (--n-layers), scan_unroll=1 (an unrolled scan
has no loop to find) and remat=full by default. Two things shape what zero3 shows, both
reported in the JSON:
- Only the stacked layers are gathered per layer and re-gathered in the backward pass. The
  embedding, final norm and head are gathered once per step outside the loop (2 Psi for those:
  gather + reduce-scatter), so zero3 = 3 Psi_layers + 2 Psi_rest, a little under 3 Psi.
- `zero3_remat` repeats zero3 for each remat setting. With remat=none the zero3 hook's own remat
  policy keeps every activation but no gathered weight, so the backward pass still re-gathers
  (layer_param_gathers = 2 for every setting).
The presets as users train them (their own depth and scan_unroll) are read by
`python -m experiments.zero_release` (its "shipped" rows: volume and gathers per step).
zero3_auto is reported as compiled: the compiler keeps the weights sharded and all-reduces
activations inside the layer loop (and gathers the token batch), so it has no parameter
all-gathers in the loop and a volume that depends on batch x sequence, not on Psi.
Hardware: CPU (the JSON records each compile's time). Output: one JSON line, also written to
experiments/results/comm_volume.json (--out).
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
from model.config import MODEL_PRESETS

PROG = "experiments.comm_volume"
STRATEGY_ORDER = ("dp", "zero1", "zero2", "zero3", "zero3_prefetch", "zero3_auto")
DEFAULT_OUT = str(results_path("comm_volume.json"))


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument("--n-layers", type=int, default=6,
                   help="depth (default 6: zero3_prefetch peels a layer per pass out of its "
                        "loops, so shallow stacks degenerate; see parallel/prefetch.py)")
    p.add_argument("--remat", default="full", choices=("none", "full", "save_dots"),
                   help="remat of the strategy rows (default full)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGY_ORDER),
                   choices=list(STRATEGY_ORDER))
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output file (default {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def check_flags(preset: str, n_layers: int, out: str) -> None:
    """ConfigError naming the first bad flag; nothing is compiled or written before this."""
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"preset={preset!r}: allowed {', '.join(MODEL_PRESETS)}")
    if n_layers < 1:
        raise ConfigError(f"n-layers={n_layers}: must be a positive integer")
    check_output_file("out", out)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        check_flags(args.preset, args.n_layers, args.out)
    except ConfigError as e:
        fail(PROG, str(e))
    (evidence,) = startup.load("experiments.zero.evidence")
    flops, hlo = startup.begin("model.flops", "parallel.hlo", devices=evidence.N_DEVICES)

    cfg = evidence.model_config(args.preset, args.remat, n_layers=args.n_layers)
    remats = ("none", "full", "save_dots")
    jobs = [(s, cfg) for s in args.strategies] + [
        ("zero3", evidence.model_config(args.preset, r, n_layers=args.n_layers)) for r in remats]
    rows = [evidence.measure(s, c) for s, c in tqdm(jobs, desc="compiling", file=sys.stderr)]
    n_devices = evidence.N_DEVICES
    out = {
        "results": rows[:len(args.strategies)],
        "zero3_remat": rows[len(args.strategies):],
        "psi": flops.param_count(cfg), "psi_layers": evidence.layer_param_count(cfg),
        "convention": "per step per device, in units of Psi; " + hlo.VOLUME_CONVENTION,
        "config": {"preset": args.preset, "devices": n_devices, "mesh": f"fsdp={n_devices}",
                   "micro_steps": 1, "dtype": "float32", "scan_unroll": 1, "remat": args.remat,
                   "n_layers": cfg.n_layers,
                   "global_batch": n_devices, "seq_len": cfg.max_len,
                   "model": dataclasses.asdict(cfg)},
    }
    path = pathlib.Path(args.out)
    write_result(path, out)
    if not args.json:
        for r in out["results"] + out["zero3_remat"]:
            print(f"{r['strategy']:>10} remat={r['remat']:<9} {r['volume_psi']:6.3f} Psi "
                  f"(expected {r['expected_psi']:.3f}, within 5%: {r['within_5pct']}; "
                  f"{r['in_layer_loop_psi_layers']:.3f} Psi_layers in the layer loop); "
                  f"layer-param gathers in loop: {r['layer_param_gathers']:.2f}")
    else:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
