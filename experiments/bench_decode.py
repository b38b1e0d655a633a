"""Batch-1 greedy decoding speed of SmolLM2-135M-Instruct: float, int8 weights, int8 KV cache.

  python -m experiments.bench_decode --json       # writes experiments/results/bench_decode.json
  python -m experiments.bench_decode --variants float,w8 --new-tokens 32 --repeats 3

Each variant decodes `--new-tokens` tokens after the same prompt (the first 400 characters of
the validation topics): one jitted `lax.scan` over the tokens, the prefill excluded, timed
`--repeats` times with the variants interleaved; the median is reported with the per-token
latency and the bytes of weights every token reads. Besides the main variants
(float, w8, w8a8, float + int8 cache, w8 + int8 cache, and w8a8-rotated, which pays for its
input rotations at every step, each in the layer layout
`model.generate` picks by default) the other layout of float, w8 and w8a8 is timed too, so the
file records what the per-layer layout changes, measured in the same run. The machine and
its load average are recorded beside.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.pretrained import model_ref
from experiments.reporting.results_io import command_line, results_path, write_result
from model.gguf import GGUFError
from quant.modes import QuantConfig, QuantError

PROG = "experiments.bench_decode"
OUT = results_path("bench_decode.json")
# name -> (int8 mode, int8 KV cache, layer layout (None: model.generate's default: per-layer
# for float weights, the layer scan for int8 ones), tied head/embedding in int8 too)
VARIANTS = {
    "float": ("none", False, None, False),
    "w8": ("w8", False, None, False),
    "w8a8": ("w8a8", False, None, False),
    "float+kv8": ("none", True, None, False),
    "w8+kv8": ("w8", True, None, False),
    "w8a8+head8": ("w8a8", False, None, True),
    "w8a8-rotated": ("w8a8-rotated", False, None, False),
    "float-scan": ("none", False, False, False),
    "w8-per-layer": ("w8", False, True, False),
    "w8a8-per-layer": ("w8a8", False, True, False),
}
# (what changed, variant before, variant after): ratios the results file records
CHANGES = (
    ("per-layer weights instead of the stacked layer scan (float)", "float-scan", "float"),
    ("per-layer weights instead of the stacked layer scan (w8)", "w8", "w8-per-layer"),
    ("per-layer weights instead of the stacked layer scan (w8a8)", "w8a8", "w8a8-per-layer"),
    ("int8 weights (w8) against float", "float", "w8"),
    ("int8 weights and activations (w8a8) against float", "float", "w8a8"),
    ("int8 KV cache (float weights)", "float", "float+kv8"),
    ("int8 KV cache (w8 weights)", "w8", "w8+kv8"),
    ("tied head (49152 x 576 table) in int8 too (w8a8)", "w8a8", "w8a8+head8"),
    ("rotated int8 inputs (w8a8-rotated against w8a8)", "w8a8", "w8a8-rotated"),
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
    p.add_argument("--model", default="smollm2", metavar="REF",
                   help=f"the model: {model_ref.ALLOWED} (default: smollm2)")
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N blocks (a truncated model, for quick checks)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--json", action="store_true", help="print the summary as JSON last")
    return p


def check(args) -> list[str]:
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise ConfigError(f"variants={args.variants!r}: allowed a comma-separated subset of "
                          f"{', '.join(VARIANTS)}")
    for name in ("new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"{name}={getattr(args, name)}: must be a positive integer")
    if args.layers is not None and args.layers < 1:
        raise ConfigError(f"layers={args.layers}: must be a positive integer")
    model_ref.resolve(args.model)
    check_output_file("out", args.out)
    return names


def run(args, names: list[str]) -> dict:
    loading, decoding, pydoc_corpus, block_matvec, machine = startup.load(
        "experiments.pretrained.loading", "experiments.pretrained.decoding",
        "experiments.training.pydoc_corpus", "experiments.speed.block_matvec",
        "experiments.speed.machine")
    load_before = os.getloadavg()[0]
    float_model = loading.load(args.model, n_layers=args.layers)
    # w8 and w8a8 weights do not depend on calibration (it only fills their error report).
    models = {}
    for mode, head in sorted({(VARIANTS[n][0], VARIANTS[n][3]) for n in names}):
        rules = ("blocks/*", "embed") if head else ("blocks/*",)
        models[mode, head] = loading.quantize(
            float_model, mode, QuantConfig(mode=mode, rules=rules, calib_batches=1))
    variants = [decoding.DecodeVariant(n, models[VARIANTS[n][0], VARIANTS[n][3]],
                                       VARIANTS[n][1], VARIANTS[n][2]) for n in names]
    prompt = float_model.tokenizer.encode(pydoc_corpus.split_text("validation")[:400])
    rows = decoding.decode_benchmark(variants, prompt, args.new_tokens, args.repeats)
    matvec = block_matvec.matvec_check(float_model.cfg, args.repeats)
    by_name = {r["variant"]: r for r in rows}
    changes = [{"change": what, "before": a, "after": b,
                "speedup": by_name[b]["tokens_per_s"] / by_name[a]["tokens_per_s"]}
               for what, a, b in CHANGES if a in by_name and b in by_name]
    return {"model": float_model.name, "layers": float_model.cfg.n_layers,
            "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
            "repeats": args.repeats, "variants": rows, "changes": changes,
            "block_matvec": matvec,
            "machine": {**machine.describe(), "load_1min_before": load_before,
                        "load_1min_after": os.getloadavg()[0]}}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        names = check(args)
        out = {**run(args, names), "command": command_line(PROG, argv)}
    except (ConfigError, GGUFError, QuantError) as e:
        fail(PROG, str(e).splitlines()[0])
    write_result(args.out, out)
    summary = {"tokens_per_s": {r["variant"]: round(r["tokens_per_s"], 1)
                                for r in out["variants"]},
               "changes": {c["change"]: round(c["speedup"], 2) for c in out["changes"]},
               "load_1min": round(out["machine"]["load_1min_after"], 1), "written": args.out}
    print(json.dumps(summary) if args.json else summary)
    return out


if __name__ == "__main__":
    main()
