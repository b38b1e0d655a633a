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
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from experiments.cli import model_flags, runtime
from experiments.cli.config import (
    ConfigError,
    Parser,
    check_devices,
    check_output_file,
    check_replaceable_folder,
    fail,
)
from experiments.pretrained import loading, scoring
from experiments.pretrained.loading import Pretrained
from experiments.reporting.results_io import project_relative, results_path, write_result
from model.flops import param_bytes
from model.gguf import GGUFError
from parallel.mesh import make_mesh
from parallel.state import place_model_params
from parallel.strategies import get_strategy
from quant import checkpoint as qckpt
from quant.convert import MODES, QuantConfig, QuantError
from quant.stored import is_stored, quantize_with_meta, save_atomic

PROG = "experiments.llm_int8_checkpoint"
OUT = results_path("smollm2_int8_checkpoint.json")
TEXTS = ("The capital of France is Paris, and the capital of Italy is Rome.",
         "def add(a, b):\n    return a + b\n",
         "In 1969, Apollo 11 landed 2 astronauts on the Moon.",
         "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


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
            check_replaceable_folder("out", args.out, "an int8 checkpoint", is_stored)
        runtime.start(args.devices)
        result = run(args, qcfg)
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


def run(args, qcfg: QuantConfig) -> dict:
    pre = loading.load(args.model)
    rows = loading.calibration_rows(pre.tokenizer, qcfg.calib_batches)
    qdef, qparams, plan, report, meta = quantize_with_meta(
        pre.graphdef, pre.params, qcfg, rows, pre.cfg,
        {"source": "pydoc_data train topics", "rows": len(rows)})
    work = Path(tempfile.mkdtemp(prefix="shardq-int8-"))
    try:
        target = Path(args.out) if args.out else work / args.mode
        save_atomic(target, qparams, meta, report)
        int8_bytes = qckpt.disk_bytes(target / "ckpt")
        float_bytes = qckpt.save_float_reference(work / "float", jax.device_get(pre.params))
        mesh = make_mesh(args.devices)
        gdef, sharded, _ = qckpt.load(target, pre.cfg, mesh, sharded=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the float copy, and the int8 one unless --out
    texts = list(TEXTS)
    identical = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
        jax.tree.leaves(jax.device_get(sharded)), jax.tree.leaves(jax.device_get(qparams)),
        strict=True))
    local = Pretrained(pre.name, pre.cfg, qdef, qparams, pre.tokenizer, args.mode)
    remote = Pretrained(pre.name, pre.cfg, gdef, sharded, pre.tokenizer, args.mode)
    # The in-memory int8 parameters put in the reloaded ones' zero3 shards: the same program
    # as the reload, so any difference would be the checkpoint's.
    placed = jax.tree.map(lambda x, ref: jax.device_put(x, ref.sharding), qparams, sharded)
    in_layout = Pretrained(pre.name, pre.cfg, gdef, placed, pre.tokenizer,
                                         args.mode)
    # ... and replicated on every device of the mesh: the 8-device program without shards.
    replicated = Pretrained(
        pre.name, pre.cfg, gdef, place_model_params(gdef, qparams, mesh, get_strategy("dp")),
        pre.tokenizer, args.mode)
    a, b, c, r = (scoring.score_texts(m, texts)
                  for m in (local, remote, in_layout, replicated))
    # The float model through the same two programs (one device; zero3 over the mesh): how much
    # the layout alone moves a score when no rounding to int8 follows.
    float_sharded = place_model_params(pre.graphdef, pre.params, mesh, get_strategy("zero3"))
    f1 = scoring.score_texts(pre, texts)
    f8 = scoring.score_texts(Pretrained(
        pre.name, pre.cfg, pre.graphdef, float_sharded, pre.tokenizer, "none"), texts)
    float_params = param_bytes(pre.params)
    one_device = _compare(a, b)
    result = {"model": pre.name, "mode": args.mode, "rules": list(qcfg.rules),
              "int8_disk_bytes": int8_bytes, "float32_param_bytes": float_params,
              "disk_ratio": float_params / int8_bytes, "float32_disk_bytes": float_bytes,
              "disk_ratio_vs_float_checkpoint": float_bytes / int8_bytes, "devices": args.devices,
              "strategy": "zero3", "texts": len(TEXTS),
              "params_bit_identical": identical,
              "reload_vs_in_memory_same_layout": _compare(c, b),
              "zero3_vs_one_device": one_device,
              "replicated_vs_one_device": _compare(a, r),
              "float_zero3_vs_one_device": _compare(f1, f8),
              **one_device,  # the single-device comparison, kept under its former names
              "checkpoint": project_relative(target) if args.out else None}
    write_result(args.json_out, result)
    return result


def _compare(a: list[dict], b: list[dict]) -> dict:
    return {"max_abs_nll_diff": max(abs(x["mean_nll"] - y["mean_nll"])
                                    for x, y in zip(a, b, strict=True)),
            "next_tokens_identical": all(x["next_token"] == y["next_token"]
                                         for x, y in zip(a, b, strict=True))}


if __name__ == "__main__":
    main()
