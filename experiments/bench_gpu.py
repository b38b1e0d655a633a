"""Accelerator benchmark: training MFU of a ~1B-parameter decoder under several step
variants, and the int8 matmul rate against bf16.

  python -m experiments.bench_gpu --json     # on a GPU: writes experiments/results/bench_gpu.json
  python -m experiments.bench_gpu --tiny     # the same code paths on tiny shapes (CPU is fine)
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m experiments.bench_gpu \\
      --parts training,matmuls --variants dp/full/xla,dp/save_dots/cudnn \\
      --out experiments/results/bench_gpu_no_triton.json   # the same without Triton GEMMs

Training: the `1.3b` preset (d_model 2048, 26 layers, d_ff 8192, byte vocabulary: 1.31B
parameters), bf16 compute, AdamW with fp32 master weights, on one chip with a global batch of 16
sequences of 2048 tokens (32k tokens per step). Each variant is a (strategy, remat policy,
attention) triple (VARIANTS): full rematerialisation with XLA's attention is the baseline;
`save_dots` keeps the matmul outputs instead of recomputing them; `cudnn` attention is the fused
flash kernel (the [2048, 2048] scores per head never reach memory). On one H200 (141 GB) the
baseline fits with room to spare: parameters, gradients and both Adam moments are 16 bytes per
parameter (21 GB), the remat-saved block inputs 26 x 32k x 2048 bf16 (3.5 GB). `save_dots` adds
the matmul outputs (about 1.5 GB per block); remat `none` keeps everything and may not fit: a
variant that fails (out of memory, a kernel the chip lacks) is recorded with its error and the
others still run. MFU counts model FLOPs only (6 per parameter per token plus causal attention,
`model.flops`), against the chip's dense bf16 peak. Matmuls: s8 x s8 -> s32 against bf16 at
4096^3 to 16384^3, interleaved, with a check of the compiled int8 program (no operand widened)
and the GEMM implementation XLA picked for each. Inference: one forward pass (every position's
logits, as scoring and prefill compute them) of the same 1.3b model over 8 x 2048 tokens, in
bf16 and in its int8 forms `w8` and `w8a8` (quant/, no calibration needed), tokens/s. Decode:
batch-1 greedy decoding and one window's prefill of SmolLM2 and the same 1.3b model, bf16
against w8 and w8a8 (experiments/speed/gpu_decode.py).

The results file is rewritten after every variant (`complete` false until the end), so a run cut
short keeps what it measured. Without a GPU it prints one line saying the GPU parts are
skipped, writes a JSON file that records why (never experiments/results/bench_gpu.json) and
exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.reporting import plots
from experiments.reporting.results_io import command_line, results_path, write_result
from model.config import ATTENTION_IMPLS, REMAT_NAMES
from parallel.strategies import LABELS as STRATEGY_LABELS

PROG = "experiments.bench_gpu"
OUT = results_path("bench_gpu.json")  # GPU figures only
# The committed file of GPU figures: never replaced by a tiny or partial run (a quick
# reproduction's own folder, $SHARDQ_RESULTS_DIR, may hold one under the same name).
COMMITTED = Path(__file__).with_name("results") / OUT.name
NOT_GPU_OUT = results_path("bench_gpu_not_gpu.json")  # a skip record or a --tiny run (ignored)
PARTS = ("attention", "training", "matmuls", "inference", "decode")
# (strategy, remat, attention) per training variant the GPU benchmark times; the first two are
# the baseline (full rematerialisation, XLA's attention).
VARIANTS = (("dp", "full", "xla"), ("zero3", "full", "xla"), ("dp", "full", "cudnn"),
            ("dp", "save_dots", "xla"), ("dp", "save_dots", "cudnn"),
            ("zero3", "save_dots", "cudnn"), ("dp", "none", "cudnn"))
FULL = {"preset": "1.3b", "global_batch": 16, "seq_len": 2048, "steps": 5, "warmup": 2,
        "matmuls": (4096, 8192, 16384), "matmul_repeats": 10,
        "inference_batch": 8, "decode_pretrained": "smollm2", "decode_preset": "1.3b",
        "decode_prompt": 128, "decode_tokens": 128, "decode_window": 512, "decode_repeats": 5}
TINY = {"preset": "tiny", "global_batch": 2, "seq_len": 32, "steps": 2, "warmup": 1,
        "matmuls": (64, 128), "matmul_repeats": 2, "inference_batch": 2,
        # the pretrained model only: a preset's rows run the same code, and cost a compile each
        "decode_pretrained": "smollm2", "decode_layers": 2, "decode_preset": None,
        "decode_prompt": 8, "decode_tokens": 8, "decode_window": 16, "decode_repeats": 2}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes through the same code paths (runs on CPU, for tests)")
    p.add_argument("--out", default=None,
                   help=f"results file (default {OUT.name} on a GPU, {NOT_GPU_OUT.name} "
                        f"otherwise)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: all; the "
                        f"attention check runs on a GPU only)")
    p.add_argument("--variants", default=None,
                   help="comma-separated training variants as strategy/remat/attention "
                        "(default: the VARIANTS table, " + ", ".join("/".join(v) for v in VARIANTS)
                        + ")")
    p.add_argument("--replot", default=None, metavar="RESULTS",
                   help="draw the plot of an existing results file (beside it, .png) and exit")
    p.add_argument("--json", action="store_true", help="print the summary as JSON last")
    return p


def parse_parts(text: str) -> tuple[str, ...]:
    """The named parts in PARTS's order; an empty, unknown or repeated name is refused."""
    items = [p.strip() for p in text.split(",")]
    if any(p not in PARTS for p in items) or len(set(items)) != len(items):
        raise ConfigError(f"parts={text!r}: allowed a comma-separated subset of {', '.join(PARTS)}"
                          f", each at most once")
    return tuple(p for p in PARTS if p in items)


