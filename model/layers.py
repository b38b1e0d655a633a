"""The building blocks every model in `model/` is made of.

Each parameter carries logical axis names (`embed`, `mlp`, `heads`, `vocab`, ...) as NNX
metadata; `parallel/` maps them to mesh axes. Nothing here names a mesh axis.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from model import native_float

Axes = tuple[str | None, ...]

# Labels the embedding lookup in the compiled program (experiments/speed/step_profile.py groups a
# profile's time by name scope); it changes no computation.
EMBED_SCOPE = "embedding_lookup"


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def _lead(v: jax.Array, ndim: int) -> jax.Array:
    """Give a per-feature vector explicit leading axes (we run with rank promotion off)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def param(value: jax.Array, axes: Axes) -> nnx.Param:
    """A parameter annotated with logical axis names.

    Eager sharding is off: where a parameter lives is decided by `parallel/` (abstract init,
    then a jitted init with the strategy's shardings), never at construction time.
    """
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def matmul_2d(x: jax.Array, w: jax.Array) -> jax.Array:
    """x[..., in] @ w[in, out], with x's leading axes merged into one first.

    Same products and sums as `jnp.dot(x, w)`, but the weight gradient then contracts over one
    axis instead of several: with [batch, time, in] activations XLA:CPU otherwise materialises
    a transposed copy of the output gradient for every weight gradient.
    """
    y = jnp.dot(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*x.shape[:-1], w.shape[-1])


