"""ZeRO-3 with prefetch: layer i+1's all-gather is issued before layer i computes.

The plain zero3 hook gathers a layer inside the scan body, right before its compute, so the
gather and the compute of one layer are serialised. Here the layer loop is written by hand as a
`custom_vjp`:

  forward   carry (x, params of layer i, gathered); body: start gathering layer i+1, run layer i.
            Only each layer's input activation is saved for the backward pass.
  backward  carry (dx, params of layer i, gathered); body: start gathering layer i-1, recompute
            layer i from its saved input, take its vjp, reduce-scatter the weight gradient.

At most two layers' gathered parameters are live at any time (the current and the next), and
the collectives are the same as zero3's: an all-gather per layer in each direction and one
reduce-scatter of each layer's gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

Gather = Callable[[nnx.State], nnx.State]


def _layer(stacked: nnx.State, i) -> nnx.State:
    return jax.tree.map(lambda v: lax.dynamic_index_in_dim(v, i, keepdims=False), stacked)


def _gather_if(pred, gather: Gather, stacked: nnx.State, i, otherwise: nnx.State) -> nnx.State:
    """Gather layer i when pred holds; the last prefetch of a pass has nothing to fetch and
    hands back `otherwise` (already-gathered weights: no communication, same types)."""
    return lax.cond(pred, lambda: gather(_layer(stacked, i)), lambda: otherwise)


def prefetching_runner(gather: Gather, scatter: Gather):
    """A `layer_runner` for DecoderLM: gather(shards) -> full layer, scatter(full grad) -> shard."""

    def runner(run_layer, stacked: nnx.State, x: jax.Array, positions: jax.Array) -> jax.Array:
        n = jax.tree.leaves(stacked)[0].shape[0]

        @jax.custom_vjp
        def stack(stacked, x):
            return forward(stacked, x)[0]

        def forward(stacked, x):
            def body(carry, i):
                x, current = carry
                # issued before this layer's compute, so the two can overlap
                nxt = _gather_if(i + 1 < n, gather, stacked, i + 1, current)
                return (run_layer(current, x, positions), nxt), x

            first = gather(_layer(stacked, 0))
            (y, _), inputs = lax.scan(body, (x, first), jnp.arange(n))
            return y, (stacked, inputs)

        def backward(res, dy):
            stacked, inputs = res

            def body(carry, i):
                dx, current = carry
                prev = _gather_if(i > 0, gather, stacked, i - 1, current)  # before the recompute
                _, vjp = jax.vjp(lambda p, h: run_layer(p, h, positions), current, inputs[i])
                dparams, dx = vjp(dx)
                return (dx, prev), scatter(dparams)

            last = gather(_layer(stacked, n - 1))
            (dx, _), dshards = lax.scan(body, (dy, last), jnp.arange(n - 1, -1, -1))
            return jax.tree.map(lambda g: jnp.flip(g, axis=0), dshards), dx

        stack.defvjp(forward, backward)
        return stack(stacked, x)

    return runner
