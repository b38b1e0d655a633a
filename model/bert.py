"""BERT-style encoder (post-LayerNorm, exact-erf GELU, absolute positions) and sentence embeddings.

Built from the same parts as the decoder so `quant/` and `parallel/` apply unchanged: every linear
map is a `model.layers.Dense` (with bias), every parameter carries logical axis names, and the
blocks are stacked by `nnx.vmap` on a `layers` axis and run under one `lax.scan`.

Module paths (what quant rules match): "embeddings/word", "blocks/attn/{q,k,v,o}",
"blocks/mlp/{up,down}". The post-attention and post-MLP norms are deliberately *not* called
`attn_norm`/`mlp_norm`: the decoder's SmoothQuant fold assumes pre-norms that feed only the
Dense layers, which is false here (a post-norm also feeds the residual); see quant/encoder.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from model.layer_stack import Runner, scan_layers
from model.layers import Axes, Dense, Embed, _lead, dtype_of, param, shared_input


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 12
    d_ff: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    pad_id: int = 0
    param_dtype: str = "float32"
    compute_dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions",
                     "type_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be a positive integer")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} does not divide into n_heads="
                             f"{self.n_heads}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class LayerNorm(nnx.Module):
    """(x - mean) / sqrt(var + eps) * scale + bias, computed in fp32 (BERT's eps is 1e-12)."""

    def __init__(self, dim: int, *, eps: float, param_dtype="float32", axes: Axes = ("embed",)):
        self.eps = eps
        self.scale = param(jnp.ones((dim,), dtype_of(param_dtype)), axes)
        self.bias = param(jnp.zeros((dim,), dtype_of(param_dtype)), axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * _lead(self.scale[...].astype(jnp.float32), x.ndim)
        return (y + _lead(self.bias[...].astype(jnp.float32), x.ndim)).astype(x.dtype)


class Embeddings(nnx.Module):
    """word + absolute position + token type, then LayerNorm."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        self.compute_dtype = cfg.compute_dtype
        self.word = Embed(cfg.vocab_size, cfg.d_model, rngs=rngs, param_dtype=cfg.param_dtype,
                          compute_dtype=cfg.compute_dtype)
        init = nnx.initializers.normal(stddev=0.02)
        dt = dtype_of(cfg.param_dtype)
        # Position and type rows are not a vocabulary: their first axis is never sharded.
        self.position = param(init(rngs.params(), (cfg.max_positions, cfg.d_model), dt),
                              (None, "embed"))
        self.token_type = param(init(rngs.params(), (cfg.type_vocab_size, cfg.d_model), dt),
                                (None, "embed"))
        self.norm = LayerNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)

    def __call__(self, tokens_BxT: jax.Array, token_types_BxT: jax.Array) -> jax.Array:
        T = tokens_BxT.shape[1]
        dt = dtype_of(self.compute_dtype)
        pos = self.position[...][:T].astype(dt)[None]  # 1,T,D
        types = jnp.take(self.token_type[...], token_types_BxT, axis=0).astype(dt)
        return self.norm(self.word(tokens_BxT) + pos + types)


class Attention(nnx.Module):
    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        kw = dict(rngs=rngs, use_bias=True, param_dtype=cfg.param_dtype,
                  compute_dtype=cfg.compute_dtype)
        self.q = Dense(d, d, axes=("embed", "heads"), **kw)
        self.k = Dense(d, d, axes=("embed", "heads"), **kw)
        self.v = Dense(d, d, axes=("embed", "heads"), **kw)
        self.o = Dense(d, d, axes=("heads", "embed"), **kw)

    def __call__(self, x_BxTxD: jax.Array, mask_BxT: jax.Array) -> jax.Array:
        cfg = self.cfg
        B, T, _ = x_BxTxD.shape
        split = lambda y: y.reshape(B, T, cfg.n_heads, cfg.head_dim)
        q, k, v = (split(y) for y in shared_input(x_BxTxD, self.q, self.k, self.v))
        # Keys at padding positions are hidden from every query; padded queries still see the
        # real keys, so no row is fully masked (their outputs are dropped by the pooling).
        out = jax.nn.dot_product_attention(q, k, v, mask=mask_BxT[:, None, None, :])
        return self.o(out.reshape(B, T, cfg.d_model))


# erf(x) = x * P(x^2) / Q(x^2) on x clamped to [-4, 4] (erf is +-1 in float32 beyond): the
# rational approximation Eigen and XLA's own elemental erf use, exact to float32 rounding
# (tests/test_bert.py checks the GELU against float64).
# jax.lax.erf lowers to a piecewise erf/erfc form with an exp and two long polynomials, which
# XLA:CPU splits into several materialised passes when the GELU feeds a quantiser's absmax and
# its rounding (two consumers): this single polynomial fuses into the producing matmul's
# epilogue instead.
_ERF_P = (-1.60960333262415e-02, -2.95459980854025e-03, -7.34990630326855e-04,
          -5.69250639462346e-05, -2.10102402082508e-06, 2.77068142495902e-08,
          -2.72614225801306e-10)
_ERF_Q = (-1.42647390514189e-02, -7.37332916720468e-03, -1.68282697438203e-03,
          -2.13374055278905e-04, -1.45660718464996e-05)
_INV_SQRT2 = float(1 / 2 ** 0.5)


def erf_f32(x: jax.Array) -> jax.Array:
    """erf for float32 inputs (see above); computed in float32 whatever x's dtype."""
    x = jnp.clip(x.astype(jnp.float32), -4.0, 4.0)
    x2 = x * x
    p = jnp.float32(_ERF_P[-1])
    for c in _ERF_P[-2::-1]:
        p = p * x2 + jnp.float32(c)
    q = jnp.float32(_ERF_Q[-1])
    for c in _ERF_Q[-2::-1]:
        q = q * x2 + jnp.float32(c)
    return x * p / q


def gelu(x: jax.Array) -> jax.Array:
    """BERT's exact GELU, x * Phi(x) = x/2 * (1 + erf(x / sqrt 2)) (not the tanh form)."""
    y = 0.5 * x.astype(jnp.float32) * (1.0 + erf_f32(x.astype(jnp.float32) * _INV_SQRT2))
    return y.astype(x.dtype)


class Mlp(nnx.Module):
    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        kw = dict(rngs=rngs, use_bias=True, param_dtype=cfg.param_dtype,
                  compute_dtype=cfg.compute_dtype)
        self.up = Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), **kw)
        self.down = Dense(cfg.d_ff, cfg.d_model, axes=("mlp", "embed"), **kw)

    def __call__(self, x):
        return self.down(gelu(self.up(x)))


