"""shardq's own int8 product for a few rows on the CPU (`native/int8_matvec.cc`), through XLA's FFI.

Batch-1 decoding multiplies one row of activations by every kernel. XLA:CPU has no int8 kernel
for one row (`quant.dense.MIN_INT8_ROWS`); this one quantises the row, multiplies it by the int8
kernel with the CPU's byte dot products over XLA's own intra-op threads, and dequantises, in one
call, with the same arithmetic as `quant.dense.token_product` (per-token scales): the same
float32 product, bit for bit. (Inside a model XLA's own program may fuse the dequantisation
with the add that follows into one rounding, which a separate call cannot: the two programs'
activations then differ in the last bit.) A second entry serves weight-only products (w8):
float rows times the int8 kernel converted in registers, equal to XLA's to float32 rounding.
Each has a grouped twin that multiplies the same rows by several kernels in one call (an
attention's q, k and v): one quantisation of the rows, one share-out of every kernel's outputs
over the threads, each kernel's result the one its own call gives, bit for bit.

The source is compiled for this CPU the first time a program needs it (`model.native_build`).
Where there is no C++ compiler, or the build fails, `status()` says why and every product stays
XLA's; `SHARDQ_INT8_KERNEL=off` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax
import jax.numpy as jnp

from model import native_build

SOURCE = pathlib.Path(__file__).with_name("native") / "int8_matvec.cc"
TARGET = "shardq_int8_matvec"  # per-token int8 activations (w8a8)
TARGET_W8 = "shardq_w8_matvec"  # float activations (weight-only w8)
# One call for several kernels that multiply the same rows (an attention's q, k and v): the rows
# are quantised once, and the threads share out all the kernels' outputs at once.
TARGET_GROUP = "shardq_int8_matvec_group"
TARGET_W8_GROUP = "shardq_w8_matvec_group"
TARGETS = (TARGET, TARGET_W8, TARGET_GROUP, TARGET_W8_GROUP)
# Up to this many rows a product runs here; more rows are a GEMM, which XLA's (YNNPACK's) is
# built for.
MAX_ROWS = 8
ENV_SWITCH = "SHARDQ_INT8_KERNEL"


@functools.cache
def status() -> dict:
    """{"available": bool, "isa": the instruction set built for, "library": path,
    "reason": why not}; builds and registers the kernel on the first call."""
    lib, info = native_build.load(SOURCE, {
        TARGET: "ShardqInt8Matvec", TARGET_W8: "ShardqWeightInt8Matvec",
        TARGET_GROUP: "ShardqInt8MatvecGroup", TARGET_W8_GROUP: "ShardqWeightInt8MatvecGroup",
    }, ENV_SWITCH)
    if lib is None:
        return info
    lib.ShardqInt8MatvecIsa.restype = ctypes.c_char_p
    return {**info, "isa": lib.ShardqInt8MatvecIsa().decode()}


def usable(rows: int) -> bool:
    """Whether a product of `rows` rows runs here (the kernel builds, and the rows are few)."""
    return rows <= MAX_ROWS and status()["available"]


def _call(target: str, x: jax.Array, kernels: list[tuple[jax.Array, jax.Array]]
          ) -> list[jax.Array]:
    if not status()["available"]:  # builds and registers the kernels on first use
        raise RuntimeError(f"the int8 kernel is not available: {status()['reason']}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], w_q.shape[0]), jnp.float32) for w_q, _ in kernels]
    # vmapped, the call runs once per batch element (the kernel takes one [rows, in] input)
    call = jax.ffi.ffi_call(target, outs, vmap_method="sequential")
    # The weight-only entries read float16 scales as they are stored (an int8 table's blocks).
    keep = (jnp.float16,) if target in (TARGET_W8, TARGET_W8_GROUP) else ()
    operands = [a for w_q, w_scale in kernels
                for a in (w_q, w_scale.reshape(-1).astype(
                    w_scale.dtype if w_scale.dtype in keep else jnp.float32))]
    return list(call(x.astype(jnp.float32), *operands))


def product(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [rows, in] (float32) times the int8 kernel w_q [out, in] with per-token int8
    activations -> float32 [rows, out]; w_scale holds out (or 1) float32 scales. CPU only: a
    caller that may run elsewhere puts it in one branch of `jax.lax.platform_dependent`."""
    return _call(TARGET, x, [(w_q, w_scale)])[0]


def product_weight_only(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [rows, in] (float32) times the int8 kernel w_q [out, in], each weight converted to
    float32 in the call (weight-only w8) -> float32 [rows, out], scaled by w_scale (float32,
    or float16 as an int8 table's block scales are stored). Equal to XLA's product to float32
    rounding (its sums run in another order). CPU only."""
    return _call(TARGET_W8, x, [(w_q, w_scale)])[0]


def product_group(x: jax.Array, kernels: list[tuple[jax.Array, jax.Array]]) -> list[jax.Array]:
    """`product(x, w_q, w_scale)` for every (w_q, w_scale) of `kernels`, in one call: the same
    results, bit for bit. CPU only."""
    return _call(TARGET_GROUP, x, kernels)


def product_weight_only_group(x: jax.Array, kernels: list[tuple[jax.Array, jax.Array]]
                              ) -> list[jax.Array]:
    """`product_weight_only(x, w_q, w_scale)` for every kernel, in one call: the same results,
    bit for bit. CPU only."""
    return _call(TARGET_W8_GROUP, x, kernels)
