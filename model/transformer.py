"""Decoder-only transformer language model (pre-norm, RMSNorm, rotary attention, GELU MLP).

The Llama family's options are config fields of the same class: grouped-query attention
(`n_kv_heads`), a gated SwiGLU MLP (`mlp="swiglu"`), a head tied to the input embedding
(`tie_embeddings`), `rope_base` and `norm_eps` (see `model.config.MODEL_PRESETS["smollm2"]`).
Other families are fields too: Mistral's `sliding_window`, Qwen2's `qkv_bias`, Qwen3's
`qk_norm` and `head_size`, Phi-4-mini's `rotary_dim` and LongRoPE (`rope_short_factors`;
model/hf_decoder.py reads them from a Hugging Face config), and
Gemma 3's: (1 + w) norms, post-attention / post-MLP norms, a GeGLU MLP, a query scale, scaled
embeddings, a final logit soft-cap, and interleaved sliding-window and global layers with
their own RoPE bases (`layer_pattern`).

Per-layer attention settings are arrays (`layer_tables`), not Python branches: a runner scans
one layer body over every layer, so the layer's window and rotary frequencies are looked up by
a layer counter carried beside the activations through the scan (the runner protocol passes
the carry through untouched, whatever its structure).

The blocks are created with `nnx.vmap`, so every block parameter is stacked on a leading
`layers` axis, and a runner (model/layer_stack.py; by default one `lax.scan`) runs them. A
caller may pass its own runner: `parallel/` gathers each layer's shards right before it runs
(ZeRO-3) without this file knowing about meshes. `decode` runs with a KV cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.cached_attention import blocked_cached_attention, padded_length
from model.config import ModelConfig
from model.kv_cache import KVCache, cache_shapes
from model.layer_stack import Runner, default_runner
from model.layers import (
    Dense,
    Embed,
    RMSNorm,
    causal_attention,
    dtype_of,
    fused_causal_attention,
    rotary,
    rotary_angles,
    shared_input,
)
from model.rope import attention_rope, llama3_freqs, rope_freqs

# Name scopes that label the compiled program's operations (a profile groups its time by them:
# experiments/speed/step_profile.py). They change no computation.
ATTENTION_SCOPE = "attention_core"  # scores, mask, softmax, weighted sum: no projection
# A global layer's window under `layer_pattern`: larger than any position, so it masks nothing.
NO_WINDOW = 2**30


def layer_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per layer under `layer_pattern`: the attention window [L] int32 (NO_WINDOW on global
    layers) and the rotary frequencies [L, head_dim / 2] float32."""
    sliding = [c == "s" for c in cfg.layer_pattern]
    windows = np.array([cfg.sliding_window if s else NO_WINDOW for s in sliding], np.int32)
    local = rope_freqs(cfg.rope_local_base, cfg.head_dim)
    full = llama3_freqs(cfg)
    return windows, np.stack([local if s else full for s in sliding])


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap); x itself for cap 0 (off)."""
    return cap * jnp.tanh(x / cap) if cap else x


class Attention(nnx.Module):
    # `model.layers.use_native_float` switches `native`: attention over a float32 or int8 cache
    # at one position in shardq's kernel (model/native_attention.py)
    NATIVE_FLOAT = True

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.native = False
        d, dt = cfg.d_model, dict(param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype)
        kv = cfg.kv_heads * cfg.head_dim  # grouped-query attention: fewer key/value heads
        bias = dict(use_bias=cfg.qkv_bias)
        self.q = Dense(d, cfg.q_dim, axes=("embed", "heads"), rngs=rngs, **bias, **dt)
        self.k = Dense(d, kv, axes=("embed", "kv_heads"), rngs=rngs, **bias, **dt)
        self.v = Dense(d, kv, axes=("embed", "kv_heads"), rngs=rngs, **bias, **dt)
        # Residual-branch outputs start small (GPT-2 style 1/sqrt(2L)) so deep stacks train stably.
        self.o = Dense(cfg.q_dim, d, axes=("heads", "embed"), rngs=rngs,
                       init_scale=(2 * cfg.n_layers) ** -0.5, **dt)
        if cfg.qk_norm:  # one scale per position within a head, shared by every head
            norm = dict(eps=cfg.norm_eps, param_dtype=cfg.param_dtype, axes=("head_dim",),
                        plus_one=cfg.norm_plus_one)
            self.q_norm = RMSNorm(cfg.head_dim, **norm)
            self.k_norm = RMSNorm(cfg.head_dim, **norm)

    def __call__(self, x_BxTxD, positions_BxT, cache=None, cache_index=None, layer=None):
        """`layer`: this layer's (window, rotary freqs) under `layer_pattern`, else None."""
        cfg = self.cfg
        B, T, _ = x_BxTxD.shape
        split = lambda y: y.reshape(B, T, -1, cfg.head_dim)
        q, k, v = (split(y) for y in shared_input(x_BxTxD, self.q, self.k, self.v))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if layer is None:
            window = cfg.sliding_window
            freqs, rope_scale = attention_rope(cfg)
        else:
            (window, freqs), rope_scale = layer, 1.0
        sin, cos = rotary_angles(positions_BxT, cfg.rope_dim // 2, cfg.rope_base,
                                 None if freqs is None else jnp.asarray(freqs), rope_scale)
        q, k = rotary(q, sin, cos), rotary(k, sin, cos)
        if cfg.query_pre_attn_scalar not in (0.0, cfg.head_dim):
            # attention divides by sqrt(head_dim); the query takes the rest of the scale
            scale = math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar)
            q = (q.astype(jnp.float32) * scale).astype(q.dtype)
        # With GQA, k and v keep kv_heads heads (also in the cache): query head n attends with
        # key/value head n // (n_heads / kv_heads), as Llama does.
        if cache is None:
            with jax.named_scope(ATTENTION_SCOPE):
                if cfg.attention == "cudnn":
                    out = fused_causal_attention(q, k, v, window=window)
                else:
                    out = causal_attention(q, k, v, window=window)
            new_cache = None
        else:
            # Write this chunk's keys/values at cache_index, attend over everything written so far
            # (block by block: the result does not depend on how long the cache is).
            new_cache = cache.write(k, v, cache_index)
            with jax.named_scope(ATTENTION_SCOPE):
                out = blocked_cached_attention(q, new_cache, positions_BxT, cache_index + T - 1,
                                               window=window, native=self.native)
        return self.o(out.reshape(B, T, cfg.q_dim)), new_cache