class Block(nnx.Module):
    """Post-LN: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        self.attn = Attention(cfg, rngs=rngs)
        self.attn_out_norm = LayerNorm(cfg.d_model, eps=cfg.norm_eps,
                                       param_dtype=cfg.param_dtype)
        self.mlp = Mlp(cfg, rngs=rngs)
        self.mlp_out_norm = LayerNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)

    def __call__(self, x, mask):
        x = self.attn_out_norm(x + self.attn(x, mask))
        return self.mlp_out_norm(x + self.mlp(x))


class BertEncoder(nnx.Module):
    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg, rngs=rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)

    def __call__(self, tokens_BxT: jax.Array, mask_BxT: jax.Array | None = None,
                 token_types_BxT: jax.Array | None = None, *,
                 runner: Runner = scan_layers) -> jax.Array:
        """Hidden states [B, T, D] in fp32.

        The mask defaults to `tokens != pad_id`, which is what lets quant/calibrate.py call the
        encoder like the decoder (token rows only). `runner` (model/layer_stack.py) runs the
        blocks with the mask as their shared input; calibration passes one that runs them
        eagerly.
        """
        if mask_BxT is None:
            mask_BxT = tokens_BxT != self.cfg.pad_id
        mask_BxT = mask_BxT.astype(bool)
        if token_types_BxT is None:
            token_types_BxT = jnp.zeros_like(tokens_BxT)
        x = self.embeddings(tokens_BxT, token_types_BxT)
        block_def, stacked = nnx.split(self.blocks)

        def run_layer(layer_params, x, mask):
            return nnx.merge(block_def, layer_params)(x, mask)

        return runner(run_layer, stacked, x, mask_BxT).astype(jnp.float32)


def mean_pool(hidden_BxTxD: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Mean over the real tokens (sentence-transformers' pooling, same 1e-9 clamp)."""
    m = mask_BxT.astype(jnp.float32)[..., None]
    summed = jnp.sum(hidden_BxTxD.astype(jnp.float32) * m, axis=1)
    return summed / jnp.maximum(jnp.sum(m, axis=1), 1e-9)


def l2_normalize(x_BxD: jax.Array) -> jax.Array:
    norm = jnp.linalg.norm(x_BxD, axis=-1, keepdims=True)
    return x_BxD / jnp.maximum(norm, 1e-12)


def sentence_embeddings(model: nnx.Module, tokens_BxT: jax.Array,
                        mask_BxT: jax.Array) -> jax.Array:
    """Unit-norm sentence embeddings [B, D] (fp32): encoder -> masked mean -> L2 normalise."""
    return l2_normalize(mean_pool(model(tokens_BxT, mask_BxT), mask_BxT))
