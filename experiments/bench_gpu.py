"""Accelerator benchmark: training MFU of a ~1B-parameter decoder (dp and zero3) and the int8
matmul rate against bf16.

  python -m experiments.bench_gpu --json     # on a GPU: writes experiments/results/bench_gpu.json
  python -m experiments.bench_gpu --tiny     # the same code paths on tiny shapes (CPU is fine)

Training: the `1.3b` preset (d_model 2048, 26 layers, d_ff 8192, byte vocabulary: 1.31B
parameters), bf16 compute, full rematerialisation, AdamW with fp32 master weights, on one chip
with a global batch of 16 sequences of 2048 tokens (32k tokens per step). On one H200 (141 GB)
this fits with room to spare: parameters, gradients and both Adam moments are 16 bytes per
parameter (21 GB), the remat-saved block inputs are 26 x 32k x 2048 bf16 (3.5 GB), and one
block's recomputed activations (attention scores [16, 16, 2048, 2048] included) stay under
10 GB. MFU counts model FLOPs only (6 per parameter per token plus causal attention,
`model.flops`), against the chip's dense bf16 peak. Matmuls: s8 x s8 -> s32 against bf16 at
4096^3 and 8192^3, interleaved, with a check of the compiled int8 program (no operand widened).

Without a GPU it prints one line saying the GPU parts are skipped, writes a JSON file that
records why (never experiments/results/bench_gpu.json) and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax

from experiments import accel_bench
from experiments.config import ConfigError, fail
from experiments.machine import describe
from experiments.results_io import results_path, write_result
from model import MODEL_PRESETS

PROG = "experiments.bench_gpu"
OUT = results_path("bench_gpu.json")  # GPU figures only
NOT_GPU_OUT = results_path("bench_gpu_not_gpu.json")  # a skip record or a --tiny run (ignored)
STRATEGIES = ("dp", "zero3")
FULL = {"preset": "1.3b", "global_batch": 16, "seq_len": 2048, "steps": 5, "warmup": 2,
        "matmuls": (4096, 8192), "matmul_repeats": 10}
TINY = {"preset": "tiny", "global_batch": 2, "seq_len": 32, "steps": 2, "warmup": 1,
        "matmuls": (64, 128), "matmul_repeats": 2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes through the same code paths (runs on CPU, for tests)")
    p.add_argument("--out", default=None,
                   help=f"results file (default {OUT.name} on a GPU, {NOT_GPU_OUT.name} "
                        f"otherwise)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON last")
    return p


def measure(shape: dict) -> dict:
    cfg = dataclasses.replace(MODEL_PRESETS[shape["preset"]], compute_dtype="bfloat16",
                              remat="full")
    training = [accel_bench.train_mfu(cfg, s, shape["global_batch"], shape["seq_len"],
                                      shape["steps"], shape["warmup"]) for s in STRATEGIES]
    for row in training:
        print(json.dumps({k: row[k] for k in ("strategy", "step_s", "tokens_per_s", "mfu")}),
              flush=True)
    matmuls = [accel_bench.matmul_ratio(n, shape["matmul_repeats"]) for n in shape["matmuls"]]
    return {"preset": shape["preset"], "training": training, "matmuls": matmuls}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    backend = jax.default_backend()
    out = {"machine": {**describe(), "load_1min": os.getloadavg()[0]},
           "command": "python -m experiments.bench_gpu --json"}
    if backend != "gpu" and not args.tiny:
        reason = f"no GPU (JAX backend {backend}): the GPU parts are skipped"
        out.update(skipped=True, reason=reason)
        path = args.out or NOT_GPU_OUT
        write_result(path, out)
        print(f"{PROG}: {reason}; wrote {path}")
        return out
    try:
        if args.out and os.path.abspath(args.out) == str(OUT) and (args.tiny or
                                                                   backend != "gpu"):
            raise ConfigError(f"out={args.out}: {OUT.name} holds GPU figures of the full "
                              f"shapes only; give another path")
        shape = TINY if args.tiny else FULL
        out.update(skipped=False, tiny=args.tiny, shape={k: list(v) if isinstance(v, tuple)
                                                         else v for k, v in shape.items()},
                   **measure(shape))
    except ConfigError as e:
        fail(PROG, str(e).splitlines()[0])
    out["seconds"] = time.perf_counter() - t0
    path = args.out or (OUT if backend == "gpu" and not args.tiny else NOT_GPU_OUT)
    write_result(path, out)
    summary = {"mfu": {r["strategy"]: r["mfu"] for r in out["training"]},
               "tokens_per_s": {r["strategy"]: round(r["tokens_per_s"]) for r in out["training"]},
               "int8_speedup_vs_bf16": {r["n"]: round(r["int8_speedup_vs_bf16"], 2)
                                        for r in out["matmuls"]},
               "hlo_keeps_s8": all(r["hlo_keeps_s8"] for r in out["matmuls"]),
               "seconds": round(out["seconds"], 1), "written": str(path)}
    print(json.dumps(summary) if args.json else summary)
    sys.stdout.flush()
    return out


if __name__ == "__main__":
    main()
