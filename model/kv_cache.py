"""The KV cache as a small pytree with a write/read interface.

Attention only calls `write` and `block` (model/cached_attention.py reads the cache a block of
positions at a time), so how keys and values are stored is the cache's
business: `KVCache` keeps them in a float dtype; `quant.kv_cache.Int8KVCache` keeps int8 values
with per-(token, head) scales. Leaves carry a leading `layers` axis; the layer scan hands each
block its [B, S, N, H] slice.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [(layers,) B, S, N, H]
    v: jax.Array

    def write(self, k_BxTxNxH: jax.Array, v_BxTxNxH: jax.Array, index) -> KVCache:
        put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), index,
                                                                 axis=1)
        return KVCache(put(self.k, k_BxTxNxH), put(self.v, v_BxTxNxH))

    def block(self, start, size: int, dtype) -> tuple[jax.Array, jax.Array]:
        """Keys and values at positions start .. start + size - 1, as `dtype`."""
        get = lambda buf: jax.lax.dynamic_slice_in_dim(buf, start, size, axis=1).astype(dtype)
        return get(self.k), get(self.v)

    @property
    def length(self) -> int:
        return self.k.shape[-3]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[-2]
