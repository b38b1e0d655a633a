"""Attention over a KV cache, block by block, so that the result never depends on the cache's size.

A cache is sized for the prompt plus the token budget. Attending over all of it at once (scores
over S positions, softmax over S, weighted sum over S) makes XLA sum in an order that depends on
S, so the same prompt would give slightly different logits for different budgets, and a greedy
reply's tokens could change with `--max-new-tokens` (an int8 model rounds those differences
apart).

Here the cache is read in fixed blocks of `CACHE_BLOCK` positions with an online softmax (a
running max, denominator and weighted sum, as flash attention keeps them), and only the blocks
that hold a position some query may see are visited. Every block has the same shape whatever S
is and the blocks are visited in order, so the arithmetic for a given prompt and step is the
same for every cache size: a reply with a larger budget begins with the reply of a smaller one,
bit for bit. It also reads only the written part of a long cache.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from model import native_attention

# Positions per block; caches are allocated in whole blocks. A short chat turn fits one block,
# so its decoding runs no block loop at all, while a block stays small against a long cache.
CACHE_BLOCK = 256


def padded_length(length: int) -> int:
    """The cache length to allocate for `length` positions: whole blocks."""
    if length < 1:
        raise ValueError(f"cache length={length}: must be a positive integer")
    return -(-length // CACHE_BLOCK) * CACHE_BLOCK


# Jitted so that an eager caller (a prefill run layer by layer, a test stepping token by token)
# compiles the block loop once per shape, not at every call; inside a jitted step it
# is inlined. The window is an operand, not a static argument: under a layer pattern (Gemma 3)
# each layer of one scan body reads its own.
@functools.partial(jax.jit, static_argnames="native")
def blocked_cached_attention(q_BxTxNxH: jax.Array, cache, positions_BxT: jax.Array,
                             last_position, window: int | None = None,
                             native: bool = False) -> jax.Array:
    """[B, T, N, H]: query t attends to the cache's positions <= positions_BxT[:, t].

    `cache` offers `length`, `kv_heads` and `block(start, size, dtype)` -> keys [B * K, H,
    size] and values [B * K, size, H] with K = `kv_heads` (model/kv_cache.py: the layouts the
    two products read as they lie; K divides N: grouped-query attention, query head n reads kv
    head n // (N / K), as Llama does). `last_position` (traced or static) is the
    largest query position: blocks past it are never read. With `window` (sliding-window
    attention; an integer or a traced one) query t also stops seeing positions before
    t - window + 1. With `native`, one query position over a cache that offers
    `native_operands()` (a float32 or an int8 one) is one call of shardq's kernel on a CPU
    (`model.native_attention`: the same blocks, equal to rounding).
    """
    B, T, N, H = q_BxTxNxH.shape
    S = cache.length
    if S % CACHE_BLOCK:
        raise ValueError(f"cache length={S}: must be a multiple of {CACHE_BLOCK} "
                         "(allocate it with model.cached_attention.padded_length)")
    # Heads grouped by the kv head they share: [B, K, G, T, H].
    K = cache.kv_heads
    G = N // K
    q = q_BxTxNxH.astype(jnp.float32).reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)
    q = q * jnp.asarray(1.0 / math.sqrt(H), jnp.float32)
    operands = getattr(cache, "native_operands", lambda: None)() if native and T == 1 else None
    if operands is not None and native_attention.status()["available"]:
        position = positions_BxT[:, 0].astype(jnp.int32)
        width = jnp.asarray(S if window is None else window, jnp.int32).reshape(1)
        out = jax.lax.platform_dependent(
            q.reshape(B * K, G, H), operands, position, width,
            cpu=native_attention.attend,
            default=lambda *_: _blocks(q, cache, positions_BxT, last_position, window).reshape(
                B * K, G, H))
        return out.reshape(B, T, N, H).astype(q_BxTxNxH.dtype)
    acc = _blocks(q, cache, positions_BxT, last_position, window)
    return acc.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q_BxTxNxH.dtype)


def _blocks(q: jax.Array, cache, positions_BxT: jax.Array, last_position, window
            ) -> jax.Array:
    """The attention of q [B, K, G, T, H] (scaled) in XLA's operations, block by block:
    [B, K, G, T, H]."""
    B, K, G, T, H = q.shape
    S = cache.length

    def visit(b, carry):
        m, denom, acc = carry
        start = b * CACHE_BLOCK
        k, v = cache.block(start, CACHE_BLOCK, jnp.float32)  # [B * K, H, C], [B * K, C, H]
        s = jnp.einsum("xrh,xhc->xrc", q.reshape(B * K, G * T, H), k).reshape(B, K, G, T, -1)
        key = (start + jnp.arange(CACHE_BLOCK))[None, None, :]
        seen = key <= positions_BxT[:, :, None]
        if window is not None:
            seen = seen & (key > positions_BxT[:, :, None] - window)
        s = jnp.where(seen[:, None, None], s, -jnp.inf)  # [B, K, G, T, C]
        # The first block holds position 0, which every query sees, so m is finite after it and a
        # block a query cannot see changes nothing: its weights are exp(-inf) = 0, its rescale 1.
        m_new = jnp.maximum(m, s.max(axis=-1))
        # A sliding window hides position 0 from late queries: until a block holds a key they
        # see, m stays -inf, and the shift is taken as 0 so that exp(-inf - 0) = 0, not NaN.
        shift = m_new if window is None else jnp.where(jnp.isinf(m_new), 0.0, m_new)
        p = jnp.exp(s - shift[..., None])
        rescale = jnp.exp(m - shift)
        denom = denom * rescale + p.sum(axis=-1)
        pv = jnp.einsum("xrc,xch->xrh", p.reshape(B * K, G * T, -1), v)
        acc = acc * rescale[..., None] + pv.reshape(B, K, G, T, H)
        return m_new, denom, acc

    stats = jnp.full((B, K, G, T), -jnp.inf, jnp.float32)
    init = (stats, jnp.zeros_like(stats), jnp.zeros((B, K, G, T, H), jnp.float32))
    # The first block is always read, outside the loop: a one-block cache (a chat turn, a
    # decoding benchmark) then runs no loop, whose every step XLA:CPU would run as separate
    # small operations. Its carry starts from zeros (0 * rescale + x is x, with or without a
    # fused multiply-add), so the arithmetic stays the same for every cache size.
    carry = visit(0, init)
    if S > CACHE_BLOCK:
        n_blocks = jnp.minimum(last_position // CACHE_BLOCK + 1, S // CACHE_BLOCK)
        carry = jax.lax.fori_loop(1, n_blocks, visit, carry)
    _, denom, acc = carry
    return acc / denom[..., None]
