"""shardq's attention of one query position over a KV cache on the CPU, float32 or int8
(`native/decode_attention.cc`), through XLA's FFI.

A decoding step attends once per layer; XLA runs `model.cached_attention`'s block loop as a
dozen small operations per layer, each costing more than its few bytes. This call runs the
same blocks in one operation, each block's softmax apart (the blocks share XLA's threads) and
combined in order as the online softmax does: equal to XLA's to float32 rounding (its sums and
its exp run in another order and form), and like it independent of the cache's length.
`model.layers.use_native_float` switches a model's attention to it, with its Dense products.

Built like `quant.native_int8` (`model.native_build`); `SHARDQ_ATTENTION_KERNEL=off` turns it
off.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp

from model import native_build

SOURCE = pathlib.Path(__file__).with_name("native") / "decode_attention.cc"
TARGET = "shardq_decode_attention"
TARGET_INT8 = "shardq_decode_attention_int8"
TARGETS = (TARGET, TARGET_INT8)
ENV_SWITCH = "SHARDQ_ATTENTION_KERNEL"


@functools.cache
def status() -> dict:
    """{"available": bool, "library": path, "reason": why not}; builds and registers the
    kernel on the first call."""
    return native_build.load(SOURCE, {TARGET: "ShardqDecodeAttention",
                                      TARGET_INT8: "ShardqDecodeAttentionInt8"}, ENV_SWITCH)[1]


def attend(q: jax.Array, cache: tuple[jax.Array, ...], position: jax.Array,
           window: jax.Array) -> jax.Array:
    """q float32 [B * K, G, H] (scaled by 1 / sqrt(H)) over a cache's arrays (its
    `native_operands()`): float32 keys [B * K, H, S] and values [B * K, S, H], or int8 keys and
    values in those layouts with their float32 scales [B * K, 1, S] and [B * K, S, 1]. It sees
    the positions <= position[b] (int32 [B]) and, with window (int32 [1]), > position[b] -
    window -> float32 [B * K, G, H]. CPU only: a caller that may run elsewhere puts it in one
    branch of `jax.lax.platform_dependent`."""
    if not status()["available"]:  # builds and registers the kernel on first use
        raise RuntimeError(f"the attention kernel is not available: {status()['reason']}")
    target = TARGET if len(cache) == 2 else TARGET_INT8
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q.astype(jnp.float32), *cache, position.astype(jnp.int32),
                window.astype(jnp.int32).reshape(1))
