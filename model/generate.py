"""Autoregressive generation with a KV cache (greedy or temperature / top-k sampling)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample_token(logits_BxV: jax.Array, key: jax.Array, temperature: float,
                 top_k: int) -> jax.Array:
    if temperature <= 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits = logits_BxV / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


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
                 key: jax.Array, temperature: float = 0.0, top_k: int = 0) -> jax.Array:
    """[B, steps] tokens: `first_B` (already chosen, at position `index`), then `steps - 1` more,
    each one single-position forward pass over the cache, in one `lax.scan` (no host round
    trip per token)."""

    def step(carry, i):
        token, cache, key = carry
        logits, cache = model.decode(token[:, None], cache, index + i, layers)
        key, sub = jax.random.split(key)
        nxt = sample_token(logits[:, -1], sub, temperature, top_k)
        return (nxt, cache, key), token

    (_, _, _), out = jax.lax.scan(step, (first_B, cache, key), jnp.arange(steps))
    return out.T


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
    first = sample_token(logits, sub, temperature, top_k)
    out = decode_steps(model, first, cache, layers, prompt_BxT.shape[1], max_new_tokens, key,
                       temperature, top_k)
    return jnp.concatenate([prompt_BxT, out], axis=1)


@functools.lru_cache(maxsize=16)
def _stream_step(graphdef, weights, temperature: float, top_k: int):
    """`stream`'s jitted call (prefill, then one token), one per model structure, weight tree
    (`weights`: the treedef of (params, per-layer weights)) and sampling setting, so that later
    replies reuse its compiled programs: the same cache shape (budgets within one block of
    positions) reuses the step, the same prompt length the prefill.

    The weights come as a flat list of arrays: flattening the model's own pytree at every call
    (its variables flatten in Python) would cost a decoding step milliseconds before it starts.
    The cache is donated: each step writes one position into it in place, where an undonated
    input would be copied whole into the step's output at every token. The next token comes
    back as [B, 1], the next step's input."""

    @functools.partial(jax.jit, donate_argnums=2)
    def step(leaves, tokens, cache, index, key):
        params, layers = jax.tree.unflatten(weights, leaves)
        logits, cache = nnx.merge(graphdef, params).decode(tokens, cache, index, layers,
                                                           last_only=True)
        return sample_token(logits[:, -1], key, temperature, top_k)[:, None], cache

    return step


def stream(graphdef, params, prompt_1xT: jax.Array, max_new_tokens: int, key: jax.Array,
           temperature: float = 0.0, top_k: int = 0, stop_ids: tuple[int, ...] = (),
           make_cache=None, per_layer: bool | None = None):
    """Yield new tokens one at a time (batch 1), stopping after a token in `stop_ids`.

    The same prefill + cached single-position steps as `generate`, but each step is its own
    jitted call so a caller can print tokens as they come and stop early (a chat turn ends at
    its end-of-turn token, usually long before `max_new_tokens`). The cache is sized for the
    prompt plus `max_new_tokens`, so every step reuses one compiled program, compiled before
    the first token is yielded (a caller timing the tokens after the first times decoding, not
    a compile). Each step is dispatched before the previous token is read, so one step past a
    stop token is computed and dropped. `per_layer` chooses the layer layout as in `generate`
    (None: `default_per_layer`).
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
    step = _stream_step(graphdef, weights, temperature, top_k)
    token, cache = step(leaves, prompt_1xT, cache, 0, key)  # prefill: its own program
    if max_new_tokens > 1:
        # the one-token program, compiled now (or found in jit's cache) rather than at the
        # second token: tracing it runs nothing
        step.lower(leaves, token, cache, T, key).compile()
    for i in range(max_new_tokens):
        following = None
        if i + 1 < max_new_tokens:
            # The next step is dispatched before this token is read: the host prepares it while
            # the device still computes this one (a stop token discards it).
            if temperature > 0.0:  # greedy reads no key: no eager split between steps
                key, sub = jax.random.split(key)
            else:
                sub = key
            following, cache = step(leaves, token, cache, T + i, sub)
        value = int(np.asarray(token)[0, 0])
        yield value
        if value in stop_ids or following is None:
            return
        token = following
