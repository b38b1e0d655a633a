"""int8 KV cache: keys and values stored as int8 with one float32 scale per (token, head).

Decoding is memory-bound and the cache grows with context: int8 values plus a scale per
head_dim values store (1 + 4/head_dim) bytes per element instead of 4 (fp32) or 2 (bf16).
Attention reads a block of dequantised values at a time; `model/` only sees the write/block
interface it already uses for `model.kv_cache.KVCache`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from model.cached_attention import padded_length
from quant import quantizers as qz


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8KVCache:
    k: jax.Array  # int8 [(layers,) B, S, N, H]
    v: jax.Array
    k_scale: jax.Array  # float32 [(layers,) B, S, N, 1]
    v_scale: jax.Array

    def write(self, k_BxTxNxH: jax.Array, v_BxTxNxH: jax.Array, index) -> Int8KVCache:
        def put(buf, x):
            return jax.lax.dynamic_update_slice_in_dim(buf, x, index, axis=1)

        k_s = qz.scale_from_absmax(qz.absmax(k_BxTxNxH, axis=-1))
        v_s = qz.scale_from_absmax(qz.absmax(v_BxTxNxH, axis=-1))
        return Int8KVCache(put(self.k, qz.quantize(k_BxTxNxH, k_s)),
                           put(self.v, qz.quantize(v_BxTxNxH, v_s)),
                           put(self.k_scale, k_s), put(self.v_scale, v_s))

    def block(self, start, size: int, dtype) -> tuple[jax.Array, jax.Array]:
        """Dequantised keys and values at positions start .. start + size - 1: only the block is
        converted, never the whole cache."""
        get = lambda buf: jax.lax.dynamic_slice_in_dim(buf, start, size, axis=1)
        return (qz.dequantize(get(self.k), get(self.k_scale), dtype),
                qz.dequantize(get(self.v), get(self.v_scale), dtype))

    @property
    def length(self) -> int:
        return self.k.shape[-3]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[-2]


def init_int8_cache(cfg, batch: int, length: int) -> Int8KVCache:
    """An empty int8 cache for a `model.ModelConfig`'s decoder, for `length` positions (allocated
    in whole blocks, as attention reads it)."""
    # GQA: kv heads only.
    shape = (cfg.n_layers, batch, padded_length(length), cfg.kv_heads, cfg.head_dim)
    scales = shape[:-1] + (1,)
    return Int8KVCache(jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8),
                       jnp.ones(scales, jnp.float32), jnp.ones(scales, jnp.float32))
