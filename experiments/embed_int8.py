"""What int8 of the embedding (and so of a tied head) costs and saves on a pretrained LM.

  python -m experiments.embed_int8 --model gemma3-270m     # writes results/gemma3_embed_int8.json

The int8 modes quantise the blocks' Dense layers only (quant's default rules). Here w8 and
w8a8 run twice: on the blocks, and on the blocks plus the embedding (`embed`: one int8 row per
token with its scale; a tied head multiplies by the same int8 table). Per row: perplexity on
the validation topics of `pydoc_data`, its change against float, KL(float || int8) of the
next-token distributions and the share of positions with the same top-1 token, and the
parameter bytes as stored.
"""

from __future__ import annotations

import argparse
import json

from experiments.cli import model_flags, startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.pretrained import model_ref
from experiments.reporting.results_io import results_path, write_result
from model.gguf import GGUFError
from quant.modes import QuantConfig

PROG = "experiments.embed_int8"
MODES = ("w8", "w8a8")
RULES = {"blocks": ("blocks/*",), "blocks+embed": ("blocks/*", "embed")}


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m", metavar="REF",
                   help="a registered name, a .gguf file, a Hugging Face folder or a run")
    p.add_argument("--tokens", type=int, default=2048, help="validation tokens per row")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", default=str(results_path("gemma3_embed_int8.json")))
    args = p.parse_args(argv)
    try:
        model_flags.check_window_flags(args.tokens, args.window)
        check_output_file("out", args.out)
        model_ref.resolve(args.model)  # JAX-free: a bad REF is refused before start-up
    except ConfigError as e:
        fail(PROG, str(e))
    loading, scoring = startup.begin("experiments.pretrained.loading",
                                     "experiments.pretrained.scoring", devices=1)
    try:
        float_model = loading.load(args.model)
    except (GGUFError, ConfigError) as e:
        fail(PROG, str(e).splitlines()[0])
    base = scoring.perplexity(float_model, args.tokens, args.window)
    rows = [{"quant": "none", "rules": [], **base}]
    for mode in MODES:
        for label, rules in RULES.items():
            pre = loading.quantize(float_model, mode, QuantConfig(mode=mode, rules=rules))
            row = scoring.perplexity(pre, args.tokens, args.window, reference=float_model)
            rows.append({"quant": mode, "rules": list(rules), "quantised": label, **row})
    for r in rows:
        r["vs_float_pct"] = 100.0 * (r["perplexity"] / base["perplexity"] - 1.0)
    out = {"model": float_model.name, "layers": float_model.cfg.n_layers,
           "vocab_size": float_model.cfg.vocab_size, "d_model": float_model.cfg.d_model,
           "tied": float_model.cfg.tie_embeddings, "rows": rows}
    write_result(args.out, out)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    return out


if __name__ == "__main__":
    main()
