"""A Hugging Face folder's tokenizer as GGUF tokenizer metadata (`tokenizer.ggml.*`), so a
GGUF exported from the folder tokenizes as the folder does, in shardq's GGUF reader
(model/tokenizer.py) and in llama.cpp. A SentencePiece-style tokenizer (byte fallback) becomes
a SentencePiece vocabulary (model/gguf_spm_vocab.py says how); a byte-level BPE is written as
below.

Only what both readers rebuild exactly is written; anything else is refused in one line rather
than written as a file that tokenizes differently:
  model          BPE over byte-level symbols (no byte fallback, no word prefixes or suffixes,
                 merges not skipped), written as `tokenizer.ggml.model` gpt2;
  normalizer     none, or NFC (Qwen's), which llama.cpp's converter leaves out too: a text
                 not in NFC may tokenize otherwise;
  pre-tokenizer  GPT-2's regex (`ByteLevel` with its regex and no prefix space), alone or
                 after every number character split off (`Digits` one at a time, or a
                 `Split` on \\p{N}), written as a `tokenizer.ggml.pre` name that llama.cpp
                 (LLAMA_CPP_PRE, from its llama-vocab.cpp) and model/tokenizer.py both map to
                 that split: smollm for the digits, gpt-2 for GPT-2's regex alone; or Llama 3's
                 or Qwen2's own regex in its place (a `Split` on it, then `ByteLevel` without
                 its regex), written as llama-bpe or qwen2;
  added tokens   matched whole: special ones as control tokens, others as user-defined; one
                 that strips its neighbours' spaces has no equal in the readers.
BOS, EOS, padding and unknown come from tokenizer_config.json (or config.json's ids), with
the chat template (chat_template.jinja or tokenizer_config.json's); `add_bos_token` is whether
transformers puts the BOS first (`model.hf_tokenizer.bos_prefix`: tokenizer.json's
post-processor). Ids must run 0..n-1; a
model whose embedding has more rows than the tokenizer has tokens gets `[PADi]` tokens of type
unused, as llama.cpp's converter writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from model import gguf_spm_vocab as spm
from model.hf_tokenizer import (
    HFTokenizerError,
    bos_prefix,
    chat_template,
    read_tokenizer,
    token_text,
)
from model.tokenizer import (
    CONTROL,
    IGNORE_MERGES,
    NORMAL,
    PRE_TOKENIZER_REGEXES,
    PRE_TOKENIZER_SPLITS,
    UNUSED,
    USER_DEFINED,
)

# llama.cpp's pre-tokenizer names, by the split that comes before GPT-2's regex (None: none).
LLAMA_CPP_PRE = {None: ("gpt-2",), r"\p{N}": ("smollm",)}
_STR, _U32, _BOOL = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.BOOL
_STR_ARRAY = (GGUFValueType.ARRAY, GGUFValueType.STRING)
_I32_ARRAY = (GGUFValueType.ARRAY, GGUFValueType.INT32)
_F32_ARRAY = (GGUFValueType.ARRAY, GGUFValueType.FLOAT32)


class TokenizerExportError(ValueError):
    """A tokenizer a GGUF cannot hold so that its readers tokenize as the folder does; one
    line naming the file."""


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerExportError(f"{str(path)!r}: not readable JSON "
                                   f"({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise TokenizerExportError(f"{str(path)!r}: not a JSON object")
    return data


def _byte_level(p) -> bool:
    """GPT-2's byte-level split (tokenizers' defaults: a prefix space and the regex)."""
    return (isinstance(p, dict) and p.get("type") == "ByteLevel"
            and not p.get("add_prefix_space", True) and p.get("use_regex", True))


def _number_split(p) -> bool:
    """Every number character (\\p{N}) a piece of its own."""
    if not isinstance(p, dict):
        return False
    if p.get("type") == "Digits":
        return bool(p.get("individual_digits"))
    return (p.get("type") == "Split" and p.get("pattern") == {"Regex": r"\p{N}"}
            and p.get("behavior") == "Isolated" and not p.get("invert", False))


_NOT_GPT2 = "not GPT-2's"


def _first_split(pre):
    """The split tokenizer.json's `pre_tokenizer` makes before GPT-2's byte-level regex (None:
    none; _NOT_GPT2: it is no such pre-tokenizer)."""
    if _byte_level(pre):
        return None
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers") or []
        if len(parts) == 2 and _number_split(parts[0]) and _byte_level(parts[1]):
            return r"\p{N}"
    return _NOT_GPT2


def _own_regex(pre) -> str | None:
    """The regex of a `Split` on a regex then `ByteLevel` without its own (Llama 3's and Qwen2's
    form), else None."""
    if not (isinstance(pre, dict) and pre.get("type") == "Sequence"):
        return None
    parts = pre.get("pretokenizers") or []
    if len(parts) != 2 or not all(isinstance(x, dict) for x in parts):
        return None
    split, byte_level = parts
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated"
            or split.get("invert", False) or byte_level.get("type") != "ByteLevel"
            or byte_level.get("add_prefix_space", True) or byte_level.get("use_regex", True)):
        return None
    regex = (split.get("pattern") or {}).get("Regex")
    return regex if isinstance(regex, str) else None


def pre_name(pre) -> str:
    """The GGUF pre-tokenizer name whose split, in llama.cpp and in model/tokenizer.py, equals
    tokenizer.json's `pre_tokenizer`; TokenizerExportError naming it when there is none."""
    regex = _own_regex(pre)
    for name, known in PRE_TOKENIZER_REGEXES.items():
        if regex == known:
            return name
    split = _first_split(pre)
    names = LLAMA_CPP_PRE.get(split, ())
    for name in names:
        if name in PRE_TOKENIZER_SPLITS and PRE_TOKENIZER_SPLITS[name] == split:
            return name
    why = (f"llama.cpp names it {', '.join(map(repr, names))}, which shardq's GGUF reader does "
           f"not read" if names else "no GGUF pre-tokenizer name both llama.cpp and shardq "
           "read splits text so (known: GPT-2's ByteLevel regex, alone or after digits one "
           "at a time; Llama 3's and Qwen2's regex)")
    raise TokenizerExportError(f"pre_tokenizer {_describe(pre)}: {why}")


