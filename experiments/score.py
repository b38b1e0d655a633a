"""Score texts with a pretrained LM: token ids, mean NLL and the greedy next token.

  python -m experiments.score --model smollm2 --json --text "The capital of France is"
  python -m experiments.score --model smollm2 --quant w8a8 --json --text A --text "B C"
  python -m experiments.score --model runs/ft --step 12 --json --text "def main():"

With --json the last line is {"results": [{"tokens": [ids], "mean_nll": x, "next_token": id},
...]}: `mean_nll` is the mean over positions 1..n-1 of -log p(token_i | tokens before it) in
nats (null for a one-token text), the text tokenized without BOS, and `next_token` the argmax
after the whole text. Without --json one line per text.
"""

from __future__ import annotations

import argparse
import json

from experiments.cli import model_flags, startup
from experiments.cli.config import ConfigError, Parser, check_text, fail
from experiments.pretrained import model_ref
from model.gguf import GGUFError
from quant.modes import QuantError

PROG = "experiments.score"


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags.add_model_flags(p)
    model_ref.add_step_flag(p)
    p.add_argument("--text", action="append", default=[], help="a text to score (repeatable)")
    p.add_argument("--json", action="store_true", help='print {"results": [...]} last')
    args = p.parse_args(argv)
    try:
        model_ref.check_step(args.model, args.step)
        model_flags.check_model_flags(args)
        if not args.text:
            raise ConfigError("text: give at least one --text")
        for i, t in enumerate(args.text):
            check_text(f"text {i}", t, blank_ok=True)  # a blank text is a text to score
        loading, scoring = startup.begin("experiments.pretrained.loading",
                                         "experiments.pretrained.scoring", devices=1)
        pre = loading.load_quantized(args.model, args.layers, args.gguf, args.quant, args.alpha,
                                     args.step, args.context)
        rows = scoring.score_texts(pre, args.text)
    except (ConfigError, GGUFError, QuantError) as e:
        fail(PROG, str(e).splitlines()[0])
    if args.json:
        print(json.dumps({"results": rows}))
    else:
        for text, r in zip(args.text, rows, strict=True):
            nll = "-" if r["mean_nll"] is None else f"{r['mean_nll']:.4f}"
            nxt = pre.tokenizer.decode([r["next_token"]])
            print(f"nll {nll}  tokens {len(r['tokens'])}  next {nxt!r}  {text!r}")
    return {"results": rows}


if __name__ == "__main__":
    main()
