"""The int8 twins of `model.layers.Dense` and `model.layers.Embed`.

`QuantDense` holds an int8 kernel and float32 per-output-channel (or per-tensor) scales; its
product is a real int8 x int8 -> int32 `lax.dot_general`, dequantised afterwards with the outer
product of token and channel scales (LLM.int8()'s vector-wise form). Parameters may carry
leading stacked axes (`layers`): the model's layer scan slices them, so `__call__` always sees
one layer.

The int8 kernel is stored `[out, in]` (the float Dense's `[in, out]` transposed), so that both
operands of the integer product have the contracted axis contiguous: the layout int8 GEMM
libraries read. Stored `[in, out]`, XLA on a GPU copies the kernel into that layout before
every cuBLASLt call, and XLA:CPU's int8 matrix-vector products at large widths are slower
(`experiments.bench_gpu` and `experiments.bench_int8` compare the two layouts).

How activations are quantised is static (it lives in the graph definition, not the state):
  act="none"    weight-only: float activations times dequantised int8 weights
  act="token"   dynamic per-token scales (default)
  act="tensor"  dynamic per-tensor scale
  act="static"  one calibrated per-tensor scale per layer (`act_scale`)
`outlier_threshold` adds the LLM.int8() split: input columns with any |x| >= threshold are
multiplied in float, the rest in int8. Shapes must be static, so at most `outlier_capacity`
columns (the largest by |x|) take the float path: they are gathered, with the kernel's entries
for them, into a [tokens, capacity] x [capacity, out] float product (capacity/in of a float
layer's work). Should more columns exceed the threshold, the rest stay in int8 (the per-token
scale then covers them: correct, as accurate as plain w8a8). `has_float` adds a per-layer switch
to a bf16 kernel (the automatic precision choice keeps over-budget layers there). `rotate` makes
the int8 product take x R against a kernel holding Rᵀ W (R orthogonal, `quant/rotation.py`):
same product, evener channels to quantise; the float paths keep x and W.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import Axes, dtype_of, param
from quant import native_int8, rotation
from quant import quantizers as qz

ACT_MODES = ("none", "token", "tensor", "static")


# XLA:CPU turns an int8 dot with fewer rows than this into a conversion of the whole int8 kernel
# to int32 followed by an int32 dot (it reads and writes 9 bytes per weight instead of 1); from
# this many rows on it calls its native s8 x s8 -> s32 kernel. Batch-1 decoding has one row, so
# the rows are padded up (the extra rows are zeros, their results dropped).
MIN_INT8_ROWS = 4


def int8_dot_general(x_q: jax.Array, w_q: jax.Array, dims, min_rows: int = MIN_INT8_ROWS
                     ) -> jax.Array:
    """[tokens, in] int8 times an int8 kernel -> int32 [tokens, out] (`dims`: lax.dot_general's
    dimension numbers); without the int32 accumulator it wraps."""
    rows = x_q.shape[0]
    if rows < min_rows:
        x_q = jnp.pad(x_q, ((0, min_rows - rows), (0, 0)))
    y = jax.lax.dot_general(x_q, w_q, dims, preferred_element_type=jnp.int32)
    return y[:rows]


# lax.dot_general's dimension numbers for x [tokens, in] against a kernel stored [out, in]:
# x's `in` with the kernel's `in` (no transpose anywhere) -> [tokens, out].
CONTRACT_IN = (((1,), (1,)), ((), ()))


def int8_matmul(x_q: jax.Array, w_q: jax.Array, min_rows: int = MIN_INT8_ROWS) -> jax.Array:
    """[tokens, in] int8 @ [in, out] int8 -> int32 (a kernel in the float Dense's layout)."""
    return int8_dot_general(x_q, w_q, (((1,), (0,)), ((), ())), min_rows)


def int8_matmul_t(x_q: jax.Array, w_q_out_in: jax.Array, min_rows: int = MIN_INT8_ROWS
                  ) -> jax.Array:
    """[tokens, in] int8 times an int8 kernel stored [out, in] (QuantDense's) -> int32
    [tokens, out]."""
    return int8_dot_general(x_q, w_q_out_in, CONTRACT_IN, min_rows)


def token_product(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [tokens, in] times the int8 kernel w_q [out, in] with per-token int8 activations, in
    XLA's operations; float32 [tokens, out] (w_scale [1, out] or [1, 1])."""
    s_x = qz.token_scale(x)  # [tokens, 1]
    acc = int8_matmul_t(qz.quantize(x, s_x), w_q)
    return acc.astype(jnp.float32) * (s_x * w_scale)  # outer product [tokens,1]*[1,out]


def _native_where_it_runs(native, xla, x: jax.Array, *operands):
    """`native(x, *operands)` (a `quant.native_int8` entry) where it runs: on a CPU, for a few
    rows, once the kernel has been built; `xla(...)` everywhere else."""
    if not native_int8.usable(x.shape[0]):
        return xla(x, *operands)
    return jax.lax.platform_dependent(x, *operands, cpu=native, default=xla)


def token_product_fast(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """`token_product`, through shardq's own kernel (`quant.native_int8`) where it runs. The
    same float32 result, bit for bit."""
    return _native_where_it_runs(native_int8.product, token_product, x, w_q, w_scale)


def weight_only_product(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [tokens, in] (float) times the dequantised int8 kernel w_q [out, in], in XLA's
    operations; float32 [tokens, out]."""
    return jax.lax.dot_general(x.astype(jnp.float32), w_q.astype(jnp.float32),
                               CONTRACT_IN) * w_scale


def weight_only_product_fast(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """`weight_only_product` through shardq's kernel where it runs: the same products, summed
    in another order (equal to float32 rounding)."""
    return _native_where_it_runs(native_int8.product_weight_only, weight_only_product, x, w_q,
                                 w_scale)


def quantized_product(x: jax.Array, w_q: jax.Array, w_scale: jax.Array, act: str,
                      act_scale: jax.Array | None = None, native: bool = False) -> jax.Array:
    """x [tokens, in] (float) times the int8 kernel w_q [out, in]; float32 result [tokens, out].

    w_scale is [1, out] (or [1, 1] per tensor). `native`: per-token and weight-only products of
    a few rows run in shardq's own int8 kernel on a CPU (`token_product_fast`,
    `weight_only_product_fast`).
    """
    if act == "token":
        return (token_product_fast if native else token_product)(x, w_q, w_scale)
    if act == "none":
        return (weight_only_product_fast if native else weight_only_product)(x, w_q, w_scale)
    if act == "tensor":
        s_x = qz.tensor_scale(x).reshape(1, 1)
    elif act == "static":
        s_x = qz.scale_from_absmax(act_scale * qz.QMAX).reshape(1, 1)  # guards a zero scale
    else:
        raise ValueError(f"act={act!r}: allowed {', '.join(ACT_MODES)}")
    acc = int8_matmul_t(qz.quantize(x, s_x), w_q)
    y = acc.astype(jnp.float32) * (s_x * w_scale)  # outer product [tokens,1]*[1,out]
    if act == "static":
        # A calibrated scale is finite whatever x holds: let a NaN/inf token stay non-finite
        # (dynamic scales carry it through the scale itself).
        finite = jnp.isfinite(jnp.sum(x.astype(jnp.float32), axis=-1, keepdims=True))
        y = jnp.where(finite, y, jnp.nan)
    return y


class QuantDense(nnx.Module):
    """kernel_q: int8 [..., out, in]; kernel_scale: [..., 1, out] (or [..., 1, 1]); kernel_axes:
    the float Dense's logical axes ([..., in, out]); kernel_float (auto's bf16 copy) and bias
    keep the float Dense's layout."""

    def __init__(self, kernel_q: jax.Array, kernel_scale: jax.Array, *, kernel_axes: Axes,
                 compute_dtype: str, act: str = "token", act_scale: jax.Array | None = None,
                 outlier_threshold: float | None = None, outlier_capacity: int | None = None,
                 kernel_float: jax.Array | None = None,
                 keep_float: jax.Array | None = None, bias: jax.Array | None = None,
                 rotate: bool = False, rotation_seed: int = 0, native: bool = True):
        if act not in ACT_MODES:
            raise ValueError(f"act={act!r}: allowed {', '.join(ACT_MODES)}")
        if kernel_q.dtype != jnp.int8:
            raise ValueError(f"kernel dtype {kernel_q.dtype}: QuantDense stores int8")
        lead = tuple(kernel_axes[:-2])  # e.g. ("layers",) for stacked blocks
        self.out_features, self.in_features = kernel_q.shape[-2:]
        self.compute_dtype = compute_dtype
        self.act = act
        self.rotate = rotate
        self.rotation_seed = rotation_seed
        self.native = native
        # Whether `shared_call` may multiply this kernel in one call with the other layers that
        # read the same input (static: part of the graph definition, like `native`).
        self.grouped = True
        self.outlier_threshold = outlier_threshold
        # None means every column may be an outlier (exact LLM.int8(), a full float product).
        self.outlier_capacity = min(int(outlier_capacity or self.in_features), self.in_features)
        self.kernel_q = param(kernel_q, lead + (kernel_axes[-1], kernel_axes[-2]))
        # [..., 1, out] squeezed to [..., out]; a per-tensor scale is stored as [..., 1].
        self.kernel_scale = param(kernel_scale.reshape(kernel_scale.shape[:-2] + (-1,)),
                                  lead + ((kernel_axes[-1],) if kernel_scale.shape[-1] > 1
                                          else (None,)))
        self.act_scale = param(act_scale, lead) if act == "static" else None
        self.has_float = kernel_float is not None
        self.kernel_float = param(kernel_float, kernel_axes) if self.has_float else None
        self.keep_float = param(keep_float, lead) if self.has_float else None
        self.bias = param(bias, lead + tuple(kernel_axes[-1:])) if bias is not None else None

    def prefers_layer_scan(self) -> bool:
        """Decoding keeps the stacked layer scan for this module (`model.generate.
        default_per_layer` asks) where XLA's own products run it: on another backend, without
        a built kernel, or with the kernel switched off. XLA hoists a weight-only kernel's
        int8 -> float conversion out of a per-layer token loop (a float32 copy of every
        kernel), and its one-row int8 products gain nothing from per-layer arrays."""
        return not (self.native and jax.default_backend() == "cpu"
                    and native_int8.status()["available"])

    def _int_path(self, x2: jax.Array) -> jax.Array:
        if self.rotate:
            x2 = rotation.rotate(x2.astype(jnp.float32), self.rotation_seed)
        w_q = self.kernel_q[...]
        w_scale = self.kernel_scale[...].reshape(1, -1)
        act_scale = self.act_scale[...] if self.act_scale is not None else None
        if self.outlier_threshold is None:
            return quantized_product(x2, w_q, w_scale, self.act, act_scale, self.native)
        # LLM.int8(): a column is an outlier if any token has |x| >= threshold in it; the
        # `outlier_capacity` largest columns are candidates.
        col_max = jnp.max(jnp.abs(x2.astype(jnp.float32)), axis=0)  # [in]
        top, cols = jax.lax.top_k(col_max, self.outlier_capacity)  # [capacity]
        hit = top >= self.outlier_threshold
        is_outlier = jnp.zeros(col_max.shape, bool).at[cols].set(hit)  # [in]
        regular = quantized_product(jnp.where(is_outlier, jnp.zeros_like(x2), x2), w_q, w_scale,
                                    self.act, act_scale, self.native)
        # Only the gathered columns meet their (dequantised) kernel columns in float.
        x_out = jnp.where(hit, jnp.take(x2, cols, axis=1).astype(jnp.float32), 0.0)
        w_cols = jnp.take(w_q, cols, axis=1).astype(jnp.float32) * w_scale.reshape(-1, 1)
        return regular + jax.lax.dot_general(x_out, w_cols, CONTRACT_IN)  # w_cols [out, capacity]

    def _finish(self, y: jax.Array, lead: tuple[int, ...]) -> jax.Array:
        """The float32 product [tokens, out] in the compute dtype, with x's leading axes and
        the bias."""
        dt = dtype_of(self.compute_dtype)
        y = y.astype(dt).reshape(lead + (self.out_features,))
        if self.bias is not None:
            y = y + self.bias[...].astype(dt).reshape((1,) * len(lead) + (-1,))
        return y

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = dtype_of(self.compute_dtype)
        x2 = x.reshape(-1, self.in_features).astype(dt)
        if self.has_float:
            y = jax.lax.cond(self.keep_float[...] != 0,
                             lambda v: jnp.dot(v, self.kernel_float[...].astype(dt)).astype(
                                 jnp.float32),
                             self._int_path, x2)
        else:
            y = self._int_path(x2)
        return self._finish(y, x.shape[:-1])

    def _call_signature(self) -> tuple | None:
        """What layers must share to run as one kernel call (None: this one cannot): a plain
        per-token or weight-only product in shardq's kernel."""
        if not (self.grouped and self.native and self.outlier_threshold is None
                and not self.has_float and self.act in ("token", "none")):
            return None
        return (self.act, self.rotate, self.rotation_seed, self.compute_dtype, self.in_features)

    @staticmethod
    def shared_call(x: jax.Array, layers) -> tuple[jax.Array, ...]:
        """`layer(x)` for each of `layers` (`model.layers.shared_input`). Where shardq's kernel
        runs them all (a few rows on a CPU, plain per-token or weight-only products alike), x is
        quantised (or rotated) once and one call multiplies it by every kernel; the results
        are the layers' own, bit for bit. Otherwise each layer runs alone."""
        signature = layers[0]._call_signature()
        rows = x.size // x.shape[-1]
        if (len(layers) < 2 or signature is None or not native_int8.usable(rows)
                or any(layer._call_signature() != signature for layer in layers)):
            return tuple(layer(x) for layer in layers)
        first = layers[0]
        x2 = x.reshape(-1, first.in_features).astype(dtype_of(first.compute_dtype))
        if first.rotate:
            x2 = rotation.rotate(x2.astype(jnp.float32), first.rotation_seed)
        kernels = [(layer.kernel_q[...], layer.kernel_scale[...].reshape(1, -1))
                   for layer in layers]
        native, xla = ((native_int8.product_group, token_product) if first.act == "token"
                       else (native_int8.product_weight_only_group, weight_only_product))
        ys = _native_where_it_runs(native, lambda x2, kernels: [xla(x2, *k) for k in kernels],
                                   x2, kernels)
        return tuple(layer._finish(y, x.shape[:-1]) for layer, y in zip(layers, ys, strict=True))


def blocked_weight_only_product(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [tokens, in] (float) times the int8 kernel w_q [out, in] whose scales w_scale [out, B]
    hold one per block of in / B weights of a row, in XLA's operations (the kernel dequantised,
    then a float product); float32 [tokens, out]."""
    return jax.lax.dot_general(x.astype(jnp.float32), qz.dequantize_blocks(w_q, w_scale),
                               CONTRACT_IN)


def blocked_weight_only_product_fast(x: jax.Array, w_q: jax.Array, w_scale: jax.Array
                                     ) -> jax.Array:
    """`blocked_weight_only_product` through shardq's kernel where it runs: each block's sum
    scaled in registers, equal to XLA's product to float32 rounding."""
    return _native_where_it_runs(native_int8.product_weight_only, blocked_weight_only_product,
                                 x, w_q, w_scale)


class QuantEmbed(nnx.Module):
    """int8 embedding table: gather, then scale. The scales are one per block of `block`
    consecutive values of a row (`block_scale` [vocab, embed / block], float16 or float32: GGUF
    Q8_0's layout), or one per row (`row_scale` float32 [vocab], with `block` None).

    A model whose output head is tied to this table calls `attend`. With one scale per row those
    are the head's per-output-channel scales, and the product runs in integers like a QuantDense
    (`act` "token": per-token int8 activations; "none": weight-only). With block scales the
    head is weight-only: float activations times the table, each block's sum scaled, in shardq's
    kernel where it runs (the scales cannot leave an integer product whole).
    """

    def __init__(self, table_q: jax.Array, scale: jax.Array, *, axes: Axes,
                 compute_dtype: str, act: str = "token", native: bool = True,
                 block: int | None = None):
        vocab, dim = table_q.shape
        if block is not None and (block < 1 or dim % block):
            raise ValueError(f"block={block}: must divide the embedding width {dim}")
        self.compute_dtype = compute_dtype
        self.act = "none" if block is not None else act
        self.native = native
        self.block = block
        self.embedding_q = param(table_q, axes)
        if block is None:
            self.row_scale = param(scale.reshape(-1), axes[:1])
        else:
            self.block_scale = param(scale.reshape(vocab, dim // block), (axes[0], None))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # [vocab, blocks] scales (per row: one block)
        scale = self.row_scale[...][:, None] if self.block is None else self.block_scale[...]
        rows = qz.dequantize_blocks(jnp.take(self.embedding_q[...], tokens, axis=0),
                                    jnp.take(scale, tokens, axis=0))
        return rows.astype(dtype_of(self.compute_dtype))

    def attend(self, x: jax.Array) -> jax.Array:
        """x @ table^T with the int8 table: [..., embed] -> [..., vocab]."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        table_q = self.embedding_q[...]  # [vocab, embed]: the head's kernel stored [out, in]
        if self.block is None:
            y = quantized_product(x2, table_q, self.row_scale[...][None, :], self.act,
                                  native=self.native)
        else:
            product = (blocked_weight_only_product_fast if self.native
                       else blocked_weight_only_product)
            y = product(x2, table_q, self.block_scale[...])
        return y.reshape(*lead, -1).astype(dtype_of(self.compute_dtype))


def use_grouped(model: nnx.Module, on: bool) -> nnx.Module:
    """Let `model`'s int8 layers that read the same input run as one kernel call (`on`,
    the default) or one call each, in place; returns the model (`QuantDense.shared_call`)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, QuantDense):
            module.grouped = on
    return model


def use_native(model: nnx.Module, on: bool) -> nnx.Module:
    """Route `model`'s few-row per-token int8 products through shardq's kernel (`on`) or XLA's
    operations, in place; returns the model. The choice is part of the graph definition, so a
    program traced after it keeps it. XLA cannot split a custom call over devices: a model whose
    kernels are sharded runs XLA's products."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, QuantDense | QuantEmbed):
            module.native = on
    return model