def _describe(pre) -> str:
    if not isinstance(pre, dict):
        return repr(pre)
    if pre.get("type") == "Sequence":
        return "Sequence[" + ", ".join(_describe(p) for p in pre.get("pretokenizers") or []) + "]"
    return str(pre.get("type"))


def _check_model(model: dict, where: str) -> None:
    if model.get("type") != "BPE":
        raise TokenizerExportError(f"{where}: model {model.get('type')!r} is not a byte-level "
                                   f"BPE (a GGUF is written for byte-level BPE tokenizers only)")
    for key, ok in (("byte_fallback", (False, None)),
                    ("dropout", (None,)), ("continuing_subword_prefix", (None, "")),
                    ("end_of_word_suffix", (None, ""))):
        if model.get(key) not in ok:
            raise TokenizerExportError(f"{where}: BPE {key}={model.get(key)!r} has no GGUF "
                                       f"form (allowed {ok[0]!r})")


def _merge_pairs(model: dict, where: str) -> list[tuple[str, str]]:
    out = []
    for m in model.get("merges") or []:
        pair = m.split(" ") if isinstance(m, str) else list(m)
        if len(pair) != 2 or any(" " in p for p in pair):
            raise TokenizerExportError(f"{where}: merge {m!r} is not two tokens without spaces")
        out.append((pair[0], pair[1]))
    return out


def _merges(model: dict, where: str) -> list[str]:
    return [" ".join(pair) for pair in _merge_pairs(model, where)]


