"""Our Gemma 3 270M against transformers reading the same GGUF, on every text of the fixture.

  python -m experiments.parity_gemma3        # writes results/gemma3_parity.json

Reads the fixture experiments/reference/make_gemma3_reference.py wrote (tests/fixtures/
gemma3_270m_reference.json: per text transformers' token ids, mean NLL and greedy next token),
encodes and scores the same texts with the project's tokenizer and float32 model
(`--model gemma3-270m`), and records how far apart they are, the texts past the 512-token
sliding window counted apart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.reporting.results_io import results_path, write_result
from model.gguf import GGUFError

PROG = "experiments.parity_gemma3"
FIXTURE = Path(__file__).parent.parent / "tests" / "fixtures" / "gemma3_270m_reference.json"


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixture", default=str(FIXTURE))
    p.add_argument("--out", default=str(results_path("gemma3_parity.json")))
    args = p.parse_args(argv)
    try:
        ref = json.loads(Path(args.fixture).read_text(encoding="utf-8"))
        rows = ref["results"]
        texts, tokens = [r["text"] for r in rows], [r["tokens"] for r in rows]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(PROG, f"fixture={args.fixture!r}: not a reference fixture as "
                   f"make_gemma3_reference.py writes it ({type(e).__name__})")
    try:
        check_output_file("out", args.out)
    except ConfigError as e:
        fail(PROG, str(e))
    loading, scoring = startup.begin("experiments.pretrained.loading",
                                     "experiments.pretrained.scoring", devices=1)
    try:
        pre = loading.load("gemma3-270m")
    except GGUFError as e:
        fail(PROG, str(e))
    ours = scoring.score_ids(pre, tokens)
    window = pre.cfg.sliding_window
    diffs = [abs(o["mean_nll"] - r["mean_nll"]) for o, r in zip(ours, rows, strict=True)]
    long = [d for d, t in zip(diffs, tokens, strict=True) if len(t) > window]
    out = {"model": "gemma3-270m", "gguf_sha256": ref.get("gguf_sha256"),
           "reference_transformers": ref.get("transformers"), "texts": len(rows),
           "texts_past_window": len(long), "sliding_window": window,
           "longest_tokens": max(map(len, tokens)),
           "ids_identical": sum(pre.tokenizer.encode(t) == ids
                                for t, ids in zip(texts, tokens, strict=True)),
           "next_identical": sum(o["next_token"] == r["next_token"]
                                 for o, r in zip(ours, rows, strict=True)),
           "max_abs_nll_diff": max(diffs), "mean_abs_nll_diff": sum(diffs) / len(diffs),
           "max_abs_nll_diff_past_window": max(long) if long else None}
    write_result(args.out, out)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
