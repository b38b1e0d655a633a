"""int8 vs float: matmul throughput on several shapes, and end-to-end decoding tokens/s.

  python -m experiments.bench_int8 --json
  python -m experiments.bench_int8 --preset medium --json     # bigger model, for a GPU
                                    # (on a GPU/TPU the 4096^3 and 8192^3 matmuls are added)

Matmuls: float32 and bfloat16 dots, the bare int8 x int8 -> int32 dot (with the int8 kernel
stored [out, in], as QuantDense stores it, and in the float layout [in, out] beside it: what
the stored layout buys), the whole int8 Dense product (per-token activation quantisation +
int32 dot + dequantisation), and the LLM.int8() Dense (the same plus a float product over the
1/16 of input columns allowed to be outliers, with 8 of them hot). Ratios are against float32
and against bfloat16 (an H200 has about twice the int8 rate of bf16: the bf16 ratio on large
shapes says how close we get). Decoding: greedy
generation with a KV cache, float vs w8 (weight-only) vs w8a8 on a randomly initialised model
(speed does not depend on the weights' values; w8/w8a8 need no calibration). Runs unchanged on
CPU or GPU and reports the backend and device kind. Writes experiments/results/int8_bench.json.

A CPU gains from int8 only where it has int8 dot instructions (AVX512-VNNI, AMX: the JSON
records the CPU flags it found); on a GPU the int8 dot wins on large shapes, and batch-1
decoding gains mainly from moving fewer bytes.
"""

from __future__ import annotations

import argparse
import json

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.reporting.results_io import results_path, write_result

PROG = "experiments.bench_int8"
OUT = results_path("int8_bench.json")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="model shape for decoding: tiny, small, "
                                                     "medium")
    p.add_argument("--batch", type=int, default=1, help="decoding batch (sequences)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20, help="best of this many timed calls")
    p.add_argument("--big", action="store_true",
                   help="add 4096^3 and 8192^3 matmuls (always on with an accelerator)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.preset not in ("tiny", "small", "medium"):
        fail(PROG, f"preset={args.preset!r}: allowed tiny, small, medium")
    for name in ("batch", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            fail(PROG, f"{name}={getattr(args, name)}: must be a positive integer")
    try:
        check_output_file("out", args.out)
    except ConfigError as e:
        fail(PROG, str(e))
    (int8_speed,) = startup.load("experiments.speed.int8_speed")
    out = int8_speed.measure(args.preset, args.batch, args.new_tokens, args.repeats, args.big)
    write_result(args.out, out)
    summary = {"backend": out["backend"], "device_kind": out["device_kind"],
               **{f"{name}_speedup_vs_{ref}": {f"{r['m']}x{r['k']}x{r['n']}":
                                                round(r[f"{name}_speedup_vs_{ref}"], 2)
                                                for r in out["matmuls"]}
                  for name, ref in (("int8_dot", "bf16"), ("int8_dense", "f32"),
                                    ("int8_outlier_dense", "f32"))},
               "kmajor_speedup": {f"{r['m']}x{r['k']}x{r['n']}": round(r["kmajor_speedup"], 2)
                                  for r in out["matmuls"]},
               "int8_layouts_equal": all(r["int8_layouts_equal"] for r in out["matmuls"]),
               "decode_tokens_per_s": {r["mode"]: round(r["tokens_per_s"], 1)
                                       for r in out["decoding"]},
               "written": args.out}
    print(json.dumps(summary) if args.json else summary)
    return out


if __name__ == "__main__":
    main()
