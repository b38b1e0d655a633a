"""What the quant tests share: the tiny float model, its calibration batches, and its logits.

Built once per process (each test module's fixtures hand out the same objects; tests copy
before they change a tree)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from model import DecoderLM
from tests.helpers import TINY, synthetic_batches

CFG = TINY.model
BLOCKS = ("blocks/*",)  # the blocks' Dense layers alone (the default rules add the embedding)


@functools.cache
def tiny_float_model():
    """(graphdef, params as host arrays) of the tiny model, seed 0."""
    graphdef, state = nnx.split(DecoderLM(CFG, rngs=nnx.Rngs(0)))
    return graphdef, jax.device_get(nnx.to_pure_dict(state))


@functools.cache
def calibration_batches():
    """Three calibration batches and a held-out one (the last), [4, max_len + 1] tokens each."""
    return [b[0] for b in synthetic_batches(4, 1, 4, CFG.max_len, seed=1)]


def logits(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(jnp.asarray(tokens))
