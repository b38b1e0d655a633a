"""The tokenizer of a Hugging Face folder: `tokenizer.json` through the `tokenizers` library,
BOS/EOS and the chat template from `tokenizer_config.json`.

It offers what the pretrained code asks of `model.tokenizer.BPETokenizer`: `encode` (the BOS
first where transformers puts one: `bos_prefix`), `decode`, `token_id`, `eos_id`, `vocab_size`,
`bos`, plus `chat_prompt` for the folder's chat template (model/chat_template.py renders it).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from model.tokenizer import TokenizerCodec


class HFTokenizerError(ValueError):
    """A tokenizer that cannot be read; one line naming the file."""


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer(path: Path) -> Tokenizer:
    """tokenizer.json through the `tokenizers` library; HFTokenizerError (one line naming the
    file) where it is no such file."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type on a bad file
        raise HFTokenizerError(f"{str(path)!r}: not a tokenizers file "
                               f"({str(e).splitlines()[0][:120]})") from None


def bos_prefix(tok: Tokenizer) -> list[int]:
    """The ids a text's encoding starts with, as transformers' default call gives them: what
    tokenizer.json's post-processor puts first (where Llama's and Gemma's BOS live).
    transformers 5 follows the post-processor alone; add_bos_token in tokenizer_config.json
    changes nothing beside a tokenizer.json."""
    for probe in ("a", "Hello", "0", "."):
        bare = tok.encode(probe, add_special_tokens=False).ids
        if not bare:
            continue
        full = tok.encode(probe, add_special_tokens=True).ids
        starts = [i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare]
        return full[:starts[0]] if starts else []
    return []


class HFTokenizer(TokenizerCodec):
    missing_token = HFTokenizerError

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise HFTokenizerError(f"{str(folder)!r}: no tokenizer.json")
        self.tok = read_tokenizer(path)
        conf_path = folder / "tokenizer_config.json"
        try:
            conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HFTokenizerError(f"{str(conf_path)!r}: not readable JSON "
                                   f"({str(e).splitlines()[0]})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        eos, bos = token_text(conf.get("eos_token")), token_text(conf.get("bos_token"))
        self.eos_id = self.tok.token_to_id(eos) if eos else None
        self.bos_id = self.tok.token_to_id(bos) if bos else None
        if eos and self.eos_id is None:
            raise HFTokenizerError(f"{str(conf_path)!r}: eos_token {eos!r} is not a token")
        self.bos = bos_prefix(self.tok)
        self.chat_template = chat_template(folder, conf.get("chat_template"))
        self.end_ids = _generation_eos(folder, self.vocab_size)


def _generation_eos(folder: Path, vocab_size: int) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (one id or a list; Llama 3.1 lists its end of
    turn and end of text): where transformers' generate stops besides the tokenizer's eos."""
    path = folder / "generation_config.json"
    try:
        ids = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise HFTokenizerError(f"{str(path)!r}: not a readable JSON object "
                               f"({str(e).splitlines()[0]})") from None
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise HFTokenizerError(f"{str(path)!r}: eos_token_id={ids!r} must be token ids below "
                               f"{vocab_size}")
    return tuple(ids)


def chat_template(folder: Path, inline) -> str | None:
    """The folder's chat template: chat_template.jinja (where transformers now saves it), or
    tokenizer_config.json's, a string or a list of named ones (the one named default)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if isinstance(inline, list):
        named = {t.get("name"): t.get("template") for t in inline if isinstance(t, dict)}
        inline = named.get("default")
    return inline if isinstance(inline, str) else None
