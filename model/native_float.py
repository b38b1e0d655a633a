"""shardq's own float32 product for a few rows on the CPU (`native/float_matvec.cc`), through
XLA's FFI.

Batch-1 decoding multiplies one row by every kernel of the model. This product reads a kernel
stored [out, in] (each output's weights contiguous: the layout `model.layers.use_native_float`
gives a Dense kernel for decoding, and a tied head's embedding table as it is) one output's row
at a time, front to back, in chunks of consecutive outputs shared out over XLA's own intra-op
threads. Each output's sum runs on one thread in a fixed order: the result does not depend on
the thread count, and equals XLA's dot to float32 rounding (its sums run in another order). A
grouped entry multiplies the same rows by several kernels in one call (an attention's q, k and
v).

Built like `quant.native_int8` (`model.native_build`); `SHARDQ_FLOAT_KERNEL=off` turns it off.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp

from model import native_build

SOURCE = pathlib.Path(__file__).with_name("native") / "float_matvec.cc"
TARGET = "shardq_float_matvec"
TARGET_GROUP = "shardq_float_matvec_group"
TARGETS = (TARGET, TARGET_GROUP)
MAX_ROWS = 8  # more rows are a GEMM, which XLA's is built for
ENV_SWITCH = "SHARDQ_FLOAT_KERNEL"


@functools.cache
def status() -> dict:
    """{"available": bool, "library": path, "reason": why not}; builds and registers the
    kernel on the first call."""
    return native_build.load(SOURCE, {TARGET: "ShardqFloatMatvec",
                                      TARGET_GROUP: "ShardqFloatMatvecGroup"}, ENV_SWITCH)[1]


def usable(rows: int) -> bool:
    """Whether a product of `rows` rows runs here (the kernel builds, and the rows are few)."""
    return rows <= MAX_ROWS and status()["available"]


def product_group(x: jax.Array, kernels: list[jax.Array]) -> list[jax.Array]:
    """x [rows, in] times each float32 kernel [out, in] of `kernels` (transposed), in one call
    -> float32 [rows, out] each. CPU only: a caller that may run elsewhere puts it in one branch
    of `jax.lax.platform_dependent`."""
    if not status()["available"]:  # builds and registers the kernel on first use
        raise RuntimeError(f"the float kernel is not available: {status()['reason']}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32) for w in kernels]
    target = TARGET if len(kernels) == 1 else TARGET_GROUP
    # vmapped, the call runs once per batch element (the kernel takes one [rows, in] input)
    call = jax.ffi.ffi_call(target, outs, vmap_method="sequential")
    return list(call(x.astype(jnp.float32), *(w.astype(jnp.float32) for w in kernels)))


def product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [rows, in] times the float32 kernel w [out, in], transposed -> float32 [rows, out].
    CPU only."""
    return product_group(x, [w])[0]
