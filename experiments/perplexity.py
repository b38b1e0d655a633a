"""Perplexity of a pretrained LM (float or int8) on the validation topics of `pydoc_data`.

  python -m experiments.perplexity --model smollm2 --json
  python -m experiments.perplexity --model smollm2 --quant w8a8 --json --tokens 8192
  python -m experiments.perplexity --model smollm2 --quant smoothquant --corpus docstrings --json
  python -m experiments.perplexity --model smollm2 --quant w8a8 --vs-float --json
  python -m experiments.perplexity --model runs/ft --step 12 --quant smoothquant --json

The text: the validation topics of the standard library's `pydoc_data/topics.py` (split by a
hash of the topic name, `experiments/training/pydoc_corpus.py`), in name order, tokenized once; the
first --tokens tokens are read in non-overlapping windows of --window tokens (default 512, or the
model's context when shorter: a run trained on short sequences) and every position after a
window's first is scored. `--corpus docstrings` reads another text instead, the
standard library's docstrings (`experiments/pretrained/eval_text.py`). The last line with --json:
{"model", "quant", "corpus", "tokens", "scored", "window", "nll", "perplexity", "param_bytes",
"quantized_fraction"}. --vs-float (with an int8 --quant) runs the float model beside the int8
one (both in memory, every window scored by both) and adds "divergence": {"reference",
"kl_mean", "kl_median", "kl_p99", "kl_max", "top1_agree"}, KL(float || int8) of the
next-token distributions in nats over the scored positions and the share of them where both
models' most likely next token is the same (what greedy decoding follows) -- a closer look
than the perplexity change, which errors of either sign can cancel in.
"""

from __future__ import annotations

import argparse
import json

from experiments.cli import model_flags, startup
from experiments.cli.config import ConfigError, Parser, fail
from experiments.pretrained import eval_text, model_ref
from model.gguf import GGUFError
from quant.modes import MODES, QuantConfig, QuantError

PROG = "experiments.perplexity"
DEFAULT_TOKENS = 8192
DEFAULT_WINDOW = 512


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags.add_model_flags(p)
    model_ref.add_step_flag(p)
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens of the text to read (default {DEFAULT_TOKENS})")
    p.add_argument("--window", type=int, default=None,
                   help=f"tokens per window (default {DEFAULT_WINDOW}, or the model's context "
                        f"when shorter)")
    model_flags.add_corpus_flag(p)
    p.add_argument("--vs-float", action="store_true",
                   help="also measure the int8 model's divergence from the float model "
                        "(KL, top-1 agreement); needs an int8 --quant")
    p.add_argument("--json", action="store_true", help="print the result as JSON last")
    args = p.parse_args(argv)
    try:
        model_ref.check_step(args.model, args.step)
        model_flags.check_model_flags(args)
        model_flags.check_window_flags(args.tokens, args.window if args.window is not None
                                       else min(DEFAULT_WINDOW, max(args.tokens, 2)))
        eval_text.check_corpus(args.corpus)
        if args.vs_float and args.quant == "none":
            raise ConfigError(f"vs_float: only with an int8 --quant, one of {', '.join(MODES)} "
                              f"(got {args.quant!r})")
        loading, scoring = startup.begin("experiments.pretrained.loading",
                                         "experiments.pretrained.scoring", devices=1)
        float_model = loading.load(args.model, args.layers, args.gguf, args.step, args.context)
        window = (args.window if args.window is not None
                  else min(DEFAULT_WINDOW, float_model.cfg.max_len))
        qcfg = (QuantConfig(mode=args.quant, alpha=args.alpha) if args.alpha is not None
                else None)
        pre = loading.quantize(float_model, args.quant, qcfg)
        # kept (and run again beside the int8 model) only for --vs-float
        reference = float_model if args.vs_float else None
        del float_model
        row = scoring.perplexity(pre, args.tokens, window, args.corpus, reference)
    except (ConfigError, GGUFError, QuantError) as e:
        fail(PROG, str(e).splitlines()[0])
    if args.json:
        print(json.dumps(row))
    else:
        print(f"{row['model']} {row['quant']}: perplexity {row['perplexity']:.3f} "
              f"(nll {row['nll']:.4f} nats over {row['scored']} tokens)")
        if "divergence" in row:
            d = row["divergence"]
            print(f"vs float: KL mean {d['kl_mean']:.5f} nats (median {d['kl_median']:.5f}, "
                  f"99th percentile {d['kl_p99']:.4f}), same top-1 token at "
                  f"{d['top1_agree']:.2%} of positions")
    return row


if __name__ == "__main__":
    main()