def _byte_level_form(tok: dict, model: dict, where: str) -> str:
    """The GGUF pre-tokenizer name of a byte-level BPE tokenizer.json (TokenizerExportError,
    naming the file, where it has none)."""
    _check_model(model, where)
    # Qwen's NFC is left out, as llama.cpp's converter leaves it: the GGUF's readers take the
    # text as written, which differs only for a text not already in NFC
    if tok.get("normalizer") not in (None, {"type": "NFC"}):
        raise TokenizerExportError(f"{where}: normalizer "
                                   f"{_describe(tok['normalizer'])} has no GGUF form")
    try:
        pre = pre_name(tok.get("pre_tokenizer"))
    except TokenizerExportError as e:
        raise TokenizerExportError(f"{where}: {e}") from None
    # the readers ignore the merges for a piece that is a token with Llama 3's split only
    if bool(model.get("ignore_merges")) != (pre in IGNORE_MERGES):
        raise TokenizerExportError(
            f"{where}: BPE ignore_merges={model.get('ignore_merges')!r} with pre-tokenizer "
            f"{pre}: llama.cpp and shardq ignore the merges with Llama 3's split only")
    return pre


def _sentencepiece_form(tok: dict, model: dict, where: str) -> bool:
    """add_space_prefix of a SentencePiece-style tokenizer.json (TokenizerExportError, naming
    the file, where a GGUF SentencePiece vocabulary cannot hold it)."""
    for key, ok in (("dropout", (None,)), ("continuing_subword_prefix", (None, "")),
                    ("end_of_word_suffix", (None, "")), ("ignore_merges", (False, None))):
        if model.get(key) not in ok:
            raise TokenizerExportError(f"{where}: BPE {key}={model.get(key)!r} has no GGUF "
                                       f"form (allowed {ok[0]!r})")
    for added in tok.get("added_tokens") or []:
        if added.get("normalized"):
            raise TokenizerExportError(f"{where}: added token {added.get('content')!r} is "
                                       f"matched after normalizing (a GGUF's readers match "
                                       f"added tokens in the text as written)")
    try:
        return spm.space_prefix(tok)
    except spm.VocabError as e:
        raise TokenizerExportError(f"{where}: {e}") from None


