"""Sentence-embedding speed of all-MiniLM-L6-v2: our float and int8 encoders, optionally
against PyTorch (transformers float, torch.ao.quantization.quantize_dynamic int8).

  python -m experiments.bench_encoder --json
  python -m experiments.bench_encoder --torch-python REFVENV/bin/python --json
  python -m experiments.bench_encoder --modes w8a8 --sentences 128 --rounds 2 --out ''

Texts: --sentences deterministic texts of varied length (1 to 4 stdlib docstring sentences
joined; experiments/speed/encoder.py: bench_sentences), batch --batch. Per variant: sentences/s
(median of --rounds end-to-end passes, all variants interleaved round by round), a breakdown of
one pass (tokenisation, compilation per padded shape, host->device, compute, device->host) and
the cosine of its embeddings to our float ones (mean/min). --torch-python runs
experiments/reference/torch_encoder_reference.py with that interpreter (a separate venv with torch
and transformers) as a server and times its float and int8 passes in the same rounds; the JSON then
holds its figures and the ratios ours / theirs (float vs float, each int8 mode vs torch int8).
$SHARDQ_TORCH_PYTHON is its default (experiments.reproduce passes no flag); without either, no
torch side is measured. Records the machine and the 1-minute load average.
Writes experiments/results/bench_encoder.json (--out '' skips writing).

  python -m experiments.bench_encoder --ablations --json   # before/after of each speed change

--ablations measures each change to the encoding path against its previous form in one process,
interleaved (experiments/speed/encoder_ablations.py: ablation_*), and the embed CLI's marginal
speed as a user runs it; writes experiments/results/encoder_ablations.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import (
    TORCH_PYTHON_ENV,
    ConfigError,
    Parser,
    check_devices,
    check_output_file,
    fail,
)
from experiments.pretrained.encoder_devices import MAX_DEVICES, default_devices
from experiments.reporting.results_io import command_line, results_path, write_result
from quant.modes import MODES

PROG = "experiments.bench_encoder"
OUT = results_path("bench_encoder.json")
ABLATIONS = results_path("encoder_ablations.json")
DEFAULT_MODES = ("w8", "w8a8", "w8a8-static", "smoothquant", "auto", "w8a8-rotated")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=512, help="benchmark texts")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="timed passes per variant (median)")
    p.add_argument("--devices", type=int, default=None,
                   help="CPU devices each batch is split over (default: one per usable core, "
                        f"at most {MAX_DEVICES}, as experiments.embed)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated int8 modes, of {', '.join(MODES)}")
    p.add_argument("--torch-python", default=os.environ.get(TORCH_PYTHON_ENV) or None,
                   metavar="PATH",
                   help="interpreter with torch + transformers for the PyTorch side "
                        f"(default ${TORCH_PYTHON_ENV} if set, else no PyTorch side)")
    p.add_argument("--ablations", action="store_true",
                   help="instead: before/after of each speed change (length buckets, GELU, "
                        "dp batch split over 8 devices, the embed CLI's marginal speed), "
                        f"written to {ABLATIONS.relative_to(ABLATIONS.parents[2])}")
    p.add_argument("--no-cli", action="store_true", help="--ablations without the CLI runs")
    p.add_argument("--out", default=None,
                   help="results file ('' to skip writing; default per the mode above)")
    p.add_argument("--json", action="store_true", help="print the results as the last line")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        fail(PROG, f"modes={args.modes!r}: allowed {', '.join(MODES)}")
    for name in ("sentences", "batch", "rounds"):
        if getattr(args, name) < 1:
            fail(PROG, f"{name}={getattr(args, name)}: must be a positive integer")
    if args.devices is not None:  # runtime.start checks it too, after JAX is imported
        try:
            check_devices(args.devices)
        except ConfigError as e:
            fail(PROG, str(e))
    devices = args.devices if args.devices is not None else default_devices()
    if args.torch_python and not (Path(args.torch_python).is_file()
                                  or shutil.which(args.torch_python)):
        fail(PROG, f"torch-python={args.torch_python!r}: no such interpreter")
    if args.out:  # '' skips writing
        try:
            check_output_file("out", args.out)
        except ConfigError as e:
            fail(PROG, str(e))
    encoder, encoder_ablations = startup.begin(  # 8: the dp ablation's mesh
        "experiments.speed.encoder", "experiments.speed.encoder_ablations",
        devices=max(8, devices) if args.ablations else devices)

    try:
        texts = encoder.bench_sentences(args.sentences)
    except ValueError as e:
        fail(PROG, f"sentences={args.sentences}: {e}")
    if args.ablations:
        out = encoder_ablations.ablations(texts, batch=args.batch, rounds=args.rounds,
                                          cli=not args.no_cli, cores=devices)
    else:
        out = encoder.run(texts, modes, batch=args.batch, rounds=args.rounds,
                  torch_python=args.torch_python, devices=devices)
    # The interpreter's path is this machine's: the record names the flag's value generically.
    shown = ["PYTHON" if a == args.torch_python else a
             for a in (argv if argv is not None else sys.argv[1:])]
    out["command"] = command_line(PROG, shown)
    dest = args.out if args.out is not None else str(ABLATIONS if args.ablations else OUT)
    if dest:
        write_result(dest, out)
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
