"""A parity fixture's fields checked before the model loads (no JAX here): the one
experiments/reference/make_smollm2_reference.py or check_export_reference.py wrote, as
`experiments.parity_smollm2` reads it. A null entry or lists of unequal length are refused in
one line naming the field, not met later as a traceback halfway through the comparison.
"""

from __future__ import annotations

import json
import math

from experiments.cli.config import ConfigError


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
