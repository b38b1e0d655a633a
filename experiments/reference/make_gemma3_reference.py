"""Write tests/fixtures/gemma3_270m_reference.json: transformers reading the same Gemma 3 270M
GGUF as `--model gemma3-270m` (its own GGUF reader and tokenizer, float32, eager attention),
per text the token ids, the mean NLL over positions 1..n-1 and the greedy next token.

Run with the separate PyTorch interpreter (never imported by the project):

  /work/refvenv/bin/python experiments/reference/make_gemma3_reference.py \\
      --gguf ~/.cache/shardq/gemma3-270m/gemma-3-270m-q4_k_m.gguf

The texts are standard-library docstrings (deterministic for a Python version): short ones and
several longer than the model's 512-token sliding window, so that the global layers and the
window both shape the scores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from reference_scoring import score  # noqa: E402

SHORT = 26  # texts of one docstring paragraph
LONG = 6  # texts past the sliding window
LONG_TOKENS = (600, 900)  # the long texts' length range in tokens


def docstrings() -> list[str]:
    import collections
    import json as json_module
    import os
    import pathlib
    import string
    import textwrap
    out = []
    for mod in (os, pathlib, textwrap, json_module, collections, string):
        for name in sorted(dir(mod)):
            doc = getattr(getattr(mod, name), "__doc__", None)
            if isinstance(doc, str) and len(doc.strip()) > 40:
                out.append(doc.strip())
    return list(dict.fromkeys(out))


def texts(tok) -> list[str]:
    docs = docstrings()
    short = [d.split("\n\n")[0] for d in docs[:SHORT]]
    long, current = [], ""
    for d in docs[SHORT:]:
        current = f"{current}\n\n{d}" if current else d
        n = len(tok(current, add_special_tokens=False).input_ids)
        if n >= LONG_TOKENS[0]:
            if n <= LONG_TOKENS[1]:
                long.append(current)
            current = ""
        if len(long) == LONG:
            break
    return ["The capital of France is", "def add(a, b):\n    return a + b", *short, *long]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--out", default="tests/fixtures/gemma3_270m_reference.json")
    args = p.parse_args()
    path = Path(args.gguf).expanduser()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    rows = []
    chosen = texts(tok)
    ids = [tok(t).input_ids for t in chosen]
    for text, t_ids, r in zip(chosen, ids, score(model, ids), strict=True):
        rows.append({"text": text, "tokens": t_ids, **r})
        print(len(t_ids), round(r["mean_nll"] or 0, 4), r["next_token"], flush=True)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    Path(args.out).write_text(json.dumps({
        "gguf_sha256": sha, "transformers": transformers.__version__,
        "sliding_window": model.config.sliding_window,
        "layer_types": model.config.layer_types, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
