"""The implementations the training-speed changes replaced, kept to measure each change paired.

`undone(names)` puts the named changes' earlier implementations back while a step is built
and compiled (jit traces on the first call, so the compiled program keeps them afterwards);
`experiments.speed.training.ablate` times the current step against each change undone, in one
process, interleaved. Nothing outside that measurement uses this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

import model.layers
import model.transformer


@dataclasses.dataclass(frozen=True)
class Change:
    name: str
    what: str  # one line: what the change does
    patches: tuple[tuple[object, str, Callable], ...]  # (module, attribute, earlier version)


def _dot_any_rank(x, w):
    return jnp.dot(x, w)


def _xla_attention(q, k, v, window=None):
    """jax.nn.dot_product_attention in the call model.transformer makes of causal_attention
    (a sliding `window` as its local window: the key t - window + 1 is the first one seen)."""
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local)


def _autodiff_attention_blocks(q, k, v, group, block):
    """model.layers' [B, K, T * G, H] block attention with the backward JAX derives from its
    forward."""
    return model.layers._blocks_forward(q, k, v, group, block)[0]


def _one_block(length):
    return length


CHANGES: dict[str, Change] = {c.name: c for c in (
    Change("dense_2d", "Dense multiplies [tokens, in] @ [in, out]: one contracting axis in the "
           "weight gradient, no transposed copy of the output gradient",
           ((model.layers, "matmul_2d", _dot_any_rank),)),
    Change("attention_bnth", "attention as batched matmuls over [batch, heads] (heads moved "
           "once) instead of jax.nn.dot_product_attention's BTNH einsums (undone, the written-out "
           "backward below goes too: it is written for this form)",
           ((model.transformer, "causal_attention", _xla_attention),)),
    Change("attention_backward", "attention's backward written out: the softmax row sum from "
           "dO * O ([T, H]) instead of dP * P ([T, S]), the scale on dQ and dK, no pass for the "
           "mask",
           ((model.layers, "_attention_blocks", _autodiff_attention_blocks),)),
    Change("attention_blocks", "causal attention in query blocks that skip the key blocks "
           "above the diagonal (masked to nothing) instead of one [T, S] block per sequence",
           ((model.layers, "attention_block", _one_block),)),
)}


@contextlib.contextmanager
def undone(names: tuple[str, ...] | list[str]):
    """The named changes' earlier implementations in place for the duration."""
    saved = []
    try:
        for name in names:
            for module, attr, earlier in CHANGES[name].patches:
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, earlier)
        yield
    finally:
        for module, attr, current in reversed(saved):
            setattr(module, attr, current)
