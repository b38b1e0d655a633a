"""The KV cache as a small pytree with a write/read interface.

Attention only calls `write` and `block` (model/cached_attention.py reads the cache a block of
positions at a time), so how keys and values are stored is the cache's
business: `KVCache` keeps them in a float dtype; `quant.kv_cache.Int8KVCache` keeps int8 values
with per-(token, head) scales. Both store keys [B * K, H, S] and values [B * K, S, H] (K kv
heads, S positions). Leaves carry a leading `layers` axis; the layer scan hands each block its
slice.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# Keys are stored [B * K, H, S] (transposed) and values [B * K, S, H], the batch and kv-head
# axes merged into one: the layouts in which attention's two products read a block as it lies,
# each a product with one batch axis (scores contract the keys over H, the weighted sum the
# values over positions). Stored as the projections write them ([B, S, K, H]), every decoding
# step would copy each layer's cache into those layouts first; with two batch axes XLA:CPU
# merges them in a copy of the freshly written cache instead of updating it in place.
KEY_POSITIONS, VALUE_POSITIONS = -1, -2  # the position axis of each


def keys_stored(k_BxTxKxH: jax.Array) -> jax.Array:
    """[B, T, K, H] keys in the cache's key layout, [B * K, H, T]."""
    B, T, K, H = k_BxTxKxH.shape
    return k_BxTxKxH.transpose(0, 2, 3, 1).reshape(B * K, H, T)


def values_stored(v_BxTxKxH: jax.Array) -> jax.Array:
    """[B, T, K, H] values in the cache's value layout, [B * K, T, H]."""
    B, T, K, H = v_BxTxKxH.shape
    return v_BxTxKxH.transpose(0, 2, 1, 3).reshape(B * K, T, H)


def put(buf: jax.Array, x: jax.Array, index, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), index, axis=axis)


def get(buf: jax.Array, start, size: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(buf, start, size, axis=axis)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"],
                   meta_fields=["kv_heads"])
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [(layers,) B * K, H, S]
    v: jax.Array  # [(layers,) B * K, S, H]
    kv_heads: int  # K

    def write(self, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array, index) -> KVCache:
        return KVCache(put(self.k, keys_stored(k_BxTxKxH), index, KEY_POSITIONS),
                       put(self.v, values_stored(v_BxTxKxH), index, VALUE_POSITIONS),
                       self.kv_heads)

    def native_operands(self) -> tuple[jax.Array, ...] | None:
        """The arrays shardq's attention kernel reads (`model.native_attention`): a float32
        cache's keys and values; None for another dtype (XLA's blocks run it)."""
        return (self.k, self.v) if self.k.dtype == jnp.float32 else None

    def block(self, start, size: int, dtype) -> tuple[jax.Array, jax.Array]:
        """Keys [B * K, H, size] and values [B * K, size, H] at positions start .. start + size
        - 1, as `dtype`."""
        return (get(self.k, start, size, KEY_POSITIONS).astype(dtype),
                get(self.v, start, size, VALUE_POSITIONS).astype(dtype))

    @property
    def length(self) -> int:
        return self.v.shape[-2]


def cache_shapes(layers: int, batch: int, length: int, kv_heads: int, head_dim: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a stacked cache's keys and values."""
    lead = (layers, batch * kv_heads)
    return lead + (head_dim, length), lead + (length, head_dim)