class Mlp(nnx.Module):
    """gelu: down(gelu(up x)); swiglu: down(silu(gate x) * up x), with a third Dense `gate`;
    geglu: down(gelu_tanh(gate x) * up x)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = dict(param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype)
        self.kind = cfg.mlp
        if cfg.mlp in ("swiglu", "geglu"):
            self.gate = Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), rngs=rngs, **dt)
        self.up = Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), rngs=rngs, **dt)
        self.down = Dense(cfg.d_ff, cfg.d_model, axes=("mlp", "embed"), rngs=rngs,
                          init_scale=(2 * cfg.n_layers) ** -0.5, **dt)

    def __call__(self, x):
        if self.kind == "gelu":
            return self.down(jax.nn.gelu(self.up(x)))
        gate, up = shared_input(x, self.gate, self.up)
        if self.kind == "swiglu":
            return self.down(jax.nn.silu(gate) * up)
        return self.down(jax.nn.gelu(gate, approximate=True) * up)


def _norm(cfg: ModelConfig) -> RMSNorm:
    return RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype,
                   plus_one=cfg.norm_plus_one)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _norm(cfg)
        self.mlp = Mlp(cfg, rngs=rngs)
        self.post_norms = cfg.post_norms
        if cfg.post_norms:  # Gemma: each branch's output normalised before the residual add
            self.post_attn_norm = _norm(cfg)
            self.post_mlp_norm = _norm(cfg)

    def __call__(self, x, positions, cache=None, cache_index=None, layer=None):
        h, new_cache = self.attn(self.attn_norm(x), positions, cache, cache_index, layer)
        if self.post_norms:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.post_norms:
            h = self.post_mlp_norm(h)
        return x + h, new_cache


class DecoderLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, rngs=rngs, param_dtype=cfg.param_dtype,
                           compute_dtype=cfg.compute_dtype)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = _norm(cfg)
        if not cfg.tie_embeddings:  # tied: the embedding table is the head (`Embed.attend`)
            self.head = Dense(cfg.d_model, cfg.vocab_size, axes=("embed", "vocab"), rngs=rngs,
                              param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype)

    def logits(self, x_BxTxD: jax.Array) -> jax.Array:
        """fp32 logits from the last block's output: final norm, then the head (or the tied
        embedding)."""
        h = self.final_norm(x_BxTxD)
        out = self.embed.attend(h) if self.cfg.tie_embeddings else self.head(h)
        return softcap(out.astype(jnp.float32), self.cfg.final_softcap)

    def embed_tokens(self, tokens_BxT: jax.Array) -> jax.Array:
        """The input embeddings; with `embed_scale` times sqrt(d_model), in the compute dtype
        (as transformers' Gemma rounds it)."""
        x = self.embed(tokens_BxT)
        if self.cfg.embed_scale:
            x = x * jnp.asarray(math.sqrt(self.cfg.d_model), x.dtype)
        return x

    def __call__(self, tokens_BxT: jax.Array, *, positions_BxT: jax.Array | None = None,
                 runner: Runner | None = None) -> jax.Array:
        """Logits [B, T, vocab] in fp32.

        `runner` (see model/layer_stack.py) runs the stacked blocks; the default is one scan
        with the config's remat policy and unroll.
        """
        cfg = self.cfg
        B, T = tokens_BxT.shape
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
        block_def, stacked = nnx.split(self.blocks)
        runner = runner or default_runner(cfg.remat, cfg.scan_unroll)
        x = self.embed_tokens(tokens_BxT)
        if cfg.layer_pattern is None:
            def run_layer(layer_params, x, positions):
                return nnx.merge(block_def, layer_params)(x, positions)[0]

            return self.logits(runner(run_layer, stacked, x, positions_BxT))

        windows, freqs = layer_tables(cfg)

        def run_counted(layer_params, carry, positions):
            # carry: (activations, layer number as float32: its cotangent is an ordinary zero)
            x, i = carry
            at = i.astype(jnp.int32)
            layer = (jnp.asarray(windows)[at], jnp.asarray(freqs)[at])
            return nnx.merge(block_def, layer_params)(x, positions, layer=layer)[0], i + 1

        x, _ = runner(run_counted, stacked, (x, jnp.zeros((), jnp.float32)), positions_BxT)
        return self.logits(x)

    def decode(self, tokens_BxT: jax.Array, cache: KVCache | list,
               cache_index: jax.Array | int,
               layers: list | None = None,
               last_only: bool = False) -> tuple[jax.Array, KVCache | list]:
        """(logits [B, T, vocab] fp32, updated cache) for tokens at positions cache_index + t;
        with `last_only`, the last position's logits only ([B, 1, vocab]: generation reads no
        other, and the head's product over every position of a long prompt is its largest).

        Writes this chunk's keys and values into the cache and attends over everything written
        so far: a prompt (prefill) or one new token at a time (generation).

        By default one scan runs the stacked blocks over the stacked cache. With `layers` (per
        layer block states, `unstack_layers`) and a per-layer cache list (`unstack_cache`), the
        blocks run one after the other on their own arrays: a scan slices each layer's weights
        out of the stack at every call, and on XLA:CPU that slice is a copy, so a decoding step
        would move every weight three times (read, write, read again) instead of once.
        """
        B, T = tokens_BxT.shape
        positions_BxT = jnp.broadcast_to(cache_index + jnp.arange(T), (B, T))
        block_def, stacked = nnx.split(self.blocks)
        x = self.embed_tokens(tokens_BxT)
        tables = None if self.cfg.layer_pattern is None else layer_tables(self.cfg)
        if layers is not None:
            new_cache = []
            for i, (layer_params, layer_cache) in enumerate(zip(layers, cache, strict=True)):
                per = None if tables is None else (jnp.asarray(tables[0][i]),
                                                   jnp.asarray(tables[1][i]))
                x, c = nnx.merge(block_def, layer_params)(x, positions_BxT, layer_cache,
                                                          cache_index, per)
                new_cache.append(c)
            return self.logits(x[:, -1:] if last_only else x), new_cache

        def layer(x, xs):
            layer_params, layer_cache, per = xs
            return nnx.merge(block_def, layer_params)(x, positions_BxT, layer_cache, cache_index,
                                                      per)

        per_layer = None if tables is None else tuple(jnp.asarray(t) for t in tables)
        x, cache = jax.lax.scan(layer, x, (stacked, cache, per_layer))
        return self.logits(x[:, -1:] if last_only else x), cache

    def unstack_layers(self) -> list:
        """The stacked blocks' state split into one state per layer (for `decode(layers=...)`).
        Call it once, outside the per-token loop: the slices are copies."""
        _, stacked = nnx.split(self.blocks)
        return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(self.cfg.n_layers)]

    @staticmethod
    def unstack_cache(cache) -> list:
        """A stacked cache (any cache pytree with a leading `layers` axis) as one per layer."""
        n = jax.tree.leaves(cache)[0].shape[0]
        return [jax.tree.map(lambda a, i=i: a[i], cache) for i in range(n)]

    def init_cache(self, batch: int, length: int | None = None, dtype=None) -> KVCache:
        """An empty cache for `length` positions (default: the context), allocated in whole
        blocks of `model.cached_attention.CACHE_BLOCK`."""
        cfg = self.cfg
        length = padded_length(cfg.max_len if length is None else length)
        k, v = cache_shapes(cfg.n_layers, batch, length, cfg.kv_heads, cfg.head_dim)
        dt = dtype or dtype_of(cfg.compute_dtype)
        return KVCache(jnp.zeros(k, dt), jnp.zeros(v, dt), cfg.kv_heads)