def parse_variants(text: str | None) -> tuple[tuple[str, str, str], ...]:
    if text is None:
        return VARIANTS
    allowed = (STRATEGY_LABELS, REMAT_NAMES, ATTENTION_IMPLS)
    variants = tuple(tuple(v.strip().split("/")) for v in text.split(","))
    if len(set(variants)) != len(variants):
        raise ConfigError(f"variants={text!r}: each variant at most once")
    for v in variants:
        if len(v) != 3 or any(x not in ok for x, ok in zip(v, allowed, strict=True)):
            raise ConfigError(f"variants={text!r}: each is strategy/remat/attention with strategy "
                              f"in {', '.join(STRATEGY_LABELS)}, remat in "
                              f"{', '.join(REMAT_NAMES)}, attention in "
                              f"{', '.join(ATTENTION_IMPLS)}")
    return variants


def summarise(out: dict, path) -> dict:
    ran = [r for r in out["training"] if "step_s" in r]
    return {"mfu": {f"{r['strategy']}/{r['remat']}/{r['attention']}": r["mfu"] for r in ran},
            "tokens_per_s": {f"{r['strategy']}/{r['remat']}/{r['attention']}":
                             round(r["tokens_per_s"]) for r in ran},
            "not_run": {f"{r['strategy']}/{r['remat']}/{r['attention']}":
                        r.get("error") or r.get("skipped")
                        for r in out["training"] if "step_s" not in r},
            "int8_speedup_vs_bf16": {r["n"]: round(r["int8_speedup_vs_bf16"], 2)
                                     for r in out["matmuls"]},
            "hlo_keeps_s8": (all(r["hlo_keeps_s8"] for r in out["matmuls"])
                             if out["matmuls"] else None),
            "prefill_tokens_per_s": {r["mode"]: round(r["tokens_per_s"]) for r in out["inference"]},
            "decode_tokens_per_s": {f"{r['model']}/{r['form']}": round(r["decode_tokens_per_s"], 1)
                                    for r in out.get("decode", [])},
            "seconds": round(out["seconds"], 1), "written": str(path)}


