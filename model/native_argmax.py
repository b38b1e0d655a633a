"""shardq's greedy pick on the CPU (`native/greedy_pick.cc`), through XLA's FFI: the index of
each row's largest logit, as `jnp.argmax` gives it (the first of equal maxima; a row's first
NaN where it holds one).

Greedy decoding picks a token from the vocabulary-wide logits at every step, and XLA:CPU runs
argmax as a (value, index) reduction one element at a time; this call compares sixteen lanes
at a time. `model.generate.sample_token` picks greedy tokens here on a CPU.

Built like `model.native_float` (`model.native_build`); `SHARDQ_ARGMAX_KERNEL=off` turns it
off (XLA's argmax then runs).
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp

from model import native_build

SOURCE = pathlib.Path(__file__).with_name("native") / "greedy_pick.cc"
TARGET = "shardq_greedy_pick"
ENV_SWITCH = "SHARDQ_ARGMAX_KERNEL"


@functools.cache
def status() -> dict:
    """{"available": bool, "library": path, "reason": why not}; builds and registers the
    kernel on the first call."""
    return native_build.load(SOURCE, {TARGET: "ShardqGreedyPick"}, ENV_SWITCH)[1]


def xla_argmax(x: jax.Array) -> jax.Array:
    """XLA's argmax along the last axis, as an int32 index (what `argmax` gives off the CPU)."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def argmax(x: jax.Array) -> jax.Array:
    """int32 index of the largest entry along x's last axis (`jnp.argmax`'s): shardq's kernel
    on a CPU where it builds and x is float32 or narrower, XLA's argmax elsewhere."""
    return native_build.last_axis_call(TARGET, x, jnp.int32, xla_argmax, status())
