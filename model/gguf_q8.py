"""Our int8 weights as GGML's Q8_0 blocks, packed as llama.cpp reads them.

A Q8_0 block is 32 consecutive values of one row (ggml's innermost axis, a Linear weight's
input features) stored as an fp16 scale `d` followed by 32 int8 values; the value is `d * q`.
`quant/` keeps one float32 scale per output feature (a row of the [out, in] kernel) and int8
values in -127..127, so every block of a row takes that row's scale as its `d` and its int8
values as they are; a block-scaled embedding table has a scale per block of 32 already, which
becomes that block's `d`. Either way the file holds exactly our int8 weights,
and the only change is the scale rounded to fp16 (11 significant bits for scales from 6.1e-5 to
65504; a smaller one keeps fewer bits, and one below fp16's smallest subnormal, 6e-8, becomes 0).
A row's length must be a multiple of 32, since a block never crosses a row.

`dequantized` gives what any Q8_0 reader computes from the packed bytes (fp16 `d` widened to
float32 times the int8 value, exact in float32: an 8-bit integer times an 11-bit significand).
"""

from __future__ import annotations

import dataclasses

import numpy as np

QK8_0 = 32  # values per block (ggml's QK8_0)
BLOCK_BYTES = 2 + QK8_0  # fp16 d + 32 int8


class Q8Error(ValueError):
    """Int8 weights that Q8_0 cannot hold (launchers print it on one line, exit 2)."""


@dataclasses.dataclass(frozen=True)
class Int8Rows:
    """int8 rows with float32 scales: `q` [..., rows, cols], `scale` [..., rows] (one per row)
    or [..., rows, cols / 32] (one per Q8_0 block, as a block-scaled int8 embedding table holds
    them). Leading axes: the stacked `layers` axis of a block parameter."""
    q: np.ndarray
    scale: np.ndarray

    def __post_init__(self):
        per_block = self.q.shape[:-1] + (self.q.shape[-1] // QK8_0,)
        fits = self.scale.shape == self.q.shape[:-1] or (
            self.q.shape[-1] % QK8_0 == 0 and self.scale.shape == per_block)
        if self.q.dtype != np.int8 or not fits:
            raise Q8Error(f"int8 rows {self.q.dtype} {list(self.q.shape)} do not fit scales "
                          f"{list(self.scale.shape)}")

    def layer(self, i: int) -> Int8Rows:
        return Int8Rows(self.q[i], self.scale[i])

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def block_scales(self) -> np.ndarray:
        """The scale of every Q8_0 block, [..., rows, cols / 32] (a row's scale repeated over
        its blocks where there is one per row)."""
        if self.scale.ndim == self.q.ndim:
            return self.scale
        return np.repeat(self.scale[..., None], self.q.shape[-1] // QK8_0, axis=-1)


def row_bytes(cols: int) -> int:
    """Bytes of one Q8_0 row of `cols` values."""
    return cols // QK8_0 * BLOCK_BYTES


def fp16_scales(scale: np.ndarray, what: str = "scale") -> np.ndarray:
    """The scales as the blocks store them (fp16, rounded to nearest); Q8Error when one is not
    finite there (above fp16's 65504)."""
    s = np.asarray(scale, np.float32)
    with np.errstate(over="ignore"):
        d = s.astype(np.float16)
    if not np.all(np.isfinite(d)):
        raise Q8Error(f"{what}: a scale ({float(np.max(np.abs(s))):.3g}) does not fit "
                      f"fp16, which Q8_0 stores its scales in")
    return d


def pack(rows: Int8Rows, what: str = "tensor") -> np.ndarray:
    """[rows, cols] int8 + [rows] (or [rows, cols / 32]) scales -> uint8
    [rows, cols / 32 * 34], Q8_0's bytes."""
    q = np.ascontiguousarray(rows.q)
    if q.ndim != 2:
        raise Q8Error(f"{what}: Q8_0 packs one [rows, cols] matrix, got {list(q.shape)}")
    n, cols = q.shape
    if cols % QK8_0:
        raise Q8Error(f"{what}: rows of {cols} values; Q8_0 needs a multiple of {QK8_0}")
    d = fp16_scales(rows.block_scales, what).astype("<f2")
    blocks = np.empty((n, cols // QK8_0, BLOCK_BYTES), np.uint8)
    blocks[:, :, :2] = np.ascontiguousarray(d).view(np.uint8).reshape(n, -1, 2)
    blocks[:, :, 2:] = q.reshape(n, cols // QK8_0, QK8_0).view(np.uint8)
    return blocks.reshape(n, -1)


def dequantized(rows: Int8Rows) -> np.ndarray:
    """float32 values a Q8_0 reader gets from `pack(rows)`: q * float32(fp16(scale))."""
    d = fp16_scales(rows.block_scales).astype(np.float32)
    q = rows.q.astype(np.float32).reshape(d.shape + (QK8_0,))
    return (q * d[..., None]).reshape(rows.q.shape)


def scale_rounding(rows: Int8Rows) -> float:
    """The largest relative change fp16 makes to a (nonzero) scale."""
    s = np.asarray(rows.scale, np.float32)
    d = fp16_scales(s).astype(np.float32)
    nz = s != 0
    return float(np.max(np.abs(d[nz] - s[nz]) / np.abs(s[nz]))) if nz.any() else 0.0
