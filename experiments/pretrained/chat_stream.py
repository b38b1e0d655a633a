"""One chat reply of a pretrained LM, streamed token by token from the KV cache.

`experiments.chat` prints what `stream_reply` hands its `on_text` callback; the row it returns is
that launcher's JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np

from experiments.cli.config import ConfigError
from experiments.pretrained.loading import Pretrained, conversation_ids
from model.generate import stream
from model.tokenizer import StreamDecoder
from quant.kv_cache import init_int8_cache


def turn_key(seed: int, turn: int) -> jax.Array:
    """The sampling key of a conversation's `turn`: turn 0 gets the seed's own key, so a
    one-shot run and the first turn of a conversation sample alike."""
    key = jax.random.key(seed)
    return jax.random.fold_in(key, turn) if turn else key


def stream_reply(pre: Pretrained, messages: list[dict[str, str]], system: str | None,
                 max_new_tokens: int, key: jax.Array, temperature: float = 0.0, top_k: int = 0,
                 kv_int8: bool = False,
                 on_text: Callable[[str], None] | None = None,
                 per_layer: bool | None = None) -> dict:
    """The assistant's reply to `messages`: {"reply", "tokens", "new_tokens", "seconds",
    "tokens_per_s"} (the speed after the prompt's prefill and its compile). `on_text` receives
    the text as it decodes, whole characters only, and a final newline. `per_layer`: the layer
    layout of the steps (None: model.generate's rule)."""
    ids = conversation_ids(pre, messages, system)
    if len(ids) + max_new_tokens > pre.cfg.max_len:
        what = "the prompt" if len(messages) == 1 else "the conversation"
        raise ConfigError(f"max_new_tokens={max_new_tokens}: {what} ({len(ids)} tokens) "
                          f"+ new tokens must fit the context of {pre.cfg.max_len}")
    tokens, first, text = [], None, StreamDecoder(pre.tokenizer)
    for tok in stream(pre.graphdef, pre.params, np.asarray([ids], np.int32), max_new_tokens,
                      key, temperature, top_k, stop_ids=pre.tokenizer.stop_ids,
                      make_cache=init_int8_cache if kv_int8 else None, per_layer=per_layer):
        if first is None:
            first = time.perf_counter()  # prefill (and its compile) done
        tokens.append(tok)
        if on_text is not None:
            on_text(text.push(tok))  # a character split over tokens waits for its last byte
    if on_text is not None:
        on_text(text.flush() + "\n")
    seconds = time.perf_counter() - first
    return {"reply": pre.tokenizer.decode(tokens, skip_special=True), "tokens": tokens,
            "new_tokens": len(tokens), "seconds": seconds,
            "tokens_per_s": (len(tokens) - 1) / seconds if len(tokens) > 1 else None}
