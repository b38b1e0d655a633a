"""Communication volume per step and device of each strategy, read from the compiled program.

  python -m experiments.comm_volume --json

Compiles the real training step (one micro-step, fp32) for 8 fake CPU devices on mesh fsdp=8 per
strategy and sums the collectives of the compiled HLO (parallel/hlo.py), each times the trip
counts of the while loops around it, in units of Psi (parameter count). Convention (ring):
all-reduce of M elements = 2M, all-gather = output elements, reduce-scatter = input elements.

Expected (ZeRO paper, ANCHORS.md §1): dp = zero1 = zero2 = 2 Psi, zero3 = 3 Psi (within 5%), and
zero3's parameter all-gathers inside the layer scan's while loop (forward + backward re-gather).

Model: the `small` preset's width with 6 layers (--n-layers), scan_unroll=1 (an unrolled scan
has no loop to find) and remat=full by default. Two things shape what zero3 shows, both
reported in the JSON:
- Only the stacked layers are gathered per layer and re-gathered in the backward pass. The
  embedding, final norm and head are gathered once per step outside the loop (2 Psi for those:
  gather + reduce-scatter), so zero3 = 3 Psi_layers + 2 Psi_rest; for `small`, 2.90 Psi.
- `zero3_remat` repeats zero3 for each remat setting. With remat=none the zero3 hook's own remat
  policy keeps every activation but no gathered weight, so the backward pass still re-gathers
  (layer_param_gathers = 2 for every setting).
zero3_auto is reported as compiled: the compiler keeps the weights sharded and all-reduces
activations inside the layer loop (and gathers the token batch), so it has no parameter
all-gathers in the loop and a volume that depends on batch x sequence, not on Psi.
Hardware: CPU, a few seconds per compile; runtime about 30 s. Output: one JSON line, also written
to experiments/results/comm_volume.json (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

PROG = "experiments.comm_volume"
STRATEGY_ORDER = ("dp", "zero1", "zero2", "zero3", "zero3_prefetch", "zero3_auto")
EXPECTED_PSI = {"dp": 2.0, "zero1": 2.0, "zero2": 2.0, "zero3": 3.0, "zero3_prefetch": 3.0,
                "zero3_auto": 3.0}
TOLERANCE = 0.05
N_DEVICES = 8
DEFAULT_OUT = "experiments/results/comm_volume.json"


def model_config(preset: str, remat: str, dtype: str = "float32", n_layers: int | None = None):
    from model.config import MODEL_PRESETS

    # scan_unroll=1: the layers must run inside a while loop for the loop placement to be seen.
    cfg = MODEL_PRESETS[preset]
    return dataclasses.replace(cfg, scan_unroll=1, remat=remat, param_dtype=dtype,
                               compute_dtype=dtype, n_layers=n_layers or cfg.n_layers)


def layer_param_count(cfg) -> int:
    """Parameters of the stacked layers (everything but embedding, final norm and head)."""
    from model.flops import param_count

    return param_count(cfg) - param_count(dataclasses.replace(cfg, n_layers=0))


def volume_report(hlo_text: str, cfg) -> dict:
    """Volume of one compiled step in units of Psi, split by kind and by place (see module doc).

    A while loop whose trip count is the layer count is a layer loop (with one micro-step there
    is no micro-step loop to confuse it with). zero3_prefetch peels the last layer of each pass
    out of its loops (trip counts L-1 forward, L-2 backward), so those count as layer loops too;
    its peeled gathers sit outside and layer_param_gathers counts only the in-loop ones.
    """
    from model.flops import param_count
    from parallel import hlo

    psi = param_count(cfg)
    psi_layers = layer_param_count(cfg)
    found = hlo.collectives(hlo_text)
    layer_trips = {cfg.n_layers, cfg.n_layers - 1, cfg.n_layers - 2} - {0, 1}
    in_layer_loop = [c for c in found if any(trips in layer_trips for _, trips in c.loops)]
    by_kind = {kind: hlo.volume_per_step([c for c in found if c.kind == kind]) / psi
               for kind in hlo.COLLECTIVE_KINDS}
    layer_gathers = [c for c in in_layer_loop if c.kind == "all-gather"]
    gathered = sum(c.result_elements * c.executions for c in layer_gathers)
    return {
        "volume_psi": hlo.volume_per_step(found) / psi,
        "all_gather_psi": by_kind["all-gather"],
        "reduce_scatter_psi": by_kind["reduce-scatter"],
        "all_reduce_psi": by_kind["all-reduce"],
        "in_layer_loop_psi": hlo.volume_per_step(in_layer_loop) / psi,
        # How many times per step the stacked layer parameters are all-gathered inside the
        # layer loops: 2 = forward gather + backward re-gather (gather-then-release).
        "layer_param_gathers": gathered / psi_layers,
        "all_gathers_in_layer_loop": gathered >= psi_layers,
        "collectives": len(found),
        "gather_dtypes": sorted({dt for c in found if c.kind == "all-gather" for dt in c.dtypes}),
    }


def measure(strategy: str, cfg) -> dict:
    from experiments.compiled import compile_step

    compiled, _ = compile_step(cfg, strategy, N_DEVICES, seq_len=cfg.max_len, micro_steps=1)
    row = {"strategy": strategy, "remat": cfg.remat, **volume_report(compiled.as_text(), cfg)}
    row["expected_psi"] = EXPECTED_PSI[strategy]
    row["within_5pct"] = abs(row["volume_psi"] / row["expected_psi"] - 1) <= TOLERANCE
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
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


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from parallel.devices import request_cpu_devices

    request_cpu_devices(N_DEVICES)
    from tqdm import tqdm

    from model.flops import param_count

    cfg = model_config(args.preset, args.remat, n_layers=args.n_layers)
    remats = ("none", "full", "save_dots")
    jobs = [(s, cfg) for s in args.strategies] + [
        ("zero3", model_config(args.preset, r, n_layers=args.n_layers)) for r in remats]
    rows = [measure(s, c) for s, c in tqdm(jobs, desc="compiling", file=sys.stderr)]
    out = {
        "results": rows[:len(args.strategies)],
        "zero3_remat": rows[len(args.strategies):],
        "psi": param_count(cfg), "psi_layers": layer_param_count(cfg),
        "convention": "per step per device, in units of Psi; " + _convention(),
        "config": {"preset": args.preset, "devices": N_DEVICES, "mesh": f"fsdp={N_DEVICES}",
                   "micro_steps": 1, "dtype": "float32", "scan_unroll": 1, "remat": args.remat,
                   "n_layers": cfg.n_layers,
                   "global_batch": N_DEVICES, "seq_len": cfg.max_len},
    }
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    if not args.json:
        for r in out["results"] + out["zero3_remat"]:
            print(f"{r['strategy']:>10} remat={r['remat']:<9} {r['volume_psi']:6.3f} Psi "
                  f"(expected {r['expected_psi']:.0f}, within 5%: {r['within_5pct']}); "
                  f"layer-param gathers in loop: {r['layer_param_gathers']:.2f}")
    else:
        print(json.dumps(out))
    return out


def _convention() -> str:
    from parallel.hlo import VOLUME_CONVENTION

    return VOLUME_CONVENTION


if __name__ == "__main__":
    main()
