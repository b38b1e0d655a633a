"""Autoregressive generation with a KV cache (greedy or temperature / top-k sampling)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import native_argmax


def sample_token(logits_BxV: jax.Array, key: jax.Array, temperature: float,
                 top_k: int, native: bool = True) -> jax.Array:
    """The next token [B] from the logits: greedy (`temperature` 0: in shardq's kernel with
    `native`, `model.native_argmax`, else XLA's argmax), or sampled at `temperature` from the
    `top_k` most likely (0: all)."""
    if temperature <= 0.0:
        return (native_argmax.argmax if native else native_argmax.xla_argmax)(logits_BxV)
    logits = logits_BxV / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def picks_in_kernel(model) -> bool:
    """Whether a decoding step of `model` picks greedy tokens in shardq's kernel: where its
    layers run shardq's kernels (`model.layers.use_native_float`; int8 layers by default), not
    where a caller keeps XLA's operations (a step split over devices, whose logits are sharded
    over the vocabulary: a custom call would gather them whole)."""
    return any(getattr(m, "native", False) for _, m in nnx.iter_modules(model))


def default_per_layer(model) -> bool:
    """Whether decoding should split the blocks into per-layer arrays: yes, unless a block's
    module asks for the stacked layer scan (a `prefers_layer_scan()` method returning True). In
    the scan every step copies each layer's weights out of the stack before its products;
    per-layer arrays are read where they lie. An int8 Dense whose products XLA runs asks for
    the scan: there a weight-only kernel's int8 -> float conversion would be hoisted out of the
    token loop, holding a float32 copy of every kernel while it generates (quant/dense.py)."""
    return not any(getattr(m, "prefers_layer_scan", lambda: False)()
                   for _, m in nnx.iter_modules(model.blocks))


def prefill(model, prompt_BxT: jax.Array, max_new_tokens: int, cache_dtype=None,
            make_cache=None, per_layer: bool | None = None
            ) -> tuple[jax.Array, object, list | None]:
    """Prefill: (logits [B, vocab] after the prompt, cache, per-layer block states or None).

    The cache is sized for the prompt plus `max_new_tokens`. With `per_layer` (None:
    `default_per_layer`) the blocks' weights and the cache are split into one array per layer
    once, here, so that every later step reads each weight where it lies."""
    if per_layer is None:
        per_layer = default_per_layer(model)
    B, T = prompt_BxT.shape
    total = T + max_new_tokens
    if total > model.cfg.max_len:
        raise ValueError(f"max_new_tokens={max_new_tokens}: prompt ({T}) + new tokens must fit "
                         f"the context of {model.cfg.max_len}")
    cache = (make_cache(model.cfg, B, total) if make_cache is not None
             else model.init_cache(B, total, cache_dtype))
    layers = model.unstack_layers() if per_layer else None
    if per_layer:
        cache = model.unstack_cache(cache)
    logits, cache = model.decode(prompt_BxT, cache, 0, layers, last_only=True)
    return logits[:, -1], cache, layers


def decode_steps(model, first_B: jax.Array, cache, layers, index, steps: int,
                 key: jax.Array, temperature: float = 0.0, top_k: int = 0,
                 return_cache: bool = False):
    """[B, steps] tokens: `first_B` (already chosen, at position `index`), then `steps - 1` more,
    each one single-position forward pass over the cache, in one `lax.scan` (no host round
    trip per token). With `return_cache`, (tokens, the cache after them): a caller that donates
    the cache gets it written in place."""

    native = picks_in_kernel(model)

    def step(carry, i):
        token, cache, key = carry
        logits, cache = model.decode(token[:, None], cache, index + i, layers)
        key, sub = jax.random.split(key)
        nxt = sample_token(logits[:, -1], sub, temperature, top_k, native)
        return (nxt, cache, key), token

    (_, cache, _), out = jax.lax.scan(step, (first_B, cache, key), jnp.arange(steps))
    return (out.T, cache) if return_cache else out.T


def generate(graphdef, params, prompt_BxT: jax.Array, max_new_tokens: int, key: jax.Array,
             temperature: float = 0.0, top_k: int = 0, cache_dtype=None,
             make_cache=None, per_layer: bool | None = None) -> jax.Array:
    """[B, T + max_new_tokens] tokens: the prompt, then what the model wrote.

    The prompt is run once (prefill) to fill the cache; each new token then costs one
    single-position forward pass over the cached keys and values. `make_cache(cfg, batch,
    length)` supplies another cache kind (e.g. `quant.kv_cache.init_int8_cache`); `per_layer`
    chooses the layer layout of the steps (None: `default_per_layer`; False: the stacked layer
    scan the training forward runs).
    """
    model = nnx.merge(graphdef, params)
    logits, cache, layers = prefill(model, prompt_BxT, max_new_tokens, cache_dtype, make_cache,
                                    per_layer)
    key, sub = jax.random.split(key)
    first = sample_token(logits, sub, temperature, top_k, picks_in_kernel(model))
    out = decode_steps(model, first, cache, layers, prompt_BxT.shape[1], max_new_tokens, key,
                       temperature, top_k)
    return jnp.concatenate([prompt_BxT, out], axis=1)


# How many tokens the chat stream's loops decode per call: the first loop STREAM_FIRST_CHUNK,
# each next one twice as many as the one before, up to STREAM_CHUNK. Every call costs the host
# a dispatch (it passes every weight array) and its first step runs slower than the steps after
# it, so a call per token slows int8 decoding; a host callback per token from one long loop
# costs more still on XLA:CPU. Short loops first keep the first tokens coming quickly.
STREAM_FIRST_CHUNK = 8
STREAM_CHUNK = 32


@functools.lru_cache(maxsize=16)
def _stream_programs(graphdef, weights, temperature: float, top_k: int):
    """`stream`'s two jitted calls, one pair per model structure, weight tree (`weights`: the
    treedef of (params, per-layer weights)) and sampling setting, so that later replies reuse
    their compiled programs: the same cache shape (budgets within one block of positions)
    reuses the loop, the same prompt length the prefill.

    `first(leaves, prompt, cache, key)` runs the prompt into the cache and picks the first new
    token, drawing on the key as `generate` does. `chunk(leaves, token, cache, index, count,
    key, stop_ids, stopped)` decodes up to `count` (at most `STREAM_CHUNK`) more tokens in one
    `lax.while_loop`, ending early after a token in `stop_ids` (-1 pads it), or at once when
    `stopped`: (tokens [1, STREAM_CHUNK], how many it wrote, the last token, cache, key,
    stopped), the inputs of the next chunk. So a chunk can be dispatched before the one before
    it has finished, and computes nothing once a stop token has come.

    The weights come as a flat list of arrays: flattening the model's own pytree at every call
    (its variables flatten in Python) would cost milliseconds before the program starts. The
    cache is donated: each step writes one position into it in place, where an undonated input
    would be copied whole into the program's output."""

    def model_of(leaves):
        params, layers = jax.tree.unflatten(weights, leaves)
        return nnx.merge(graphdef, params), layers

    def split(key):  # greedy reads no key: no split per step
        return jax.random.split(key) if temperature > 0.0 else (key, key)

    @functools.partial(jax.jit, donate_argnums=2)
    def first(leaves, prompt, cache, key):
        model, layers = model_of(leaves)
        logits, cache = model.decode(prompt, cache, 0, layers, last_only=True)
        key, sub = split(key)
        return sample_token(logits[:, -1], sub, temperature, top_k,
                            picks_in_kernel(model))[:, None], cache, key

    @functools.partial(jax.jit, donate_argnums=2)
    def chunk(leaves, token, cache, index, count, key, stop_ids, stopped):
        model, layers = model_of(leaves)
        native = picks_in_kernel(model)

        def step(state):
            i, out, token, cache, key, _ = state
            key, sub = split(key)
            logits, cache = model.decode(token, cache, index + i, layers, last_only=True)
            token = sample_token(logits[:, -1], sub, temperature, top_k, native)[:, None]
            out = jax.lax.dynamic_update_slice(out, token, (0, i))
            return i + 1, out, token, cache, key, jnp.any(token[0, 0] == stop_ids)

        state = (jnp.int32(0), jnp.zeros((1, STREAM_CHUNK), jnp.int32), token, cache, key,
                 stopped)
        i, out, token, cache, key, stopped = jax.lax.while_loop(
            lambda s: ~s[5] & (s[0] < count), step, state)
        return out, i, token, cache, key, stopped

    return first, chunk