def plot_path(results_path) -> Path:
    return Path(results_path).with_suffix(".png")


def replot(results_file: str) -> dict:
    """The plot of a results file this launcher wrote, drawn again (on any machine)."""
    try:
        data = json.loads(Path(results_file).read_text())
        if not isinstance(data, dict) or data.get("skipped") is not False or \
                not isinstance(data.get("training"), list) or \
                not isinstance(data.get("matmuls"), list):
            raise ValueError("not the results of a bench_gpu run that measured something")
        if not data["training"] or not data["matmuls"]:
            raise ValueError("the plot needs training and matmul rows; this run has "
                             f"{len(data['training'])} and {len(data['matmuls'])}")
        path = plots.gpu_benchmark(data, plot_path(results_file))
    except (OSError, ValueError, TypeError, KeyError) as e:  # a file that is not a whole run
        fail(PROG, f"replot={results_file!r}: {type(e).__name__}: {str(e).splitlines()[0]}")
    print(f"wrote {path}")
    return data


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.replot:
        return replot(args.replot)
    t0 = time.perf_counter()
    try:  # the flags first: a refusal does not wait for the backend
        parts = parse_parts(args.parts)
        variants = parse_variants(args.variants)
        partial = parts != PARTS or variants != VARIANTS
        if args.out and Path(args.out).resolve() == COMMITTED.resolve() and (args.tiny
                                                                             or partial):
            raise ConfigError(f"out={args.out}: {OUT.name} holds GPU figures of the full "
                              f"shapes, every part and variant only; give another path")
        if partial and not args.out and not args.tiny:
            raise ConfigError(f"parts/variants: a run of some parts or variants needs --out "
                              f"({OUT.name} holds the whole run)")
        if args.out:
            check_output_file("out", args.out)
    except ConfigError as e:
        fail(PROG, str(e).splitlines()[0])
    # Read before the backend starts: the GPU runtime's flag parser moves XLA_FLAGS into argv.
    argv = list(sys.argv[1:] if argv is None else argv)
    xla_flags = os.environ.get("XLA_FLAGS", "")
    jax, accel_bench, machine = startup.load("jax", "experiments.speed.gpu",
                                             "experiments.speed.machine")
    backend = jax.default_backend()
    if args.out and Path(args.out).resolve() == COMMITTED.resolve() and backend != "gpu":
        fail(PROG, f"out={args.out}: {OUT.name} holds GPU figures only; give another path")
    out = {"machine": {**machine.describe(), "load_1min": os.getloadavg()[0],
                       "xla_flags": xla_flags},
           "command": command_line(PROG, argv, {"XLA_FLAGS": xla_flags} if xla_flags else None),
           "date": time.strftime("%Y-%m-%d", time.gmtime())}
    if backend != "gpu" and not args.tiny:
        reason = f"no GPU (JAX backend {backend}): the GPU parts are skipped"
        out.update(skipped=True, reason=reason)
        path = args.out or NOT_GPU_OUT
        write_result(path, out)
        print(f"{PROG}: {reason}; wrote {path}")
        if args.json:
            print(json.dumps({"skipped": True, "reason": reason, "written": str(path)}))
        return out
    shape = TINY if args.tiny else FULL
    path = args.out or (OUT if backend == "gpu" and not args.tiny else NOT_GPU_OUT)
    out.update(skipped=False, tiny=args.tiny, parts=list(parts),
               shape={k: list(v) if isinstance(v, tuple) else v for k, v in shape.items()})
    accel_bench.measure(shape, parts, variants, out, path)
    out["seconds"] = time.perf_counter() - t0
    write_result(path, out)
    if out["training"] and out["matmuls"]:
        plots.gpu_benchmark(out, plot_path(path))
    summary = summarise(out, path)
    print(json.dumps(summary) if args.json else summary)
    sys.stdout.flush()
    return out


if __name__ == "__main__":
    main()
