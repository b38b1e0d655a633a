"""The pretrained LLM's int8 checkpoint: size on disk against float32, and a zero3 reload.

  python -m experiments.llm_int8_checkpoint            # writes results/smollm2_int8_checkpoint.json
  python -m experiments.llm_int8_checkpoint --mode smoothquant --out runs/smollm2-int8

Quantises SmolLM2 with --mode under --rules (default: the blocks and the tied embedding/head,
so nothing large stays float), writes the Orbax int8 checkpoint (quant/checkpoint.py, the
layout `experiments.quantize` writes) and the float32 parameters in the same layout, and
compares their sizes: against the float32 parameters (4 bytes each), and against that float
checkpoint on disk (Orbax compresses it, and weights dequantised from Q4_1 blocks, 16 distinct
values per block, compress well). Then reads the int8 checkpoint back sharded over --devices
fake devices in the zero3 layout and scores texts with it (each layer gathered right before it
runs) and with the in-memory int8 model: put in the same zero3 shards (the same program, so the
scores must be bit-identical: that is the checkpoint's check) and on one device (a different
program: float rounding may differ, and per-token int8 can amplify it; the float model's scores
through the same two programs are recorded for scale).
"""

from __future__ import annotations

import argparse

from experiments.cli import model_flags, startup
from experiments.cli.config import (
    ConfigError,
    Parser,
    check_devices,
    check_output_file,
    check_output_folder,
    check_replaceable_folder,
    fail,
)
from experiments.reporting.results_io import results_path, write_result
from model.gguf import GGUFError
from quant.modes import MODES, QuantConfig, QuantError

PROG = "experiments.llm_int8_checkpoint"
OUT = results_path("smollm2_int8_checkpoint.json")


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help=f"one of {', '.join(model_flags.MODELS)}")
    p.add_argument("--mode", default="w8a8", help=f"one of {', '.join(MODES)}")
    p.add_argument("--rules", default="blocks/*,embed", help="modules to quantise")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices for the reload")
    p.add_argument("--out", default=None, help="keep the int8 checkpoint in this folder: new, "
                                               "empty or an earlier one, which is replaced "
                                               "(default: a temporary one)")
    p.add_argument("--json-out", default=str(OUT))
    args = p.parse_args(argv)
    try:
        if args.model not in model_flags.MODELS:
            raise ConfigError(f"model={args.model!r}: allowed {', '.join(model_flags.MODELS)}")
        check_devices(args.devices)
        check_output_file("json_out", args.json_out)
        qcfg = QuantConfig(mode=args.mode, rules=tuple(r for r in args.rules.split(",") if r))
        qcfg.validate()
        if args.out is not None:  # the checkpoint replaces the folder whole
            check_output_folder("out", args.out, "an int8 checkpoint")  # before JAX loads
            (stored,) = startup.load("quant.stored")  # is_stored's module imports JAX
            check_replaceable_folder("out", args.out, "an int8 checkpoint", stored.is_stored)
        (int8_checkpoint,) = startup.begin("experiments.pretrained.int8_checkpoint",
                                           devices=args.devices)
        result = int8_checkpoint.measure(args.model, qcfg, args.devices, args.out)
        write_result(args.json_out, result)
    except (ConfigError, GGUFError, QuantError) as e:
        fail(PROG, str(e).splitlines()[0])
    same = result["reload_vs_in_memory_same_layout"]
    print(f"{result['mode']}: {result['int8_disk_bytes'] / 1e6:.1f} MB on disk, "
          f"{result['disk_ratio']:.2f}x smaller than float32; zero3 reload over "
          f"{result['devices']} devices: parameters bit-identical "
          f"{result['params_bit_identical']}, scores against the in-memory model in the same "
          f"layout: max |d mean NLL| {same['max_abs_nll_diff']:.2e}, against one device "
          f"{result['max_abs_nll_diff']:.2e}")
    return result


if __name__ == "__main__":
    main()
