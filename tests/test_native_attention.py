"""shardq's attention of one query position over a float32 or an int8 KV cache
(model/native_attention.py) against `model.cached_attention`'s blocks in XLA's operations.

The kernel visits the same blocks, each block's softmax apart and the blocks combined in order;
its sums and its exp run in another order and form, so it agrees to float32 rounding. Cases
cover grouped-query heads (more than the four the kernel takes at a time too), a batch, caches
of one and of several blocks, a sliding window, the first position, and head dimensions that
are not a multiple of the vector width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import native_attention
from model.cached_attention import blocked_cached_attention
from model.config import ModelConfig
from model.kv_cache import KVCache
from quant.kv_cache import init_int8_cache
from tests.helpers import native_kernel_built


def _case(seed, B, K, G, H, S):
    rng = np.random.default_rng(seed)
    cache = KVCache(jnp.asarray(rng.standard_normal((B * K, H, S)).astype(np.float32)),
                    jnp.asarray(rng.standard_normal((B * K, S, H)).astype(np.float32)), K)
    q = jnp.asarray(rng.standard_normal((B, 1, K * G, H)).astype(np.float32))
    return q, cache


def _attend(q, cache, pos, window, native):
    positions = jnp.asarray(pos, jnp.int32).reshape(-1, 1)
    return np.asarray(blocked_cached_attention(q, cache, positions, int(np.max(pos)),
                                               window=window, native=native))


@pytest.mark.parametrize("B,K,G,H,S,pos,window", [
    (1, 3, 3, 64, 256, [169], None), (1, 3, 3, 64, 768, [700], None),
    (2, 2, 2, 64, 512, [400, 30], 100), (1, 1, 4, 48, 256, [0], None),
    (1, 2, 1, 128, 512, [511], 300), (1, 1, 6, 64, 768, [590], None),
    (1, 2, 5, 80, 512, [299], 200)])
def test_kernel_matches_xla_blocks_to_float_rounding(B, K, G, H, S, pos, window):
    if not native_kernel_built(native_attention.status()):
        return
    q, cache = _case(sum(pos) + S, B, K, G, H, S)
    got, want = _attend(q, cache, pos, window, True), _attend(q, cache, pos, window, False)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    # a value the query sees, changed, moves the result beyond the tolerance
    p = int(pos[0])
    moved = KVCache(cache.k, cache.v.at[0, p].multiply(-3.0), K)
    assert np.abs(_attend(q, moved, pos, window, False) - want).max() > 1e-5 * np.abs(
        want).max()


def test_kernel_result_does_not_depend_on_the_cache_length():
    if not native_kernel_built(native_attention.status()):
        return
    q, long = _case(1, 1, 3, 3, 64, 1024)
    short = KVCache(long.k[..., :512], long.v[:, :512], 3)
    for pos in ([0], [255], [300], [511]):
        np.testing.assert_array_equal(_attend(q, short, pos, None, True),
                                      _attend(q, long, pos, None, True))


def _int8_case(seed, B, K, G, H, S):
    """An int8 cache of S positions (random keys and values written through the cache's own
    quantising `write`) and a query."""
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(vocab_size=16, d_model=K * G * H, n_layers=1, n_heads=K * G,
                      n_kv_heads=K, d_ff=64, max_len=S)
    cache = jax.tree.map(lambda a: a[0], init_int8_cache(cfg, B, S))  # its one layer
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H)).astype(np.float32)) for _ in "kv")
    q = jnp.asarray(rng.standard_normal((B, 1, K * G, H)).astype(np.float32))
    return q, cache.write(k, v, 0)


@pytest.mark.parametrize("B,K,G,H,S,pos,window", [
    (1, 3, 3, 64, 256, [169], None), (1, 3, 3, 64, 768, [700], None),
    (2, 2, 2, 64, 512, [400, 30], 100), (1, 2, 1, 48, 256, [255], 17),
    (1, 2, 5, 80, 512, [299], 200)])
def test_int8_cache_kernel_matches_xla_blocks_to_float_rounding(B, K, G, H, S, pos, window):
    """The int8 entry reads the int8 cache as stored (keys dequantised as read, each value's
    scale folded into its weight) and agrees with XLA's blocks, which dequantise each block
    first."""
    if not native_kernel_built(native_attention.status()):
        return
    q, cache = _int8_case(sum(pos) + S, B, K, G, H, S)
    text = jax.jit(lambda q, c: blocked_cached_attention(
        q, c, jnp.asarray(pos, jnp.int32).reshape(-1, 1), max(pos), window=window,
        native=True)).lower(q, cache).as_text()
    assert native_attention.TARGET_INT8 in text
    got, want = _attend(q, cache, pos, window, True), _attend(q, cache, pos, window, False)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    # one seen value's scale, changed, moves the result beyond the tolerance
    moved = dataclasses.replace(cache, v_scale=cache.v_scale.at[0, pos[0]].multiply(-3.0))
    assert np.abs(_attend(q, moved, pos, window, True) - want).max() > 1e-4 * np.abs(
        want).max()
