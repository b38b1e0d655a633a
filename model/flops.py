"""Exact parameter count, bytes as stored, and training FLOPs per token of `DecoderLM`."""

from __future__ import annotations

import jax

from model.config import ModelConfig


def _block_matmul_params(cfg: ModelConfig) -> int:
    d, f, q = cfg.d_model, cfg.d_ff, cfg.q_dim
    kv = cfg.kv_heads * cfg.head_dim  # k and v outputs (q's width without grouped-query attention)
    attn = 2 * d * q + 2 * d * kv  # q, o + k, v
    mlp = (2 if cfg.mlp == "gelu" else 3) * d * f  # (gate,) up, down: swiglu and geglu are gated
    return attn + mlp


def _block_other_params(cfg: ModelConfig) -> int:
    """Norm scales and biases of one block: two norms (four with Gemma's post-norms), q/k
    norms of one head's width, q/k/v biases."""
    norms = (4 if cfg.post_norms else 2) * cfg.d_model
    qk_norms = 2 * cfg.head_dim if cfg.qk_norm else 0
    biases = cfg.q_dim + 2 * cfg.kv_heads * cfg.head_dim if cfg.qkv_bias else 0
    return norms + qk_norms + biases


def param_count(cfg: ModelConfig) -> int:
    d, V, L = cfg.d_model, cfg.vocab_size, cfg.n_layers
    per_layer = _block_matmul_params(cfg) + _block_other_params(cfg)
    head = 0 if cfg.tie_embeddings else d * V
    return L * per_layer + V * d + head + d  # + embedding, head, final norm


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (the embedding lookup is a gather; a tied
    head still multiplies by the whole table)."""
    return cfg.n_layers * _block_matmul_params(cfg) + cfg.d_model * cfg.vocab_size


def param_bytes(tree) -> int:
    """Bytes of every array (or ShapeDtypeStruct) in a pytree, as stored: scales included."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def train_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Forward+backward FLOPs per token: 6 per matmul parameter, plus causal attention.

    Attention scores and the weighted sum cost 2·T·q multiply-adds per token and layer for the
    full square (q: the queries' width, heads × head size; d_model in most models); causality
    halves the useful part, so we count 6·L·T·q (PaLM appendix B counts the full square,
    12·L·T·d; we count only the causal half that is actually needed; a sliding window's
    savings are not counted). Rematerial-
    isation is not counted: this is model FLOPs, the numerator of MFU.
    """
    T = seq_len or cfg.max_len
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.n_layers * T * cfg.q_dim