class Dense(nnx.Module):
    """y = x @ W (+ b), W stored as [in, out] in `param_dtype`, multiplied in `compute_dtype`.

    Every linear map of the models goes through this class, so `quant/` can replace it (or its
    kernel) without the model knowing. Switched by `use_native_float` (off by default), a
    float32 kernel is stored [out, in] (`out_in`) and a product of a few rows runs in shardq's
    own kernel on a CPU (`model.native_float`), which reads each output's weights front to
    back: for decoding, never for training (the kernel has no gradient).
    """

    NATIVE_FLOAT = True  # `use_native_float` switches `out_in`

    def __init__(self, in_features: int, out_features: int, *, axes: Axes, rngs: nnx.Rngs,
                 param_dtype="float32", compute_dtype="float32", use_bias: bool = False,
                 init_scale: float = 1.0):
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        # the kernel stored [..., out, in], its few-row products in shardq's kernel
        # (`use_native_float`)
        self.out_in = False
        # Fan-in scaled normal init (std = scale / sqrt(in)).
        init = nnx.initializers.normal(stddev=init_scale / in_features**0.5)
        self.kernel = param(
            init(rngs.params(), (in_features, out_features), dtype_of(param_dtype)), axes
        )
        self.bias = (
            param(jnp.zeros((out_features,), dtype_of(param_dtype)), axes[-1:])
            if use_bias else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        if self._runs_native(x):
            return self._finish(_native_products(x, [self.kernel[...]])[0], x.shape[:-1])
        dt = dtype_of(self.compute_dtype)
        return self._finish(matmul_2d(x.astype(dt), self.weight().astype(dt)), ())

    def weight(self) -> jax.Array:
        """The kernel as [in, out], whichever way it is stored."""
        w = self.kernel[...]
        return jnp.swapaxes(w, -1, -2) if self.out_in else w

    def native_eligible(self) -> bool:
        """Whether `use_native_float` moves this layer to shardq's kernel: float32 weights
        multiplied in float32."""
        return self.compute_dtype == "float32" and self.kernel[...].dtype == jnp.float32

    def _runs_native(self, x: jax.Array) -> bool:
        return self.out_in and native_float.usable(math.prod(x.shape[:-1]))

    def _finish(self, y: jax.Array, lead: tuple[int, ...]) -> jax.Array:
        """The product [rows, out] as [*lead, out] (lead (): y already has its shape), plus the
        bias."""
        if lead:
            y = y.reshape(*lead, y.shape[-1])
        if self.bias is not None:
            y = y + _lead(self.bias[...].astype(y.dtype), y.ndim)
        return y

    @staticmethod
    def shared_call(x: jax.Array, layers) -> tuple[jax.Array, ...]:
        """`layer(x)` for each of `layers`: one call of shardq's kernel for all of them where
        each would run there alone (`model.layers.shared_input`)."""
        if len(layers) > 1 and all(layer._runs_native(x) for layer in layers):
            ys = _native_products(x, [layer.kernel[...] for layer in layers])
            return tuple(layer._finish(y, x.shape[:-1]) for layer, y in zip(layers, ys,
                                                                            strict=True))
        return tuple(layer(x) for layer in layers)


def _native_products(x: jax.Array, kernels: list[jax.Array]) -> list[jax.Array]:
    """x [..., in] times every float32 kernel [out, in] (transposed) in one call of shardq's
    kernel on a CPU (XLA's dots elsewhere): [rows, out] each."""
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return jax.lax.platform_dependent(
        x2, kernels, cpu=native_float.product_group,
        default=lambda x2, kernels: [jnp.dot(x2, w.T) for w in kernels])


def _store_out_in(dense: Dense, on: bool) -> None:
    """Store `dense`'s kernel [..., out, in] (`on`) or [..., in, out], its axis names with it."""
    if dense.out_in == on:
        return
    meta = dense.kernel.get_metadata()
    axes = meta.get("out_sharding")
    dense.kernel = nnx.Param(
        jnp.swapaxes(dense.kernel[...], -1, -2),
        **{**meta, **({"out_sharding": (*axes[:-2], axes[-1], axes[-2])} if axes else {})})
    dense.out_in = on


def use_native_float(model: nnx.Module, on: bool) -> nnx.Module:
    """Route `model`'s few-row float32 work through shardq's kernels (`on`) or XLA's
    operations, in place; returns the model: every module whose class sets `NATIVE_FLOAT` (the
    Dense products, `model.native_float`, their float32 kernels then stored [out, in]; a tied
    head; attention over a float32 or int8 cache at one position, `model.native_attention`).
    For decoding only: the kernels have no gradient, and a kernel stored [out, in] is not what
    training, `quant/` or an export reads (switch it off first). The switch is part of the graph
    definition and the kernels' layout of the state: take both (`nnx.split`) after it. XLA
    cannot split a custom call over devices (it would gather a sharded kernel whole): a model
    whose kernels are sharded should keep XLA's dots."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Dense):
            _store_out_in(module, on and module.native_eligible())
        elif getattr(type(module), "NATIVE_FLOAT", False):
            module.native = on
    return model


def shared_input(x: jax.Array, *layers: nnx.Module) -> tuple[jax.Array, ...]:
    """`layer(x)` for each of `layers`, all of which read the same x (an attention's q, k and v;
    a gated MLP's gate and up). A layer class with a `shared_call(x, layers)` method computes
    them together where it can (quant's int8 twins quantise x once and multiply every kernel in
    one call); otherwise each layer runs alone."""
    kind = type(layers[0])
    if hasattr(kind, "shared_call") and all(type(layer) is kind for layer in layers):
        return kind.shared_call(x, layers)
    return tuple(layer(x) for layer in layers)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, or with `plus_one` (Gemma) * (1 + scale): then the stored scale
    starts at 0 and `offset` (1.0) is what a fold into it must keep (quant/smoothquant.py)."""

    def __init__(self, dim: int, *, eps: float, param_dtype="float32", axes: Axes = ("embed",),
                 plus_one: bool = False):
        self.eps = eps
        self.offset = 1.0 if plus_one else 0.0
        init = jnp.zeros if plus_one else jnp.ones
        self.scale = param(init((dim,), dtype_of(param_dtype)), axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in fp32 whatever the compute dtype: the mean of squares is precision-sensitive.
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        if self.offset:
            scale = scale + self.offset
        return (x32 * inv * _lead(scale, x.ndim)).astype(x.dtype)


class Embed(nnx.Module):
    """A [vocab, embed] table: the input lookup, and (`attend`) the head of a model whose input
    and output embeddings are tied. With `native` (`use_native_float`) a float32 head of a few
    rows runs in shardq's kernel on a CPU, reading the table's rows front to back."""

    NATIVE_FLOAT = True  # `use_native_float` switches `native`

    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, param_dtype="float32",
                 compute_dtype="float32"):
        self.compute_dtype = compute_dtype
        self.native = False
        init = nnx.initializers.normal(stddev=1.0)
        self.embedding = param(
            init(rngs.params(), (vocab, dim), dtype_of(param_dtype)), ("vocab", "embed")
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        with jax.named_scope(EMBED_SCOPE):  # the lookup and (transposed) its scatter-add
            return jnp.take(self.embedding[...], tokens, axis=0).astype(
                dtype_of(self.compute_dtype))

    def attend(self, x: jax.Array) -> jax.Array:
        """x @ embedding^T: the output head of a model whose input and output embeddings are
        tied (one [vocab, embed] table serves both)."""
        dt = dtype_of(self.compute_dtype)
        table = self.embedding[...]
        if (self.native and dt == jnp.float32 and table.dtype == jnp.float32
                and native_float.usable(math.prod(x.shape[:-1]))):
            return _native_products(x, [table])[0].reshape(*x.shape[:-1], table.shape[0])
        return matmul_2d(x.astype(dt), table.astype(dt).T)


# At most this many query blocks per sequence: XLA packs each block's buffers separately, so
# past a few blocks the step's compiled peak grows with their count (the planner's peaks show
# it on the large presets).
MAX_ATTENTION_BLOCKS = 8


def attention_block(length: int) -> int:
    """Query positions per block of `causal_attention` for a sequence of `length`: the power of
    two nearest sqrt(8 * length) (32 at 128, 64 at 512), but no fewer than length / 8 (256 at
    2,048, 1,024 at 8,192). Smaller blocks skip more of the masked half of the scores but pay a
    fixed cost per block; sqrt(8 * length) balances the two for attention's forward and backward
    on XLA:CPU (docs/training_speed.md has what it buys in a training step)."""
    nearest = 2 ** max(0, round(math.log2(math.sqrt(8 * length))))
    return max(nearest, -(-length // MAX_ATTENTION_BLOCKS))


def causal_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                     block: int | None = None, window: int | None = None) -> jax.Array:
    """Causal softmax attention (T == S) with K key/value heads, K dividing the N query heads
    (K == N: multi-head; K < N: grouped-query, query head n attending with key/value head
    n // (N / K), as Llama does): [B, T, N, H].

    The same arithmetic as `jax.nn.dot_product_attention(q, k, v, is_causal=True)` (scores,
    scaled, masked, softmax, weighted sum), arranged for XLA's plain batched matmuls:
    - the heads move next to the batch once, and a group's G = N / K query heads are stacked as
      G rows per position ([B, K, T * G, H], row t * G + g), so no key or value is repeated per
      group and XLA:CPU adds no transposes around the products, forward or backward;
    - the queries go in blocks of `block` positions (default `attention_block(T)`), and the
      block of positions [a, b) only meets the keys [0, b): the key blocks wholly above the
      diagonal, masked to nothing, are never computed (7/16 of the scores with 8 blocks), and
      a block's [rows, b] scores are smaller, so more of them stay in cache through the softmax;
    - the backward is written out (`_attention_blocks`), with fewer passes over the scores than
      autodiff's.
    With `window` (sliding-window attention) position t also stops seeing keys before
    t - window + 1; a masked score's probability is 0, so the backward needs no change.
    """
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxSxKxH.shape[2]
    group = N // K
    block = attention_block(T) if block is None else block
    if block < 1:
        raise ValueError(f"block: must be a positive number of positions, got {block}")
    q = q_BxTxNxH.reshape(B, T, K, group, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * group, H)
    k, v = (jnp.swapaxes(a, 1, 2) for a in (k_BxSxKxH, v_BxSxKxH))  # B,K,S,H
    if window is None:
        out = _attention_blocks(q, k, v, group, block)  # B,K,T*G,H
    elif isinstance(window, int):
        out = _windowed_attention_blocks(q, k, v, group, block, window)
    else:  # a traced window: one per layer, read inside the layer scan (Gemma 3)
        out = _traced_window_blocks(q, k, v, jnp.asarray(window), group, block)
    return out.reshape(B, K, T, group, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)


def _spans(length: int, block: int) -> list[tuple[int, int]]:
    """The query blocks [a, b) of a sequence (the last one may be shorter)."""
    return [(a, min(a + block, length)) for a in range(0, length, block)]


def _blocks_forward(q, k, v, group, block, window=None):
    """softmax(mask(q k^T / sqrt(H))) v for q [B, K, T * G, H] and k, v [B, K, S, H], block by
    block; also each block's probabilities [B, K, (b - a) * G, b]."""
    S, H = k.shape[2], q.shape[-1]
    outs, probs = [], []
    for a, b in _spans(S, block):
        scores = jnp.einsum("bkrh,bksh->bkrs", q[:, :, a * group:b * group], k[:, :, :b],
                            preferred_element_type=jnp.float32)
        scores = scores * jnp.asarray(1.0 / math.sqrt(H), jnp.float32)
        # Row r is position a + r // G; it sees keys up to that position. Built in the program
        # (iota), not as a constant: a long sequence's masks would bloat it.
        position = a + jnp.arange((b - a) * group) // group
        causal = jnp.arange(b)[None, :] <= position[:, None]
        if window is not None:
            causal = causal & (jnp.arange(b)[None, :] > position[:, None] - window)
        # The masked value jax.nn.dot_product_attention uses (finite: no inf - inf anywhere).
        scores = jnp.where(causal, scores, -0.7 * float(jnp.finfo(jnp.float32).max))
        p = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkrs,bksh->bkrh", p, v[:, :, :b]))
        probs.append(p)
    return jnp.concatenate(outs, axis=2), probs


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention_blocks(q, k, v, group, block):
    return _blocks_forward(q, k, v, group, block)[0]


def _attention_blocks_fwd(q, k, v, group, block):
    out, probs = _blocks_forward(q, k, v, group, block)
    return out, (q, k, v, out, probs)


def _attention_blocks_bwd(group, block, residuals, d_out):
    """Per query block, the softmax backward dS = P * (dP - rowsum(dP * P)) with rowsum(dP * P)
    taken as rowsum(dO * O), a pass over [rows, H] instead of [rows, b] (the identity flash
    attention uses: dP = dO V^T, so rowsum(dP * P) = rowsum(dO * P V)); the 1/sqrt(H) scale and
    the mask need no pass of their own (masked probabilities are 0, so their dS is too; the scale
    goes on the smaller dQ and dK). dK and dV sum over a group's query heads inside their
    products, and over the query blocks that reach each key."""
    q, k, v, out, probs = residuals
    f32 = jnp.float32
    S = k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    d_q, d_k, d_v = [], jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    for (a, b), p in zip(_spans(S, block), probs, strict=True):
        rows = slice(a * group, b * group)
        d_o, o, q_rows = d_out[:, :, rows], out[:, :, rows], q[:, :, rows]
        to_keys = ((0, 0), (0, 0), (0, S - b), (0, 0))  # keys [0, b) -> all S
        d_v = d_v + jnp.pad(jnp.einsum("bkrs,bkrh->bksh", p, d_o.astype(p.dtype),
                                       preferred_element_type=f32), to_keys)
        d_p = jnp.einsum("bkrh,bksh->bkrs", d_o, v[:, :, :b], preferred_element_type=f32)
        row = jnp.sum(d_o.astype(f32) * o.astype(f32), axis=-1, keepdims=True)
        d_s = (p.astype(f32) * (d_p - row)).astype(q.dtype)
        d_q.append(jnp.einsum("bkrs,bksh->bkrh", d_s, k[:, :, :b],
                              preferred_element_type=f32) * scale)
        d_k = d_k + jnp.pad(jnp.einsum("bkrs,bkrh->bksh", d_s, q_rows,
                                       preferred_element_type=f32) * scale, to_keys)
    return (jnp.concatenate(d_q, axis=2).astype(q.dtype), d_k.astype(k.dtype),
            d_v.astype(v.dtype))


_attention_blocks.defvjp(_attention_blocks_fwd, _attention_blocks_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _windowed_attention_blocks(q, k, v, group, block, window):
    """`_attention_blocks` with a sliding window: the same backward (masked probabilities are 0
    whichever mask made them)."""
    return _blocks_forward(q, k, v, group, block, window)[0]


def _windowed_fwd(q, k, v, group, block, window):
    out, probs = _blocks_forward(q, k, v, group, block, window)
    return out, (q, k, v, out, probs)


def _windowed_bwd(group, block, window, residuals, d_out):
    return _attention_blocks_bwd(group, block, residuals, d_out)


_windowed_attention_blocks.defvjp(_windowed_fwd, _windowed_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _traced_window_blocks(q, k, v, window, group, block):
    """`_windowed_attention_blocks` with the window a traced integer (an array operand, so
    that one scan body serves sliding and global layers: a global layer's window exceeds any
    position)."""
    return _blocks_forward(q, k, v, group, block, window)[0]


def _traced_window_fwd(q, k, v, window, group, block):
    out, probs = _blocks_forward(q, k, v, group, block, window)
    return out, (q, k, v, out, probs)


def _traced_window_bwd(group, block, residuals, d_out):
    return (*_attention_blocks_bwd(group, block, residuals, d_out), None)


_traced_window_blocks.defvjp(_traced_window_fwd, _traced_window_bwd)


def fused_causal_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array,
                           v_BxSxKxH: jax.Array, window: int | None = None) -> jax.Array:
    """Causal attention through cuDNN's fused kernel (flash attention; K divides N for
    grouped-query attention): the [T, S] scores stay on chip instead of being written out, forward
    and backward. Only an NVIDIA GPU backend has it; elsewhere this is refused in one line."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(f"attention='cudnn': needs an NVIDIA GPU, the JAX backend is {backend!r} "
                         f"(use attention='xla')")
    # local_window_size (left, right): a query sees `window - 1` keys before it and itself.
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, is_causal=True,
                                        implementation="cudnn", local_window_size=local)


def rotary_angles(positions_BxT: jax.Array, half: int, base: float,
                  freqs: jax.Array | None = None,
                  scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) [B, T, 1, half] float32 of the rotary angles at `positions_BxT`: `freqs` [half]
    (a layer's own, traced), else the ones `base` gives; both times `scale` (LongRoPE's
    attention factor).

    They are computed once, apart from the products that rotate q and k: fused into each of
    them, XLA:CPU would evaluate sin and cos again for every element of every head."""
    if freqs is None:
        freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions_BxT[..., None].astype(jnp.float32) * freqs[None, None, :]  # B,T,H/2
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if scale != 1.0:
        sin, cos = sin * jnp.float32(scale), cos * jnp.float32(scale)
    sin, cos = jax.lax.optimization_barrier((sin, cos))
    return sin[:, :, None, :], cos[:, :, None, :]


def rotary(x_BxTxNxH: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotary position embedding (rotate-half convention) with `rotary_angles`' tables,
    computed in fp32: on the first 2 * (the tables' width) dimensions of each head, the rest
    passed through (RoPE on part of a head, `ModelConfig.rotary_dim`)."""
    turned = 2 * sin.shape[-1]
    if turned < x_BxTxNxH.shape[-1]:
        return jnp.concatenate([rotary(x_BxTxNxH[..., :turned], sin, cos),
                                x_BxTxNxH[..., turned:]], axis=-1)
    x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)
