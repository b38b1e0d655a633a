"""Decoder-only transformer language model (pre-norm, RMSNorm, rotary attention, GELU MLP).

The Llama family's options are config fields of the same class: grouped-query attention
(`n_kv_heads`), a gated SwiGLU MLP (`mlp="swiglu"`), a head tied to the input embedding
(`tie_embeddings`), `rope_base` and `norm_eps` (see `model.config.MODEL_PRESETS["smollm2"]`).
Other families are fields too: Mistral's `sliding_window`, Qwen2's `qkv_bias`, Qwen3's
`qk_norm` and `head_size` (model/hf_decoder.py reads them from a Hugging Face config).

The blocks are created with `nnx.vmap`, so every block parameter is stacked on a leading
`layers` axis, and a runner (model/layer_stack.py; by default one `lax.scan`) runs them. A
caller may pass its own runner: `parallel/` gathers each layer's shards right before it runs
(ZeRO-3) without this file knowing about meshes. `decode` runs with a KV cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.cached_attention import blocked_cached_attention, padded_length
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.layer_stack import Runner, default_runner
from model.layers import (
    Dense,
    Embed,
    RMSNorm,
    causal_attention,
    dtype_of,
    fused_causal_attention,
    rotary,
)

# Name scopes that label the compiled program's operations (a profile groups its time by them:
# experiments/speed/step_profile.py). They change no computation.
ATTENTION_SCOPE = "attention_core"  # scores, mask, softmax, weighted sum: no projection


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
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
            norm = dict(eps=cfg.norm_eps, param_dtype=cfg.param_dtype, axes=("head_dim",))
            self.q_norm = RMSNorm(cfg.head_dim, **norm)
            self.k_norm = RMSNorm(cfg.head_dim, **norm)

    def __call__(self, x_BxTxD, positions_BxT, cache=None, cache_index=None):
        cfg = self.cfg
        B, T, _ = x_BxTxD.shape
        split = lambda y: y.reshape(B, T, -1, cfg.head_dim)
        q, k = split(self.q(x_BxTxD)), split(self.k(x_BxTxD))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary(q, positions_BxT, cfg.rope_base)
        k = rotary(k, positions_BxT, cfg.rope_base)
        v = split(self.v(x_BxTxD))
        window = cfg.sliding_window
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
                                               window=window)
        return self.o(out.reshape(B, T, cfg.q_dim)), new_cache


class Mlp(nnx.Module):
    """gelu: down(gelu(up x)); swiglu: down(silu(gate x) * up x), with a third Dense `gate`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = dict(param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype)
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.gate = Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), rngs=rngs, **dt)
        self.up = Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), rngs=rngs, **dt)
        self.down = Dense(cfg.d_ff, cfg.d_model, axes=("mlp", "embed"), rngs=rngs,
                          init_scale=(2 * cfg.n_layers) ** -0.5, **dt)

    def __call__(self, x):
        if self.kind == "swiglu":
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.mlp = Mlp(cfg, rngs=rngs)

    def __call__(self, x, positions, cache=None, cache_index=None):
        h, new_cache = self.attn(self.attn_norm(x), positions, cache, cache_index)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), new_cache


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
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        if not cfg.tie_embeddings:  # tied: the embedding table is the head (`Embed.attend`)
            self.head = Dense(cfg.d_model, cfg.vocab_size, axes=("embed", "vocab"), rngs=rngs,
                              param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype)

    def logits(self, x_BxTxD: jax.Array) -> jax.Array:
        """fp32 logits from the last block's output: final norm, then the head (or the tied
        embedding)."""
        h = self.final_norm(x_BxTxD)
        out = self.embed.attend(h) if self.cfg.tie_embeddings else self.head(h)
        return out.astype(jnp.float32)

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

        def run_layer(layer_params, x, positions):
            return nnx.merge(block_def, layer_params)(x, positions)[0]

        runner = runner or default_runner(cfg.remat, cfg.scan_unroll)
        x = runner(run_layer, stacked, self.embed(tokens_BxT), positions_BxT)
        return self.logits(x)

    def decode(self, tokens_BxT: jax.Array, cache: KVCache | list,
               cache_index: jax.Array | int,
               layers: list | None = None) -> tuple[jax.Array, KVCache | list]:
        """(logits [B, T, vocab] fp32, updated cache) for tokens at positions cache_index + t.

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
        x = self.embed(tokens_BxT)
        if layers is not None:
            new_cache = []
            for layer_params, layer_cache in zip(layers, cache, strict=True):
                x, c = nnx.merge(block_def, layer_params)(x, positions_BxT, layer_cache,
                                                          cache_index)
                new_cache.append(c)
            return self.logits(x), new_cache

        def layer(x, xs):
            layer_params, layer_cache = xs
            return nnx.merge(block_def, layer_params)(x, positions_BxT, layer_cache, cache_index)

        x, cache = jax.lax.scan(layer, x, (stacked, cache))
        return self.logits(x), cache

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
        shape = (cfg.n_layers, batch, length, cfg.kv_heads, cfg.head_dim)
        dt = dtype or dtype_of(cfg.compute_dtype)
        return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))
