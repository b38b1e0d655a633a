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
import math
from pathlib import Path

from experiments.cli import model_flags, startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
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
        out["chat"] = chat_parity(loading, reply_stability, pre, chat, "full")
    write_result(args.out, out)
    print(json.dumps(out))
    return out


def chat_parity(loading, reply_stability, pre, chat: dict, key: str) -> dict:
    """Our chat template and greedy KV-cache decoding against the fixture's: per prompt, the
    prompt ids and the reply compared (reply_stability.against_reference)."""
    prompts = []
    for text, ids, ref in zip(chat["prompts"], chat["tokens"], chat[key], strict=True):
        ours = reply_stability.greedy_reply(pre, text, chat["max_new_tokens"])
        prompts.append({"prompt": text, "template_identical": loading.chat_ids(pre, text)
                        == ids, "reply": pre.tokenizer.decode(ours, skip_special=True),
                        **reply_stability.against_reference(ours, ref, NEAR_TIE)})
    return {"max_new_tokens": chat["max_new_tokens"], "near_tie": NEAR_TIE,
            "prompts": prompts}


def _got(x) -> str:
    """What a fixture entry holds, in a refusal: null, a number or string as written, or the
    kind of a list or object."""
    if x is None:
        return "null"
    if isinstance(x, (list, dict)):
        return "a list" if isinstance(x, list) else "an object"
    return json.dumps(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _ids(field: str, x) -> None:
    if not (isinstance(x, list) and x and all(_is_int(t) and t >= 0 for t in x)):
        raise ConfigError(f"{field}: {_got(x)}, not a non-empty list of token ids")


def _entries(field: str, x, n: int | None = None, of: str = "texts") -> list:
    if not isinstance(x, list) or not x:
        raise ConfigError(f"{field}: {_got(x)}, not a non-empty list")
    if n is not None and len(x) != n:
        raise ConfigError(f"{field}: {len(x)} entries, unlike the {n} of {of}")
    return x


def _number(field: str, x, null_ok: bool = False) -> None:
    if not (_is_number(x) or (null_ok and x is None)):
        raise ConfigError(f"{field}: {_got(x)}, not a finite number")


def _score(field: str, x, keys: tuple[str, ...]) -> None:
    """A reference score: `next_token` a token id, the other keys numbers (`mean_nll` may be
    null: a one-token text has no scored position)."""
    if not isinstance(x, dict):
        raise ConfigError(f"{field}: {_got(x)}, not an object with {', '.join(keys)}")
    for k in keys:
        if k == "next_token":
            if not (_is_int(x.get(k)) and x[k] >= 0):
                raise ConfigError(f"{field}.{k}: {_got(x.get(k))}, not a token id")
        else:
            _number(f"{field}.{k}", x.get(k), null_ok=k == "mean_nll")


def check_fixture(ref: dict) -> None:
    """Every field the comparison reads, before the model loads: ConfigError naming the first
    one that is null, of the wrong kind, or of another length than the texts it belongs to."""
    for k in ("model",):
        if not isinstance(ref.get(k), str):
            raise ConfigError(f"{k}: {_got(ref.get(k))}, not a string")
    if not isinstance(ref.get("versions"), dict):
        raise ConfigError(f"versions: {_got(ref.get('versions'))}, not an object")
    texts = _entries("texts", ref["texts"])
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ConfigError(f"texts[{i}]: {_got(t)}, not a string")
    for i, ids in enumerate(_entries("tokens", ref["tokens"], len(texts))):
        _ids(f"tokens[{i}]", ids)
    for i, row in enumerate(_entries("full", ref["full"], len(texts))):
        _score(f"full[{i}]", row, ("mean_nll", "next_token"))
    if all(row["mean_nll"] is None for row in ref["full"]):
        raise ConfigError("full: every mean_nll is null; nothing to compare")
    long = ref.get("long", {})
    if not isinstance(long, dict):
        raise ConfigError(f"long: {_got(long)}, not an object")
    if "full" in long:
        _ids("long.tokens", long.get("tokens"))
        if not isinstance(long.get("text"), str):
            raise ConfigError(f"long.text: {_got(long.get('text'))}, not a string")
        if not (_is_int(long.get("tail")) and long["tail"] >= 1):
            raise ConfigError(f"long.tail: {_got(long.get('tail'))}, not a positive integer")
        _score("long.full", long["full"], ("mean_nll", "mean_nll_last", "next_token"))
    chat = ref.get("chat", {})
    if not isinstance(chat, dict):
        raise ConfigError(f"chat: {_got(chat)}, not an object")
    if "full" in chat:
        _check_chat(chat)


def _check_chat(chat: dict) -> None:
    prompts = _entries("chat.prompts", chat.get("prompts"))
    for i, t in enumerate(prompts):
        if not isinstance(t, str):
            raise ConfigError(f"chat.prompts[{i}]: {_got(t)}, not a string")
    n = len(prompts)
    for i, ids in enumerate(_entries("chat.tokens", chat.get("tokens"), n, "chat.prompts")):
        _ids(f"chat.tokens[{i}]", ids)
    if not (_is_int(chat.get("max_new_tokens")) and chat["max_new_tokens"] >= 1):
        raise ConfigError(f"chat.max_new_tokens: {_got(chat.get('max_new_tokens'))}, not a "
                          f"positive integer")
    for i, r in enumerate(_entries("chat.full", chat["full"], n, "chat.prompts")):
        if not isinstance(r, dict):
            raise ConfigError(f"chat.full[{i}]: {_got(r)}, not an object with tokens and "
                              f"margins")
        _ids(f"chat.full[{i}].tokens", r.get("tokens"))
        margins = r.get("margins")
        if not isinstance(margins, list):
            raise ConfigError(f"chat.full[{i}].margins: {_got(margins)}, not a list")
        for j, m in enumerate(margins):
            _number(f"chat.full[{i}].margins[{j}]", m)


if __name__ == "__main__":
    main()
