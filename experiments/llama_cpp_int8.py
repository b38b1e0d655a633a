"""Our int8 models served by llama.cpp: perplexity and KL divergence from float32, as
llama.cpp's own `llama-perplexity` measures them, for llama.cpp's Q8_0 and ours.

  python -m experiments.llama_cpp_int8 --out experiments/results/llama_cpp_int8.json

The model (--model, default smollm2) is exported as float32 GGUF (ours), made Q8_0 by
llama.cpp's `llama-quantize`, and quantised by us under each --modes mode and exported as Q8_0
(`experiments.export --quant MODE --format gguf`). `llama-perplexity` reads the validation
topics of `pydoc_data` (the perplexity launcher's default text) in --chunks windows of --ctx
tokens with each file: the float32 export first, saving its logits, then every other file
against them (KL divergence in nats, the share of positions with the same most likely token).
Each row also has the file's bytes and sha256. The tools: --llama-cpp DIR or $SHARDQ_LLAMA_CPP
(a folder, or a llama.cpp build folder with bin/, holding llama-quantize and llama-perplexity;
docs/decoding_and_gpu.md says how to build them); without them there is nothing to measure
(exit 2). The files are made in a temporary folder, removed at the end (--keep DIR keeps them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import (
    ConfigError,
    Parser,
    check_output_file,
    check_output_folder,
    fail,
)
from experiments.pretrained.export_checks import Q8_MODES, check_source
from experiments.reporting.results_io import command_line, results_path, write_result
from experiments.speed import llama_cpp
from model.gguf import GGUFError
from quant.modes import QuantError

PROG = "experiments.llama_cpp_int8"
NEED = ("llama-quantize", llama_cpp.PERPLEXITY)


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", metavar="REF",
                   help="smollm2, gemma3-270m, a .gguf file or a training run's folder")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    p.add_argument("--modes", default=",".join(Q8_MODES),
                   help=f"comma-separated int8 modes, of {', '.join(Q8_MODES)}")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--chunks", type=int, default=8, help="windows read (default 8)")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help=f"llama.cpp's tools (default: ${llama_cpp.ENV})")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the GGUF files in DIR")
    p.add_argument("--out", default=str(results_path("llama_cpp_int8.json")))
    args = p.parse_args(argv)
    try:
        modes = tuple(m for m in args.modes.split(",") if m)
        bad = [m for m in modes if m not in Q8_MODES]
        if bad or not modes:
            raise ConfigError(f"modes={args.modes!r}: allowed a comma-separated list of "
                              f"{', '.join(Q8_MODES)}")
        if not 16 <= args.ctx <= 8192:
            raise ConfigError(f"ctx={args.ctx}: must be in 16..8192")
        if not 1 <= args.chunks <= 1024:
            raise ConfigError(f"chunks={args.chunks}: must be in 1..1024")
        check_source(args.model, args.layers)
        check_output_file("out", args.out)
        if args.keep is not None:
            check_output_folder("keep", args.keep, "the GGUF files")
        tools, skipped = llama_cpp.locate(args.llama_cpp, need=NEED)
        if tools is None:
            raise ConfigError(skipped.replace("peer rows skipped", "int8 rows cannot be "
                                                                    "measured"))
    except ConfigError as e:
        fail(PROG, str(e))
    (bench,) = startup.begin("experiments.pretrained.llama_cpp_int8", devices=1)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="shardq-q8-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        out = bench.measure(tools, args.model, modes, work, layers=args.layers, ctx=args.ctx,
                            chunks=args.chunks, threads=llama_cpp.cores(),
                            say=lambda s: print(f"{PROG}: {s}", flush=True))
    except (ConfigError, GGUFError, QuantError, llama_cpp.PeerError) as e:
        fail(PROG, str(e).splitlines()[0])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out["command"] = command_line(PROG, argv)
    write_result(args.out, out)
    print(json.dumps({k: v for k, v in out.items() if k != "int8"}))
    return out


if __name__ == "__main__":
    main()