def tokenizer_metadata(folder: str | Path, vocab_size: int, by_position: bool = False) -> dict:
    """{key: (value type, value)} (as `model.gguf.GGUFFile.metadata` holds it) of the folder's
    tokenizer, for a model with `vocab_size` embedding rows; TokenizerExportError otherwise.
    `by_position`: a SentencePiece vocabulary is read back ranked by token order (a gemma3
    file), not by its scores."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    where = repr(str(path))
    if not path.is_file():
        raise TokenizerExportError(f"{str(folder)!r}: no tokenizer.json")
    tok = _json(path)
    model = tok.get("model") or {}
    pieces = spm.is_sentencepiece(model)
    form = (_sentencepiece_form if pieces else _byte_level_form)(tok, model, where)
    vocab = dict(model.get("vocab") or {})
    types = {}
    for added in tok.get("added_tokens") or []:
        text = added.get("content")
        if any(added.get(k) for k in ("lstrip", "rstrip", "single_word")):
            raise TokenizerExportError(f"{where}: added token {text!r} strips its neighbours' "
                                       f"spaces or matches single words (no GGUF form shardq "
                                       f"and llama.cpp read back)")
        vocab[text] = added["id"]
        # matched whole in the text as written; a special one is a control token, any other
        # user-defined, as llama.cpp's converter writes them
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    n = len(vocab)
    tokens: list[str | None] = [None] * n
    for text, i in vocab.items():
        if not 0 <= i < n or tokens[i] is not None:
            raise TokenizerExportError(f"{where}: token ids do not run 0..{n - 1} once each "
                                       f"(token {text!r} has id {i})")
        tokens[i] = text
    if n > vocab_size:
        raise TokenizerExportError(f"{where}: {n} tokens for a model of {vocab_size} embedding "
                                   f"rows")
    tokens += [f"[PAD{i}]" for i in range(n, vocab_size)]
    meta = _special_ids(folder, vocab, n)
    if pieces:
        unk = meta.get("tokenizer.ggml.unknown_token_id", (None, None))[1]
        if unk is None:
            unk = vocab.get(model.get("unk_token"))
        if unk is None:
            raise TokenizerExportError(f"{where}: no unknown token (the BPE model's unk_token "
                                       f"or tokenizer_config.json's), which a SentencePiece "
                                       f"vocabulary needs")
        kinds = spm.token_types(tokens, {**types, **{i: UNUSED for i in range(n, vocab_size)}},
                                unk)
        try:
            scores = spm.vocabulary_scores(tokens, kinds, _merge_pairs(model, where),
                                           by_position=by_position)
        except spm.VocabError as e:
            raise TokenizerExportError(f"{where}: {e}") from None
        return {**meta, "tokenizer.ggml.model": (_STR, "llama"),
                "tokenizer.ggml.tokens": (_STR_ARRAY, tokens),
                "tokenizer.ggml.scores": (_F32_ARRAY, scores),
                "tokenizer.ggml.token_type": (_I32_ARRAY, kinds),
                "tokenizer.ggml.unknown_token_id": (_U32, unk),
                "tokenizer.ggml.add_space_prefix": (_BOOL, form)}
    token_types = np.array([types.get(i, NORMAL) for i in range(n)]
                           + [UNUSED] * (vocab_size - n), np.int32)
    return {**meta, "tokenizer.ggml.model": (_STR, "gpt2"), "tokenizer.ggml.pre": (_STR, form),
            "tokenizer.ggml.tokens": (_STR_ARRAY, tokens),
            "tokenizer.ggml.token_type": (_I32_ARRAY, token_types),
            "tokenizer.ggml.merges": (_STR_ARRAY, _merges(model, where))}


def _special_ids(folder: Path, vocab: dict[str, int], n: int) -> dict:
    """BOS, EOS, padding and unknown ids, whether the BOS goes first, the chat template and
    the name."""
    meta = {}
    conf_path = folder / "tokenizer_config.json"
    conf = _json(conf_path) if conf_path.is_file() else {}
    hf = _json(folder / "config.json") if (folder / "config.json").is_file() else {}
    for key, field in (("bos", "bos"), ("eos", "eos"), ("padding", "pad"), ("unknown", "unk")):
        text = token_text(conf.get(f"{field}_token"))
        if text is not None and text not in vocab:
            raise TokenizerExportError(f"{str(conf_path)!r}: {field}_token {text!r} is not a "
                                       f"token")
        i = vocab[text] if text is not None else hf.get(f"{field}_token_id")
        i = i[0] if isinstance(i, list) and i else i
        if isinstance(i, int) and 0 <= i < n:
            meta[f"tokenizer.ggml.{key}_token_id"] = (_U32, i)
    if "tokenizer.ggml.eos_token_id" not in meta:  # shardq's reader needs one
        raise TokenizerExportError(f"{str(folder)!r}: no EOS token (tokenizer_config.json's "
                                   f"eos_token or config.json's eos_token_id)")
    try:
        first = bos_prefix(read_tokenizer(folder / "tokenizer.json"))
    except HFTokenizerError as e:
        raise TokenizerExportError(str(e)) from None
    bos_id = meta.get("tokenizer.ggml.bos_token_id", (None, None))[1]
    if first and first != [bos_id]:
        raise TokenizerExportError(f"{str(folder / 'tokenizer.json')!r}: a text's encoding "
                                   f"starts with {first} where a GGUF can put only its BOS "
                                   f"({bos_id}) first")
    meta["tokenizer.ggml.add_bos_token"] = (_BOOL, bool(first))
    template = chat_template(folder, conf.get("chat_template"))
    if template is not None:
        meta["tokenizer.chat_template"] = (_STR, template)
    meta["general.name"] = (_STR, folder.resolve().name)
    return meta
