"""Symmetric absmax int8 quantizers (SmoothQuant's and LLM.int8()'s convention):
s = absmax / 127 (computed as absmax * float32(1 / 127)), q = clip(round(x / s)), with x / s
computed as x * (1 / s) (see `quantize`).

Every function here is pure and jit-friendly. Scales keep the reduced axes (keepdims) so that
dequantisation is a plain same-rank product: the project runs with rank promotion off.
An all-zero (or subnormal) channel gets scale 1 (its values quantise to 0 either way), never a
division by 0.
A non-finite absmax (a NaN or inf in the row) keeps a non-finite scale, so the NaN reaches the
dequantised output as it would in float, instead of vanishing into an int8 value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QMAX = 127  # symmetric: -127..127, so negating a quantised value never overflows
INV_QMAX = np.float32(1.0 / QMAX)


def scale_from_absmax(absmax: jax.Array) -> jax.Array:
    """float32 scale with the all-zero guard (NaN and inf pass through: see above)."""
    # A product with 1/127 rounded to float32, not a division: XLA rewrites a division by a
    # constant into this product in some programs, and shardq's int8 kernel
    # (quant/native_int8.py) computes the same product, so every program agrees to the bit.
    scale = absmax.astype(jnp.float32) * INV_QMAX
    # A zero or subnormal scale becomes 1: such a channel (|x| < 1.5e-36) rounds to 0. Every
    # scale left is normal, so its reciprocal (`quantize` multiplies by it) is finite, whether
    # or not the backend flushes subnormals to zero (XLA:CPU does, and then they read as 0).
    return jnp.where(scale < jnp.finfo(jnp.float32).tiny, jnp.ones_like(scale), scale)


def quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """int8 values of x under a (broadcast-compatible, same-rank) scale.

    x is multiplied by the scale's reciprocal, computed once per scale, rather than divided by
    the scale: XLA rewrites `x / broadcast(s)` into `x * broadcast(1 / s)` in some programs and
    not in others (it depends on how the program around it is partitioned and fused), and the
    two differ in the last bit, which moves a value sitting on a rounding boundary to the next
    integer. Written as a product, every program rounds the same values the same way, so an int8
    model scores bit-identically on one device and sharded over many.
    """
    q = jnp.round(x.astype(jnp.float32) * (1.0 / scale))
    return jnp.clip(q, -QMAX, QMAX).astype(jnp.int8)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale).astype(dtype)


def absmax(x: jax.Array, axis) -> jax.Array:
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)


# --- weights [..., in, out]: the input axis (-2) is the one reduced by the matmul -------------

def weight_scale(w: jax.Array, granularity: str = "channel") -> jax.Array:
    """Per-output-channel [..., 1, out] (default) or per-tensor [..., 1, 1] scales.

    Leading axes (the stacked `layers` axis) always keep their own scales.
    """
    if granularity == "channel":
        return scale_from_absmax(absmax(w, axis=-2))
    if granularity == "tensor":
        return scale_from_absmax(absmax(w, axis=(-2, -1)))
    raise ValueError(f"granularity={granularity!r}: allowed channel, tensor")


def clipped_weight_scale(w: jax.Array, granularity: str = "channel",
                         ratios: tuple[float, ...] = tuple(1.0 - 0.025 * i for i in range(17))
                         ) -> jax.Array:
    """Scale whose clipping ratio (of absmax) minimises the squared reconstruction error.

    A smaller range clips the few largest weights but rounds the many small ones more finely;
    the search tries each ratio and keeps, per channel (or tensor), the best. Ratio 1.0 is among
    the candidates, so the result is never worse than plain absmax.
    """
    base = weight_scale(w, granularity)
    axes = (-2,) if granularity == "channel" else (-2, -1)
    w32 = w.astype(jnp.float32)

    def err(r):
        s = base * r
        return jnp.sum(jnp.square(dequantize(quantize(w32, s), s) - w32), axis=axes,
                       keepdims=True)

    errs = jnp.stack([err(r) for r in ratios])  # [R, ..., 1, out]
    best = jnp.asarray(ratios, jnp.float32)[jnp.argmin(errs, axis=0)]
    return base * best


def block_scale(x: jax.Array, block: int) -> jax.Array:
    """One scale per block of `block` consecutive values of the last axis (GGUF Q8_0's layout):
    [..., cols] -> [..., cols // block]; `block` must divide cols."""
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    return scale_from_absmax(absmax(blocks, axis=-1))[..., 0]


def blocked(x: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., cols] as [..., blocks, cols // blocks] and its block scales [..., blocks] as
    [..., blocks, 1]: the shapes that quantise, and dequantise, block by block."""
    b = scale.shape[-1]
    return x.reshape(x.shape[:-1] + (b, x.shape[-1] // b)), scale[..., None]


# float16's smallest normal and largest finite values: block scales stored in float16 stay in
# that range, where a scale keeps float16's full precision (2^-11 relative).
HALF_MIN = float(np.finfo(np.float16).tiny)
HALF_MAX = float(np.finfo(np.float16).max)


def half_scale(scale: jax.Array) -> jax.Array:
    """Block scales as GGUF Q8_0 stores them: float16, rounded to nearest, here first raised to
    float16's smallest normal value (a block of |x| < 127 x that quantises on that coarser
    step, to within its half: the same absolute error as a block at the bound) and capped at
    its largest (`convert.make_plan` refuses a table whose scales would exceed it)."""
    return jnp.clip(scale.astype(jnp.float32), HALF_MIN, HALF_MAX).astype(jnp.float16)


def quantize_blocks(x: jax.Array, scale: jax.Array) -> jax.Array:
    """int8 values of x [..., cols] under one scale per block of its rows (scale [..., blocks];
    one block: a scale per row; float16 scales are widened exactly)."""
    rows, s = blocked(x, scale.astype(jnp.float32))
    return quantize(rows, s).reshape(x.shape)


def dequantize_blocks(q: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 values of int8 q [..., cols] under one scale per block of its rows (float32 or
    float16 scales)."""
    rows, s = blocked(q.astype(jnp.float32), scale.astype(jnp.float32))
    return (rows * s).reshape(q.shape)


# --- activations [tokens, in] ------------------------------------------------------------------

def token_scale(x: jax.Array) -> jax.Array:
    """Dynamic per-token (row) scales [..., tokens, 1], recomputed at every call."""
    return scale_from_absmax(absmax(x, axis=-1))


def tensor_scale(x: jax.Array) -> jax.Array:
    """Dynamic per-tensor scale, a 0-d array."""
    return scale_from_absmax(jnp.max(jnp.abs(x.astype(jnp.float32))))


def round_trip(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Fake-quantised x (for error measurements and tests only; inference uses int8 dots)."""
    return dequantize(quantize(x, scale), scale, x.dtype)
