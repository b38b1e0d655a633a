"""What int8 of the embedding (and so of a tied head) costs and saves on a pretrained LM.

  python -m experiments.embed_int8 --model gemma3-270m     # writes results/gemma3_embed_int8.json

w8 and w8a8 run three times: on the blocks' Dense layers alone; on the blocks and the embedding
with one scale per row (per token id; a tied head multiplies by the same int8 table, per-token
int8 activations under w8a8); and on the blocks and the embedding with one scale per block of
32 values of a row (quant's default, GGUF Q8_0's layout; the tied head is weight-only). Two
last rows quantise the embedding alone, per row and in blocks, the blocks float: the table's
own cost. `--off-grid SIGMA` first moves the float table off any int8 grid (Gaussian noise of
SIGMA block steps; the float reference is the moved table): a packaged table stored as Q8_0
lies on the grid of int8 blocks of 32 already. Every model runs in float32 (a bfloat16 run's
weights widened exactly), so that the rows measure int8's rounding, not bfloat16's. Per row:
perplexity on the validation topics of `pydoc_data`, its change against float, KL(float ||
int8) of the next-token distributions and the share of positions with the same top-1 token,
and the parameter bytes as stored.
"""

from __future__ import annotations

import argparse
import json

from experiments.cli import model_flags, startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.pretrained import model_ref
from experiments.reporting.results_io import results_path, write_result
from model.gguf import GGUFError
from quant.modes import EMBED_BLOCK, QuantConfig

PROG = "experiments.embed_int8"
MODES = ("w8", "w8a8")
# label -> (rules, values per scale of the table; 0: one per row)
VARIANTS = {"blocks": (("blocks/*",), EMBED_BLOCK),
            "blocks+embed/row": (("blocks/*", "embed"), 0),
            f"blocks+embed/{EMBED_BLOCK}": (("blocks/*", "embed"), EMBED_BLOCK)}
# The table's own cost, the blocks float.
ALONE = (("embed/row", "w8", ("embed",), 0),
         (f"embed/{EMBED_BLOCK}", "w8", ("embed",), EMBED_BLOCK))


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m", metavar="REF",
                   help="a registered name, a .gguf file, a Hugging Face folder or a run")
    p.add_argument("--tokens", type=int, default=2048, help="validation tokens per row")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--off-grid", type=float, default=0.0, metavar="SIGMA",
                   help="move the float table off any int8 grid first: Gaussian noise of SIGMA "
                        "times each block's int8 step (0: the table as loaded)")
    p.add_argument("--out", default=str(results_path("gemma3_embed_int8.json")))
    args = p.parse_args(argv)
    try:
        model_flags.check_window_flags(args.tokens, args.window)
        if not 0.0 <= args.off_grid <= 100.0:
            raise ConfigError(f"off_grid={args.off_grid}: must be in [0, 100] (block steps)")
        check_output_file("out", args.out)
        model_ref.resolve(args.model)  # JAX-free: a bad REF is refused before start-up
    except ConfigError as e:
        fail(PROG, str(e))
    loading, scoring = startup.begin("experiments.pretrained.loading",
                                     "experiments.pretrained.scoring", devices=1)
    try:
        # float32 arithmetic throughout: a bfloat16 run's rounding of its logits would drown
        # the table's int8 error
        float_model = loading.as_float32(loading.load(args.model))
        if args.off_grid:
            float_model = loading.off_grid(float_model, args.off_grid, EMBED_BLOCK)
    except (GGUFError, ConfigError) as e:
        fail(PROG, str(e).splitlines()[0])
    base = scoring.perplexity(float_model, args.tokens, args.window)
    rows = [{"quant": "none", "rules": [], **base}]
    runs = [(label, mode, rules, block) for mode in MODES
            for label, (rules, block) in VARIANTS.items()] + list(ALONE)
    for label, mode, rules, block in runs:
        qcfg = QuantConfig(mode=mode, rules=rules, embed_block=block)
        pre = loading.quantize(float_model, mode, qcfg)
        row = scoring.perplexity(pre, args.tokens, args.window, reference=float_model)
        rows.append({"quant": mode, "rules": list(rules), "embed_block": block,
                     "quantised": label, **row})
    for r in rows:
        r["vs_float_pct"] = 100.0 * (r["perplexity"] / base["perplexity"] - 1.0)
    out = {"model": float_model.name, "layers": float_model.cfg.n_layers,
           "vocab_size": float_model.cfg.vocab_size, "d_model": float_model.cfg.d_model,
           "tied": float_model.cfg.tie_embeddings, "off_grid_sigma": args.off_grid,
           "rows": rows}
    write_result(args.out, out)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    return out


if __name__ == "__main__":
    main()
