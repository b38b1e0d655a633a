"""Greedy chat replies of SmolLM2 in float and every int8 mode, and how stable they are.

  python -m experiments.chat_replies          # writes results/smollm2_chat_replies.json
  python -m experiments.chat_replies --modes w8a8,auto --max-new-tokens 40 --seeds 4

Per mode (float first): for each prompt of experiments/pretrained/chat_prompts.py's PROMPTS (the
first --prompts of them; all by default) and each
--max-new-tokens, the greedy reply `experiments.chat` prints, whether it mentions the expected
answer, and how many of its first tokens equal float's reply. Then, for --spread-prompt, the
probability of float's first reply token and the argmax when the float embedding table is
multiplied by (1 + rel * N(0, 1)) under --seeds seeds (rel = --rel, 1e-6 by default: the last
bits of float32). The results file is rewritten after every mode.
"""

from __future__ import annotations

import argparse
import math

from tqdm import tqdm

from experiments.cli import model_flags, startup
from experiments.cli.config import ConfigError, Parser, check_output_file, check_text, fail
from experiments.pretrained.chat_prompts import PROMPTS
from experiments.reporting.results_io import results_path, write_result
from model.gguf import GGUFError
from quant.modes import MODES, QuantError

PROG = "experiments.chat_replies"
OUT = results_path("smollm2_chat_replies.json")


def parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"max_new_tokens={text!r}: allowed a comma-separated list of "
                          "positive integers")
    return lengths


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags.add_model_flags(p, quant=False)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated int8 modes")
    p.add_argument("--max-new-tokens", default="40,128",
                   help="comma-separated reply lengths (each prompt is answered at each)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS),
                   help="ask only the first N prompts (quick checks)")
    p.add_argument("--spread-prompt", default=PROMPTS[0].text)
    p.add_argument("--seeds", type=int, default=8, help="perturbed runs per mode (0: none)")
    p.add_argument("--rel", type=float, default=1e-6, help="relative size of the perturbation")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    try:
        model_flags.check_model_flags(args)
        modes = model_flags.parse_modes(args.modes)
        lengths = parse_lengths(args.max_new_tokens)
        n_prompts = len(PROMPTS)
        if not 1 <= args.prompts <= n_prompts:
            raise ConfigError(f"prompts={args.prompts}: must be in 1..{n_prompts}")
        prompts = PROMPTS[:args.prompts]
        if args.seeds < 0:
            raise ConfigError(f"seeds={args.seeds}: must be >= 0")
        if not (math.isfinite(args.rel) and 0 < args.rel < 1):
            raise ConfigError(f"rel={args.rel}: must be in (0, 1)")
        check_text("spread_prompt", args.spread_prompt)
        check_output_file("out", args.out)
        loading, reply_stability, machine = startup.begin(
            "experiments.pretrained.loading", "experiments.pretrained.reply_stability",
            "experiments.speed.machine", devices=1)
        float_model = loading.load(args.model, args.layers, args.gguf, context=args.context)
        limit = float_model.cfg.max_len
        if len(loading.chat_ids(float_model, args.spread_prompt)) > limit:
            raise ConfigError(f"spread_prompt: longer than the context of {limit} tokens")
        longest = max(len(loading.chat_ids(float_model, q.text))
                      for q in prompts) + max(lengths)
        if longest > limit:
            raise ConfigError(f"max_new_tokens={args.max_new_tokens}: a prompt + its reply "
                              f"must fit the context of {limit}")
        out = {"model": float_model.name, "gguf": args.gguf, "layers": float_model.cfg.n_layers,
               "machine": machine.describe(),
               "prompts": [{"text": q.text, "answer": q.answer} for q in prompts],
               "max_new_tokens": list(lengths), "spread_prompt": args.spread_prompt,
               "replies": [], "spread": []}
        float_tokens, reference_token = None, None
        for mode in tqdm(["none"] + modes, desc="modes", unit="mode"):
            pre = loading.for_decoding(loading.quantize(float_model, mode))
            rows = reply_stability.greedy_replies(pre, prompts, lengths, float_tokens)
            if float_tokens is None:
                float_tokens = {(r["prompt"], r["max_new_tokens"]): r["tokens"] for r in rows}
            out["replies"] += rows
            if args.seeds:  # float's run (reference None) names the token the others are read by
                spread = reply_stability.first_token_spread(
                    pre, args.spread_prompt, args.seeds, args.rel, reference_token)
                reference_token = spread["reference_token"]
                out["spread"].append(spread)
            write_result(args.out, out)  # after every mode: a long run keeps what it measured
    except (ConfigError, GGUFError, QuantError) as e:
        fail(PROG, str(e).splitlines()[0])
    for r in out["replies"]:
        print(f"{r['quant']:>13} {r['max_new_tokens']:>4} {'ok ' if r['correct'] else 'no '}"
              f"{r['prompt'][:30]!r:34} {r['reply'][:70]!r}")
    for s in out["spread"]:
        print(f"{s['quant']:>13}  P(first token) {s['p_min']:.3f}..{s['p_max']:.3f}  "
              f"argmax not float's: {s['argmax_not_reference']}/{s['seeds']}")
    return out


if __name__ == "__main__":
    main()
