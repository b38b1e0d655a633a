"""Export a trained run or a pretrained model to a Hugging Face folder or to GGUF.

  python -m experiments.export --workdir runs/ft --format safetensors --out exports/ft
  python -m experiments.export --model smollm2 --format safetensors --out exports/smollm2
  python -m experiments.export --model smollm2 --layers 2 --format gguf --out exports/s2
  python -m experiments.export --model smollm2 --quant smoothquant --format gguf --out exports/sq
  python -m experiments.export --model path/to/hf_folder --format gguf --out exports/mine

safetensors: DIR/model.safetensors (Hugging Face tensor names, [out, in] kernels, float32),
config.json of the model's family (llama, mistral, qwen2, qwen3, gemma3_text or phi3),
generation_config.json, tokenizer.json and tokenizer_config.json;
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load it. gguf: DIR/model.gguf (architecture llama or
gemma3; F32, llama.cpp's names and row order, the tokenizer's metadata); with --quant MODE (w8,
w8a8 or smoothquant, GGUF only) the model is quantised as our int8 commands quantise it, blocks
and embedding, and every int8 weight is written as Q8_0 (one block scale per row, the row's
scale in fp16; SmoothQuant's factors folded into the float norms and kernels), which llama.cpp
runs. Both also write shardq_export.json (what was exported); --record FILE keeps the summary. A
run (--workdir RUN, or --model RUN) is read one parameter at a time from its newest intact
checkpoint (or --step); a mixed-precision run exports its fp32 master weights. A Hugging Face
folder (--model FOLDER) is read one tensor at a time and exports to either format; to GGUF (llama,
qwen2, qwen3, or gemma3_text on Gemma 3's layer conventions) its tokenizer.json must be a
byte-level BPE whose pre-tokenizer llama.cpp names (GPT-2's regex, digits split first, Llama 3's or
Qwen2's regex), written as tokenizer.ggml.* keys; any other tokenizer is refused. A byte model's
tokenizer.json maps each UTF-8 byte to its own id. `--layers N` keeps the first N blocks. The
folder is written beside DIR and renamed into place; an existing non-empty DIR needs --force.
Prints a JSON summary last.
"""

from __future__ import annotations

import argparse
import json

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.pretrained.export_checks import Q8_MODES, check_out, check_quant, check_source
from experiments.reporting.results_io import write_result
from model.gguf import GGUFError
from model.llama_export import FORMATS
from quant.modes import QuantError

PROG = "experiments.export"


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None, help="a training run's folder")
    p.add_argument("--model", default=None, metavar="REF",
                   help="the model: smollm2, gemma3-270m, a .gguf file, a Hugging Face folder "
                        "(config.json + safetensors + tokenizer.json) or a training run's folder")
    p.add_argument("--step", type=int, default=None,
                   help="a training run's checkpoint step (default: the newest intact one)")
    p.add_argument("--quant", default="none", metavar="MODE",
                   help=f"int8 weights as Q8_0 (GGUF only): one of {', '.join(Q8_MODES)} "
                        f"(default none: float32)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    p.add_argument("--format", default="safetensors", help=f"one of {', '.join(FORMATS)}")
    p.add_argument("--out", default=None, help="folder to write (created)")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="also write the summary to FILE (e.g. experiments/results/NAME.json)")
    args = p.parse_args(argv)
    try:
        if (args.workdir is None) == (args.model is None):
            raise ConfigError("source: give exactly one of --workdir RUN or --model REF")
        if args.out is None:
            raise ConfigError("out: give the folder to write with --out DIR")
        if args.format not in FORMATS:
            raise ConfigError(f"format={args.format!r}: allowed {', '.join(FORMATS)}")
        check_source(args.model, args.layers, args.step, args.workdir, args.format)
        check_quant(args.quant, args.format)
        check_out(args.out, args.force)
        if args.record is not None:
            check_output_file("record", args.record, "the export summary")
        exporter, export_q8 = startup.begin("experiments.pretrained.exporter",
                                            "experiments.pretrained.export_q8", devices=1)
        source = (exporter.run_source(args.workdir, args.layers, args.step)
                  if args.workdir is not None else
                  exporter.pretrained_source(args.model, args.layers, args.step))
        exporter.check_format(args.format, source)  # before a long calibration
        if args.quant != "none":
            source = export_q8.quantized_source(source, args.quant)
        summary = exporter.export(source, args.format, args.out, args.force)
    except (ConfigError, GGUFError, QuantError) as e:
        fail(PROG, str(e).splitlines()[0])
    if args.record:
        write_result(args.record, summary)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
