"""A Hugging Face folder's SentencePiece-style tokenizer (BPE over pieces that spell a space
as U+2581, unknown bytes as <0xNN> tokens: Llama 2, TinyLlama, Gemma) as a GGUF
SentencePiece vocabulary (`tokenizer.ggml.model` llama).

Such a vocabulary holds no merges. llama.cpp joins the adjacent pair whose joined piece has
the highest score; shardq's reader (`model.tokenizer.ranked_merges`, as transformers) ranks
each split of a piece by the piece's score, or for a gemma3 file by its position. So the
scores written rank the pieces in the order the folder's merges first make them, pieces whose
merges interleave (Llama's runs of spaces, which SentencePiece scores alike) sharing one; the
merges must be every split of a normal piece into two pieces, and ranking by those scores (or
by position) must give back the pieces in the folder's order. A folder whose merges follow
another order is refused, not written as a file that tokenizes differently.

The space before the text is the other half: a U+2581 put before each stretch of text between
special tokens (Llama's `Prepend` + `Replace` normalizer, or a `Metaspace` that always
prepends) is `add_space_prefix` true, as llama.cpp adds one after every special token; spaces
only respelled (Gemma's `Replace`, or a `Metaspace` that never prepends) are false. A
`Metaspace` that prepends before the first stretch only (what transformers 5 saves for Llama)
is written as true too, as llama.cpp reads every Llama vocabulary: its GGUF then puts a U+2581
after a special token where the folder does not. And a `Metaspace` adds no second U+2581 before
a text that starts with a space; SentencePiece, and so the GGUF's readers, do.
"""

from __future__ import annotations

import re

import numpy as np

from model.tokenizer import BYTE, NORMAL, UNKNOWN, ranked_merges, respelled
from model.tokenizer import SPIECE_SPACE as SPACE

_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
_REPLACE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
_PREPEND = {"type": "Prepend", "prepend": SPACE}
_SPLIT = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
          "invert": False}


class VocabError(ValueError):
    """What a GGUF SentencePiece vocabulary cannot hold (the caller names the file)."""


def is_sentencepiece(model: dict) -> bool:
    """A BPE model with byte fallback: SentencePiece's form in tokenizer.json."""
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def _metaspace(pre) -> str | None:
    """A Metaspace pre-tokenizer's prepend scheme, if it is one that keeps the text whole."""
    if not (isinstance(pre, dict) and pre.get("type") == "Metaspace"
            and pre.get("replacement") == SPACE and not pre.get("split", True)):
        return None
    scheme = pre.get("prepend_scheme")
    if scheme is None:  # before tokenizers 0.15: a flag
        scheme = "always" if pre.get("add_prefix_space", True) else "never"
    return scheme


def space_prefix(tok: dict) -> bool:
    """Whether a U+2581 goes before each stretch of text (add_space_prefix); VocabError for a
    normalizer and pre-tokenizer that are neither Llama's form nor Gemma's."""
    norm, pre = tok.get("normalizer"), tok.get("pre_tokenizer")
    if norm == {"type": "Sequence", "normalizers": [_PREPEND, _REPLACE]} and pre is None:
        return True
    if norm == _REPLACE and pre in (None, _SPLIT):
        return False
    if norm is None and _metaspace(pre) in ("always", "first", "never"):
        return _metaspace(pre) != "never"
    raise VocabError(f"normalizer {_kind(norm)} with pre_tokenizer {_kind(pre)}: a GGUF "
                     f"SentencePiece vocabulary puts a {SPACE} before the text or not (Llama's "
                     f"Prepend + Replace or a Metaspace that keeps the text whole; Gemma's "
                     f"Replace)")


def _kind(part) -> str:
    if not isinstance(part, dict):
        return repr(part)
    if part.get("type") == "Metaspace":
        return f"Metaspace({_metaspace(part) or 'split'})"
    inner = part.get("normalizers") or part.get("pretokenizers")
    if part.get("type") == "Sequence" and isinstance(inner, list):
        return "Sequence[" + ", ".join(_kind(p) for p in inner) + "]"
    return str(part.get("type"))


def token_types(tokens: list[str], added: dict[int, int], unk_id: int | None) -> np.ndarray:
    """llama.cpp's type per token: added tokens as given (control or user-defined), <0xNN>
    byte tokens, the unknown token, the rest normal."""
    types = [added.get(i, BYTE if _BYTE_TOKEN.fullmatch(t) else NORMAL)
             for i, t in enumerate(tokens)]
    if unk_id is not None:
        types[unk_id] = UNKNOWN
    return np.array(types, np.int32)


def _every_split(ids: dict[str, int], normal: set[str], merges: list[tuple[str, str]]) -> None:
    """VocabError unless the merges making normal pieces are every split of a normal piece
    into two pieces (splits of control, byte and unused tokens are left aside: the text never
    reaches the model whole there)."""
    for left, right in merges:
        if left + right not in ids:
            raise VocabError(f"merge {left!r} + {right!r} makes no token")
    listed = {(left, right) for left, right in merges if left + right in normal}
    splits = {(t[:k], t[k:]) for t in normal for k in range(1, len(t))
              if t[:k] in ids and t[k:] in ids}
    if listed != splits:
        missing = sorted(splits - listed)[:1] or sorted(listed - splits)[:1]
        raise VocabError(f"the merges are not every split of a token into two tokens (e.g. "
                         f"{missing[0][0]!r} + {missing[0][1]!r}), as a SentencePiece "
                         f"vocabulary's readers take them")


def _tie_scores(ids: dict[str, int], types: np.ndarray, merges: list[tuple[str, str]]
                ) -> np.ndarray:
    """A score per token that ranks the merges as the folder does: the pieces in the order
    their first merge comes, pieces whose merges interleave (Llama's runs of spaces, which
    SentencePiece scores alike) sharing one score; 0 for the tokens that are not normal, as
    llama.cpp's converter scores SentencePiece's control and byte pieces."""
    spans: dict[int, list[int]] = {}
    for rank, (left, right) in enumerate(merges):
        i = ids[left + right]
        if types[i] == NORMAL:
            spans.setdefault(i, [rank, rank])[1] = rank
    out = np.zeros(len(types), np.float32)
    out[types == NORMAL] = -float(len(spans) + 1)  # pieces no merge makes: never joined
    group, reach = 0, -1
    for i, (first, last) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if first > reach:
            group += 1
        reach = max(reach, last)
        out[i] = -float(group)
    return out


def vocabulary_scores(tokens: list[str], types: np.ndarray, merges: list[tuple[str, str]],
                      by_position: bool) -> np.ndarray:
    """The scores to write, checked: the merges a reader recovers from them (by score, or by
    position for a Gemma file, `model.tokenizer.ranked_merges`) make the folder's pieces in the
    folder's order; VocabError otherwise."""
    ids = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, kind in zip(tokens, types, strict=True) if kind == NORMAL}
    _every_split(ids, normal, merges)
    scores = _tie_scores(ids, types, merges)
    spelled = {t: i for i, t in enumerate(respelled(tokens))}
    made = [left + right for left, right in merges if left + right in normal]
    again = [left + right for left, right in
             ranked_merges(spelled, None if by_position else scores) if left + right in normal]
    if again != made:
        at = next(k for k, (a, b) in enumerate(zip(again + [None], made + [None], strict=False))
                  if a != b)
        how = "the token order" if by_position else "a score per token"
        raise VocabError(f"the merges follow an order {how} cannot state (merge {at} makes "
                         f"{(made + [None])[at]!r}; ranked by {how}, {(again + [None])[at]!r})")
    return scores