def stream(graphdef, params, prompt_1xT: jax.Array, max_new_tokens: int, key: jax.Array,
           temperature: float = 0.0, top_k: int = 0, stop_ids: tuple[int, ...] = (),
           make_cache=None, per_layer: bool | None = None):
    """Yield new tokens (batch 1), stopping after a token in `stop_ids`.

    The same prefill + cached single-position steps as `generate` (the same tokens, greedy or
    sampled), handed out as they are decoded so a caller can print them as they come, and
    ending at a stop token (a chat turn ends at its end-of-turn token, usually long before
    `max_new_tokens`). The first token comes from the prompt's call; the rest come a chunk at a
    time from compiled loops (`STREAM_FIRST_CHUNK` tokens, then twice as many each time, up to
    `STREAM_CHUNK`), each dispatched before the previous one's tokens are read: the host's work
    overlaps the device's, and no step runs past a stop token. The cache is sized for the
    prompt plus `max_new_tokens`, so replies of one budget reuse one compiled loop, compiled
    before the first token is yielded (a caller timing the tokens after the first times
    decoding, not a compile). `per_layer` chooses the layer layout as in `generate` (None:
    `default_per_layer`).
    """
    model = nnx.merge(graphdef, params)
    T = prompt_1xT.shape[1]
    total = T + max_new_tokens
    if total > model.cfg.max_len:
        raise ValueError(f"max_new_tokens={max_new_tokens}: prompt ({T}) + new tokens must fit "
                         f"the context of {model.cfg.max_len}")
    cache = (make_cache(model.cfg, 1, total) if make_cache is not None
             else model.init_cache(1, total))
    layers = None
    if default_per_layer(model) if per_layer is None else per_layer:
        # split once, eagerly: each step then reads weights in place
        layers, cache = model.unstack_layers(), model.unstack_cache(cache)

    leaves, weights = jax.tree.flatten((params, layers))
    first, chunk = _stream_programs(graphdef, weights, temperature, top_k)
    token, cache, key = first(leaves, prompt_1xT, cache, key)
    stops = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
    stopped = jnp.any(token[0, 0] == stops)
    state = (token, cache, key, stopped)
    # compiled now (or found in jit's cache) rather than after the first token is shown
    chunk.lower(leaves, token, cache, 0, 0, key, stops, stopped).compile()

    value = int(np.asarray(token)[0, 0])
    pending = []  # chunks in flight, with how many tokens each was asked for
    planned, size = 1, STREAM_FIRST_CHUNK  # new tokens covered so far; the next chunk's size

    def queue(state) -> None:  # the next chunk, behind the ones in flight
        nonlocal planned, size
        if planned < max_new_tokens:
            ask = min(size, max_new_tokens - planned)
            token, cache, key, stopped = state  # its first step writes position T + planned - 1
            pending.append((chunk(leaves, token, cache, T + planned - 1, ask, key, stops,
                                  stopped), ask))
            planned, size = planned + ask, min(2 * size, STREAM_CHUNK)

    queue(state)
    yield value
    while pending:
        (out, n, *state), ask = pending.pop(0)
        queue(state)  # dispatched before this chunk's tokens are read
        n = int(n)
        yield from np.asarray(out)[0, :n].tolist()
        if n < ask:  # a stop token: a queued chunk runs no step
            return
