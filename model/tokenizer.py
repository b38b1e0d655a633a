"""The byte-level BPE tokenizer of a GGUF file (GPT-2 style), and the ChatML chat format.

Built with the `tokenizers` library from the file's `tokenizer.ggml.tokens` and `merges`;
tokens whose `token_type` is 3 (control: `<|im_start|>`, `<|im_end|>`, ...) are special tokens
matched whole in the text. No BOS is added (`tokenizer.ggml.add_bos_token` is false for SmolLM2).

Pre-tokenizer, by the name the file gives it (`tokenizer.ggml.pre`, llama.cpp's names):
  gpt-2, gpt2        GPT-2's regex;
  smollm             every number character (\\p{N}) on its own, then GPT-2's regex (SmolLM2's
                     tokenizer.json: individual digits + ByteLevel); transformers' GGUF converter
                     does not know `smollm` and falls back to GPT-2's split alone, which keeps
                     digit runs together: see experiments/reference/make_smollm2_reference.py;
  llama-bpe, qwen2   the model's own regex in place of GPT-2's (Llama 3's and Qwen2's
                     tokenizer.json: a Split on it, then ByteLevel without its regex): words
                     with their leading punctuation, numbers in runs of up to three digits
                     (llama-bpe, where a piece that is a token is taken whole, and BOS is
                     added unless the file says not) or one digit at a time (qwen2).
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from model.chat_template import ChatTemplateError
from model.chat_template import render as render_chat
from model.gguf import GGUFError, GGUFFile

# llama.cpp's token types: control is a special token, user-defined one matched whole in the
# text but not special, byte a <0xNN> piece of SentencePiece's byte fallback
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPIECE_SPACE = "\u2581"  # SentencePiece's visible space
# The split before GPT-2's regex, by GGUF pre-tokenizer name (llama.cpp writes GPT-2's own as
# gpt-2; gpt2 is the same split).
PRE_TOKENIZER_SPLITS = {"smollm": r"\p{N}", "gpt2": None, "gpt-2": None}
# The regex that replaces GPT-2's, by GGUF pre-tokenizer name: tokenizer.json's own (llama.cpp
# names several spellings of each; the first of each regex is what its converter writes).
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX, _QWEN2_REGEX = _WORDS + r"\p{N}{1,3}" + _REST, _WORDS + r"\p{N}" + _REST
PRE_TOKENIZER_REGEXES = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX,
                         "llama-v3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX,
                         "deepseek-r1-qwen": _QWEN2_REGEX}
# Llama 3's: a piece that is a token is that token, whatever the merges would make of it
# (tokenizer.json's `ignore_merges`); llama.cpp also adds BOS unless the file says not.
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class TokenizerCodec:
    """encode / decode / token_id over a `tokenizers.Tokenizer` (`self.tok`), `self.bos`
    prepended by encode; `missing_token` is the error a token the vocabulary lacks raises;
    `chat_template` the model's own (None: none), which `chat_prompt` renders. The GGUF
    tokenizer and the Hugging Face folder's share it."""

    missing_token: type[Exception] = GGUFError
    chat_template: str | None = None
    bos_id: int | None = None
    end_ids: tuple[int, ...] = ()  # tokens besides eos_id that end a reply (see stop_ids)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens a reply stops at: eos_id, then the model's other end tokens (a GGUF's
        end-of-turn, a folder's generation_config.json eos ids), as llama.cpp and transformers'
        generate stop at each."""
        ids = [self.eos_id, *self.end_ids]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return (self.bos if add_bos else []) + ids

    def chat_prompt(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """The conversation in the model's own chat template (ChatTemplateError, one line, when
        it has none or refuses the messages); encode it with add_bos=False."""
        if not self.chat_template:
            raise ChatTemplateError("chat_template: the model has none")
        text = lambda i: "" if i is None else (self.tok.id_to_token(i) or "")  # noqa: E731
        return render_chat(self.chat_template, messages,
                           add_generation_prompt=add_generation_prompt,
                           bos_token=text(self.bos_id), eos_token=text(self.eos_id))

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int:
        i = self.tok.token_to_id(token)
        if i is None:
            raise self.missing_token(f"tokenizer: no token {token!r}")
        return i


class BPETokenizer(TokenizerCodec):
    """encode(text) -> ids (no BOS), decode(ids) -> text; `eos_id` ends a chat turn."""

    def __init__(self, tokens: list[str], merges: list[str], token_types, *, pre: str,
                 eos_id: int, add_bos: bool = False, bos_id: int | None = None):
        if pre not in PRE_TOKENIZER_SPLITS and pre not in PRE_TOKENIZER_REGEXES:
            raise GGUFError(f"tokenizer.ggml.pre={pre!r}: not supported (known: "
                            f"{', '.join([*PRE_TOKENIZER_SPLITS, *PRE_TOKENIZER_REGEXES])})")
        if len(token_types) != len(tokens):
            raise GGUFError(f"tokenizer: {len(token_types)} token types for {len(tokens)} tokens")
        if not 0 <= eos_id < len(tokens):
            raise GGUFError(f"tokenizer: eos id {eos_id} outside the vocabulary of {len(tokens)}")
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise GGUFError("tokenizer: the vocabulary lists a token twice")
        pairs = []
        for m in merges:
            pair = tuple(m.split(" "))
            if len(pair) != 2:
                raise GGUFError(f"tokenizer: merge {m!r} is not two tokens")
            pairs.append(pair)
        try:
            tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                       ignore_merges=pre in IGNORE_MERGES))
        except Exception as e:  # tokenizers raises its own Exception type on bad merges
            raise GGUFError(f"tokenizer: BPE model cannot be built ({str(e)[:120]})") from None
        own_regex = pre in PRE_TOKENIZER_REGEXES
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not own_regex)
        split = PRE_TOKENIZER_REGEXES[pre] if own_regex else PRE_TOKENIZER_SPLITS[pre]
        tok.pre_tokenizer = (byte_level if split is None else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]))
        tok.decoder = decoders.ByteLevel()
        kinds = list(zip(tokens, token_types, strict=True))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in kinds if kind == CONTROL])
        # user-defined tokens are matched whole too, as llama.cpp does, but decode as text
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in kinds if kind == USER_DEFINED])
        self.tok, self.eos_id, self.vocab_size = tok, eos_id, len(tokens)
        self.bos = [bos_id] if add_bos and bos_id is not None else []
        self.bos_id = bos_id



def respelled(tokens: list[str]) -> list[str]:
    """Tokens that are runs of spaces (as Gemma files store them) spelled as U+2581 runs, as
    the text reaches them."""
    return [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def ranked_merges(vocab: dict[str, int], scores=None) -> list[tuple[str, str]]:
    """BPE merges recovered from a SentencePiece vocabulary that lists none: every split of a
    token into two tokens, best first by the merged token's score (`scores[id]`, as
    SentencePiece and llama.cpp rank them: Llama's runs of spaces score lowest of all), or with
    `scores` None by its position (a Gemma file's scores do not follow its merge order; its
    token order does), then longer left and right pieces first, as transformers'
    `generate_merges` orders them."""
    merges = []
    for token, index in vocab.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        rank = -index if scores is None else float(scores[index])
        merges += [(rank, left, right) for left, right in local]
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in merges]


class SentencePieceTokenizer(TokenizerCodec):
    """A GGUF's SentencePiece-style vocabulary (`tokenizer.ggml.model` llama: Llama 2's,
    Gemma's): spaces written as U+2581, BPE over merges recovered from the scores (Gemma's: the
    token order), unknown bytes as <0xNN> tokens (byte fallback). Built as transformers builds
    it from the same file (GemmaTokenizer after its GGUF fixes for Gemma), so both encode a
    text to the same ids: tokens that are runs of spaces are respelled as U+2581 runs, control
    tokens are special tokens and user-defined ones are matched whole."""

    def __init__(self, tokens: list[str], token_types, *, eos_id: int, unk: str,
                 add_bos: bool, bos_id: int | None, built: Path | None = None,
                 add_space_prefix: bool = False, scores=None):
        """`built`: a tokenizer.json this constructor wrote for the same file before (read
        instead of recovering the merges again, the slow part), or where to write it;
        `scores`: the file's, which rank the merges (None: the token order ranks them)."""
        self.eos_id, self.vocab_size = eos_id, len(tokens)
        self.bos = [bos_id] if add_bos and bos_id is not None else []
        self.bos_id = bos_id
        if built is not None and built.is_file():
            self.tok = Tokenizer.from_file(str(built))
            return
        if len(token_types) != len(tokens):
            raise GGUFError(f"tokenizer: {len(token_types)} token types for {len(tokens)} tokens")
        if not 0 <= eos_id < len(tokens):
            raise GGUFError(f"tokenizer: eos id {eos_id} outside the vocabulary of {len(tokens)}")
        vocab = {t: i for i, t in enumerate(respelled(tokens))}
        try:
            tok = Tokenizer(models.BPE(vocab=vocab, merges=ranked_merges(vocab, scores),
                                       fuse_unk=True, unk_token=unk, byte_fallback=True))
        except Exception as e:  # tokenizers raises its own Exception type on bad merges
            raise GGUFError(f"tokenizer: BPE model cannot be built ({str(e)[:120]})") from None
        if add_space_prefix:  # Llama's: a space before the text, dropped again when decoding
            tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE),
                                                   normalizers.Replace(" ", SPIECE_SPACE)])
            tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "),
                                             decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        else:
            tok.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
            tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
            tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "),
                                             decoders.ByteFallback(), decoders.Fuse()])
        kinds = list(zip(tokens, token_types, strict=True))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in kinds if kind == CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in kinds if kind == USER_DEFINED and t in vocab])
        self.tok = tok
        if built is not None:  # written beside, then renamed: a reader never sees half a file
            part = built.with_name(built.name + ".part")
            tok.save(str(part))
            os.replace(part, built)


