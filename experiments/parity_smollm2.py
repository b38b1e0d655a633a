"""Our SmolLM2 against Hugging Face transformers on the full model (the tests use 4 layers).

  python -m experiments.parity_smollm2            # writes results/smollm2_parity.json
  python -m experiments.parity_smollm2 --gguf exports/ft-gguf/model.gguf --fixture F --out G

`--gguf` scores another Llama GGUF (e.g. a fine-tuned run exported with `experiments.export
--format gguf`) against a fixture that experiments/reference/check_export_reference.py wrote from
the same run's safetensors export: the export checked end to end in transformers.

Reads the fixture experiments/reference/make_smollm2_reference.py wrote (tests/fixtures/
smollm2_reference.json: token ids, mean NLL and greedy next token per text from transformers),
tokenizes and scores the same texts with the project's tokenizer and float32 model, and
records how far apart they are; then the same for the fixture's long text (nearly the whole
8192-token context), and the greedy chat replies to the fixture's prompts (our ChatML template
and KV-cache decoding against transformers' template and generation).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.cli import model_flags, startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.pretrained.parity_fixture import check_fixture
from experiments.reporting.results_io import results_path, write_result
from model.gguf import GGUFError

PROG = "experiments.parity_smollm2"
# Two correct float32 implementations may pick different greedy tokens only where the two
# largest logits are this close: well above their rounding, well below a real disagreement.
NEAR_TIE = 1e-3
FIXTURE = Path(__file__).parent.parent / "tests" / "fixtures" / "smollm2_reference.json"


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixture", default=str(FIXTURE))
    p.add_argument("--out", default=str(results_path("smollm2_parity.json")))
    p.add_argument("--no-long", action="store_true",
                   help="skip the fixture's long text (the slow part on the full model)")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="score this Llama GGUF instead of the packaged SmolLM2")
    args = p.parse_args(argv)
    try:
        ref = json.loads(Path(args.fixture).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        fail(PROG, f"fixture={args.fixture!r}: cannot be read ({str(e).splitlines()[0]})")
    if not (isinstance(ref, dict) and all(k in ref for k in ("texts", "tokens", "full"))):
        fail(PROG, f"fixture={args.fixture!r}: not a reference fixture (an object with texts, "
                   f"tokens and full, as make_smollm2_reference.py writes)")
    try:
        check_fixture(ref)
    except ConfigError as e:
        fail(PROG, f"fixture={args.fixture!r}: {e}")
    try:
        check_output_file("out", args.out)
        if args.gguf is not None:
            model_flags.check_gguf_path(args.gguf)
    except ConfigError as e:
        fail(PROG, str(e))
    loading, scoring, reply_stability = startup.begin(
        "experiments.pretrained.loading", "experiments.pretrained.scoring",
        "experiments.pretrained.reply_stability", devices=1)
    try:
        pre = loading.load("smollm2", gguf_path=args.gguf)
    except GGUFError as e:
        fail(PROG, str(e))
    ids = [pre.tokenizer.encode(t) for t in ref["texts"]]
    rows = scoring.score_ids(pre, ref["tokens"])
    diffs = [abs(r["mean_nll"] - x["mean_nll"]) for r, x in zip(rows, ref["full"], strict=True)
             if x["mean_nll"] is not None]
    out = {"model": ref["model"], "gguf": args.gguf, "reference_versions": ref["versions"],
           "layers": pre.cfg.n_layers, "texts": len(ref["texts"]),
           "ids_identical": sum(a == b for a, b in zip(ids, ref["tokens"], strict=True)),
           "next_identical": sum(r["next_token"] == x["next_token"]
                                 for r, x in zip(rows, ref["full"], strict=True)),
           "max_abs_nll_diff": max(diffs), "mean_abs_nll_diff": sum(diffs) / len(diffs)}
    long = ref.get("long")  # near the whole context; export fixtures have none
    if long is not None and "full" in long and not args.no_long:
        row, = scoring.score_ids(pre, [long["tokens"]], tail=long["tail"])
        out["long_text"] = {"tokens": len(long["tokens"]), "context": pre.cfg.max_len,
                            "tail": long["tail"],
                            "tail_abs_nll_diff": abs(row["mean_nll_last"]
                                                     - long["full"]["mean_nll_last"]),
                            "ids_identical": pre.tokenizer.encode(long["text"]) == long["tokens"],
                            "next_identical": row["next_token"] == long["full"]["next_token"],
                            "abs_nll_diff": abs(row["mean_nll"] - long["full"]["mean_nll"])}
    chat = ref.get("chat")  # greedy chat replies; export fixtures have none
    if chat is not None and "full" in chat:
        out["chat"] = reply_stability.chat_parity(pre, chat, "full", NEAR_TIE)
    write_result(args.out, out)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
