"""shardq's log-sum-exp of each row of logits on the CPU (`native/log_sum_exp.cc`), through
XLA's FFI: `jax.nn.logsumexp` along the last axis, to float32 rounding.

Scoring a window normalises every position's logits over the whole vocabulary; XLA:CPU's exp
runs those tens of thousands of exponentials per position far below sixteen-lane arithmetic,
and the normalisation becomes a large share of a scoring forward.
`experiments.pretrained.scoring.make_score_fn` uses it. It has no gradient (scoring only).

Built like `model.native_float` (`model.native_build`); `SHARDQ_LOGSUMEXP_KERNEL=off` turns it
off (XLA's logsumexp then runs).
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp

from model import native_build

SOURCE = pathlib.Path(__file__).with_name("native") / "log_sum_exp.cc"
TARGET = "shardq_log_sum_exp"
ENV_SWITCH = "SHARDQ_LOGSUMEXP_KERNEL"


@functools.cache
def status() -> dict:
    """{"available": bool, "library": path, "reason": why not}; builds and registers the
    kernel on the first call."""
    return native_build.load(SOURCE, {TARGET: "ShardqLogSumExp"}, ENV_SWITCH)[1]


def xla_logsumexp(x: jax.Array) -> jax.Array:
    """XLA's log-sum-exp along the last axis, in float32 (what `logsumexp` gives off the CPU)."""
    return jax.nn.logsumexp(x.astype(jnp.float32), axis=-1)


def logsumexp(x: jax.Array) -> jax.Array:
    """float32 log(sum(exp(x))) along x's last axis: shardq's kernel on a CPU where it builds
    and x is float32 or narrower, XLA's elsewhere."""
    return native_build.last_axis_call(TARGET, x, jnp.float32, xla_logsumexp, status())
