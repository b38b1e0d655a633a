"""int8 KV cache: keys and values stored as int8 with one float32 scale per (token, head).

Decoding is memory-bound and the cache grows with context: int8 values plus a scale per
head_dim values store (1 + 4/head_dim) bytes per element instead of 4 (fp32) or 2 (bf16).
Attention reads a block of dequantised values at a time; `model/` only sees the write/block
interface it already uses for `model.kv_cache.KVCache`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from model.cached_attention import padded_length
from model.kv_cache import (
    KEY_POSITIONS,
    VALUE_POSITIONS,
    cache_shapes,
    get,
    keys_stored,
    put,
    values_stored,
)
from quant import quantizers as qz


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "k_scale", "v_scale"], meta_fields=["kv_heads"])
@dataclasses.dataclass
class Int8KVCache:
    k: jax.Array  # int8 [(layers,) B * K, H, S] (model.kv_cache's layouts)
    v: jax.Array  # int8 [(layers,) B * K, S, H]
    k_scale: jax.Array  # float32 [(layers,) B * K, 1, S]
    v_scale: jax.Array  # float32 [(layers,) B * K, S, 1]
    kv_heads: int  # K

    def write(self, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array, index) -> Int8KVCache:
        k_s = qz.scale_from_absmax(qz.absmax(k_BxTxKxH, axis=-1))  # [B, T, K, 1]
        v_s = qz.scale_from_absmax(qz.absmax(v_BxTxKxH, axis=-1))
        k_q, v_q = qz.quantize(k_BxTxKxH, k_s), qz.quantize(v_BxTxKxH, v_s)
        return Int8KVCache(put(self.k, keys_stored(k_q), index, KEY_POSITIONS),
                           put(self.v, values_stored(v_q), index, VALUE_POSITIONS),
                           put(self.k_scale, keys_stored(k_s), index, KEY_POSITIONS),
                           put(self.v_scale, values_stored(v_s), index, VALUE_POSITIONS),
                           self.kv_heads)

    def native_operands(self) -> tuple[jax.Array, ...]:
        """The arrays shardq's attention kernel reads (`model.native_attention`): the int8 keys
        and values and their scales, dequantised as the kernel reads them."""
        return self.k, self.v, self.k_scale, self.v_scale

    def block(self, start, size: int, dtype) -> tuple[jax.Array, jax.Array]:
        """Dequantised keys [B * K, H, size] and values [B * K, size, H] at positions start ..
        start + size - 1: only the block is converted, never the whole cache."""
        return (qz.dequantize(get(self.k, start, size, KEY_POSITIONS),
                              get(self.k_scale, start, size, KEY_POSITIONS), dtype),
                qz.dequantize(get(self.v, start, size, VALUE_POSITIONS),
                              get(self.v_scale, start, size, VALUE_POSITIONS), dtype))

    @property
    def length(self) -> int:
        return self.v.shape[-2]


def init_int8_cache(cfg, batch: int, length: int) -> Int8KVCache:
    """An empty int8 cache for a `model.ModelConfig`'s decoder, for `length` positions (allocated
    in whole blocks, as attention reads it)."""
    # GQA: kv heads only.
    k, v = cache_shapes(cfg.n_layers, batch, padded_length(length), cfg.kv_heads, cfg.head_dim)
    k_scale, v_scale = k[:-2] + (1, k[-1]), v[:-1] + (1,)
    return Int8KVCache(jnp.zeros(k, jnp.int8), jnp.zeros(v, jnp.int8),
                       jnp.ones(k_scale, jnp.float32), jnp.ones(v_scale, jnp.float32),
                       cfg.kv_heads)
