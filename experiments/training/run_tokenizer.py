"""A run's tokenizer: bytes for a run trained from random weights, else the tokenizer of the
pretrained model at the root of its chain (experiments/training/lineage.py): a registered
model's (BPE for SmolLM2, SentencePiece for Gemma 3), a GGUF file's, or a Hugging Face
folder's tokenizer.json. Every command that reads a run's text (training data, validation,
calibration, prompts, samples) goes through here, so a token model is never fed bytes.
Importing this module does not import JAX.
"""

from __future__ import annotations

import numpy as np

from experiments.cli.config import ConfigError, check_text
from experiments.pretrained import model_ref, registered
from experiments.training import lineage
from model.gguf import GGUFFile
from model.hf_tokenizer import HFTokenizer
from model.tokenizer import BPETokenizer


def pretrained_tokenizer(ref: str) -> BPETokenizer:
    """The tokenizer of the pretrained model `ref` (a registered name, a .gguf file or a Hugging
    Face folder). ValueError (one line) when it cannot be read."""
    kind = model_ref.resolve(ref, "init").kind
    if kind == "hf":
        return HFTokenizer(ref)
    if kind == "name":
        return registered.registered_tokenizer(ref)
    return registered.gguf_tokenizer(GGUFFile(ref))


def tokenizer_for(init: str | None) -> BPETokenizer | None:
    """The tokenizer of a run whose `init` is this (None: the tokens are bytes). ConfigError
    naming `init` when the chain is broken or the model's tokenizer cannot be read."""
    origin = lineage.origin(init)
    if origin.byte_tokens:
        return None
    try:
        return pretrained_tokenizer(origin.pretrained)
    except ValueError as e:  # GGUFError is one
        raise ConfigError(f"init={init!r}: the tokenizer of {origin.pretrained!r} cannot be "
                          f"read ({str(e).splitlines()[0]})") from None


def encode_prompt(tokenizer: BPETokenizer | None, text: str) -> np.ndarray:
    """A prompt as token ids [1, n]. A byte model takes any bytes: argv bytes that are not
    UTF-8 (lone surrogates) go in as they were typed."""
    if tokenizer is None:
        raw = text.encode("utf-8", "surrogateescape")
        return np.frombuffer(raw, np.uint8).astype(np.int32)[None]
    check_text("prompt", text, blank_ok=True)  # a tokenizer takes only valid UTF-8
    return np.asarray(tokenizer.encode(text), np.int32)[None]


def decode(tokenizer: BPETokenizer | None, ids) -> str:
    ids = np.asarray(ids)
    if tokenizer is None:
        return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
    return tokenizer.decode(ids.tolist(), skip_special=True)
