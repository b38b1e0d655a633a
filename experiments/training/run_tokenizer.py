"""A run's tokenizer: bytes for a run trained from random weights, else the vocabulary of the
pretrained model at the root of its chain (experiments/training/lineage.py). Every command that
reads a run's text (training data, validation, calibration, prompts, samples) goes through here,
so a token model is never fed bytes. Importing this module does not import JAX.
"""

from __future__ import annotations

import numpy as np

from experiments.cli.config import ConfigError, check_text
from experiments.training import lineage
from model.gguf import GGUFFile
from model.llama_gguf import package_gguf_path
from model.tokenizer import BPETokenizer, tokenizer_from_gguf


def pretrained_tokenizer(name: str) -> BPETokenizer:
    """The tokenizer of the registered pretrained model `name`."""
    g = GGUFFile(package_gguf_path())  # the one registered model (lineage.PRETRAINED_INITS)
    return tokenizer_from_gguf(g)


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