class StreamDecoder:
    """The text of tokens arriving one at a time, as soon as it is whole. A byte-level token
    can end inside a UTF-8 character (most CJK characters and emoji take two or three tokens),
    and decoding it alone gives U+FFFD; its bytes are held back until the character completes.
    Decoding restarts after the last piece handed out, so each token costs the few tokens held
    back, not the whole reply."""

    def __init__(self, tokenizer: BPETokenizer, skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.pending: list[int] = []

    def push(self, token: int) -> str:
        """The new whole characters after `token` ("" while a character is incomplete)."""
        self.pending.append(int(token))
        text = self.tokenizer.decode(self.pending, skip_special=self.skip_special)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        """Whatever is held back, as is (an incomplete character stays U+FFFD)."""
        text = self.tokenizer.decode(self.pending, skip_special=self.skip_special)
        self.pending = []
        return text


def tokenizer_from_gguf(g: GGUFFile, built: Path | None = None
                        ) -> BPETokenizer | SentencePieceTokenizer:
    """The tokenizer a GGUF file describes: byte-level BPE (tokenizer.ggml.model gpt2) or a
    Gemma file's SentencePiece vocabulary (llama, architecture gemma3; `built`: where its
    built form is kept, see SentencePieceTokenizer)."""
    tok = _tokenizer_of(g, built)
    if "tokenizer.chat_template" in g.metadata:
        tok.chat_template = g.get_str("tokenizer.chat_template")
    tok.end_ids = tuple(g.get_int(f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom")
                        if f"tokenizer.ggml.{kind}_token_id" in g.metadata)
    if any(not 0 <= i < tok.vocab_size for i in tok.end_ids):
        raise GGUFError(f"{str(g.path)!r}: an end-of-turn token id {tok.end_ids} is outside "
                        f"the vocabulary of {tok.vocab_size}")
    return tok


def _tokenizer_of(g: GGUFFile, built: Path | None) -> BPETokenizer | SentencePieceTokenizer:
    kind = g.get_str("tokenizer.ggml.model")
    bos = g.get_int("tokenizer.ggml.bos_token_id") if "tokenizer.ggml.bos_token_id" in \
        g.metadata else None
    if kind == "llama":
        tokens = g.get_strings("tokenizer.ggml.tokens")
        unk = (g.get_int("tokenizer.ggml.unknown_token_id")
               if "tokenizer.ggml.unknown_token_id" in g.metadata else None)
        if unk is None or not 0 <= unk < len(tokens):
            raise GGUFError(f"{str(g.path)!r}: tokenizer.ggml.unknown_token_id missing or "
                            f"outside the vocabulary")
        # llama.cpp adds BOS, and a space before the text, to a SentencePiece vocabulary
        # unless the file says otherwise (Gemma's says no space)
        ranked = not g.get_str("general.architecture").startswith("gemma") and \
            "tokenizer.ggml.scores" in g.metadata
        return SentencePieceTokenizer(tokens, g.get_ints("tokenizer.ggml.token_type").tolist(),
                                      scores=(g.get_floats("tokenizer.ggml.scores") if ranked
                                              else None),
                                      eos_id=g.get_int("tokenizer.ggml.eos_token_id"),
                                      unk=tokens[unk], bos_id=bos, built=built,
                                      add_bos=g.get_bool("tokenizer.ggml.add_bos_token",
                                                         default=True),
                                      add_space_prefix=g.get_bool(
                                          "tokenizer.ggml.add_space_prefix", default=True))
    if kind != "gpt2":
        raise GGUFError(f"{str(g.path)!r}: tokenizer.ggml.model={kind!r} is not supported "
                        f"(byte-level BPE 'gpt2', or SentencePiece 'llama')")
    pre = g.get_str("tokenizer.ggml.pre") if "tokenizer.ggml.pre" in g.metadata else "gpt2"
    return BPETokenizer(g.get_strings("tokenizer.ggml.tokens"),
                        g.get_strings("tokenizer.ggml.merges"),
                        g.get_ints("tokenizer.ggml.token_type").tolist(), pre=pre,
                        eos_id=g.get_int("tokenizer.ggml.eos_token_id"),
                        add_bos=g.get_bool("tokenizer.ggml.add_bos_token",
                                           default=pre in IGNORE_MERGES),
                        bos_id=bos)


def chat_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True,
                default_system: str | None = DEFAULT_SYSTEM) -> str:
    """ChatML, as SmolLM2's chat template writes it: `<|im_start|>role\\ncontent<|im_end|>\\n`
    per message, a default system message first unless the messages start with one, then
    `<|im_start|>assistant\\n` for the reply."""
    parts = []
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for m in messages:
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
