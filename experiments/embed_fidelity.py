"""How faithful is the int8 encoder? Every quant mode against the float embeddings.

  python -m experiments.embed_fidelity --json
  python -m experiments.embed_fidelity --sentences 500 --modes w8a8,smoothquant --json

Corpus: English sentences cut from the docstrings of standard-library modules (real prose that
ships with Python; code-like lines are dropped), so the numbers depend on the Python version,
which is reported. Calibration uses a disjoint slice of the same corpus.

Per mode: mean and min cosine to the float embedding of the same sentence; a retrieval task in
which every sentence queries all the others: top1_agreement = share of queries whose nearest
neighbour is the same as with float embeddings, top10_overlap = mean |top10_int8 & top10_float|
/ 10; param_bytes as stored. Also: per-layer activation outliers of the float model (input
channels of each Dense with the largest |x|, their size against the median channel) and
encoding throughput (sentences/s) float vs int8. The last line is
{"results": [{"mode", "mean_cosine", "min_cosine", "top1_agreement", "top10_overlap",
"param_bytes"}, ...], ...}, also written to experiments/results/embed_fidelity.json.
"""

from __future__ import annotations

import argparse
import json

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.reporting.results_io import results_path, write_result
from quant.modes import MODES

PROG = "experiments.embed_fidelity"
RESULTS = results_path("embed_fidelity.json")
DEFAULT_MODES = ("w8", "w8a8-tensor", "w8a8", "w8a8-static", "smoothquant", "w8a8-outlier",
                 "auto", "w8a8-rotated")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=500, help="evaluation sentences (>= 11)")
    p.add_argument("--calib", type=int, default=128, help="calibration sentences (disjoint)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated modes")
    p.add_argument("--json", action="store_true", help="print the results as the last line")
    p.add_argument("--out", default=str(RESULTS), help="results file ('' to skip writing)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        fail(PROG, f"modes={args.modes!r}: allowed {', '.join(MODES)}")
    if args.sentences < 11 or args.calib < 1:
        fail(PROG, "sentences must be >= 11 (top-10 retrieval) and calib >= 1")
    if args.out:  # '' skips writing
        try:
            check_output_file("out", args.out)
        except ConfigError as e:
            fail(PROG, str(e))
    minilm, minilm_fidelity = startup.begin("experiments.pretrained.minilm",
                                            "experiments.pretrained.minilm_fidelity", devices=1)
    try:
        texts = minilm.stdlib_sentences(args.sentences)
        calib = minilm.stdlib_sentences(args.calib, offset=args.sentences)
    except ValueError as e:
        fail(PROG, str(e))
    out = minilm_fidelity.fidelity(modes, texts, calib)
    if args.out:
        write_result(args.out, out)
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
