"""Write Hugging Face folders of published decoders' shapes with random weights, for timing
batch-1 decoding on models larger than SmolLM2 (`experiments.bench_decode --model DIR`, with
llama.cpp beside it on our GGUF export of the same folder). Decoding speed depends on the
shapes, not on the weights' values.

Run with the separate PyTorch interpreter (never imported by the project):

  python -m experiments.export --model smollm2 --format safetensors --out runs/smollm2_hf
  /work/refvenv/bin/python experiments/reference/make_shape_models.py \
      --tokenizer runs/smollm2_hf --out runs/shapes

Each folder holds the named model's architecture and sizes as its published config.json gives
them (layers, widths, heads, key/value heads, head size, vocabulary, tied head, RoPE), weights
drawn by transformers' own initialisation (seed 0, float32), and the tokenizer of `--tokenizer`
with the BOS and EOS ids of its config.json (SmolLM2's: its ids fit every vocabulary here; the
rows past it are never looked up).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

# The published configs' sizes (architecture, then its config.json fields).
SHAPES = {
    "llama3.2-1b": ("LlamaForCausalLM", transformers.LlamaConfig, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", transformers.Qwen2Config, dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write(name: str, tokenizer: Path, out: Path) -> Path:
    arch, config_class, fields = SHAPES[name]
    # the tokenizer folder's own special ids, so that generation stops where the tokenizer says
    source = json.loads((tokenizer / "config.json").read_text())
    special = {k: source[k] for k in ("bos_token_id", "eos_token_id") if k in source}
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config_class(**fields, **special)).to(torch.float32)
    folder = out / name
    model.save_pretrained(folder)
    for f in TOKENIZER_FILES:
        shutil.copy(tokenizer / f, folder / f)
    print(f"{folder}: {sum(p.numel() for p in model.parameters()):,} parameters")
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="a folder with tokenizer.json, tokenizer_config.json and config.json")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"comma-separated subset of {', '.join(SHAPES)}")
    args = p.parse_args()
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown or not names:
        print(f"--shapes: {','.join(unknown) or '(none)'} not among {', '.join(SHAPES)}",
              file=sys.stderr)
        return 2
    missing = [f for f in (*TOKENIZER_FILES, "config.json")
               if not (args.tokenizer / f).is_file()]
    if missing:
        print(f"--tokenizer: {str(args.tokenizer)!r} lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    for name in names:
        write(name, args.tokenizer, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
