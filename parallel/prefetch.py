"""ZeRO-3 with prefetch: layer i+1's all-gather is issued before layer i computes.

The plain zero3 hook gathers a layer inside the scan body, right before its compute, so the
gather and the compute of one layer are serialised. Here the layer loop is written by hand as a
`custom_vjp`:

  forward   carry (x, layer i's gathered params); body: start gathering layer i+1, run layer i.
            Only each layer's input activation is saved for the backward pass.
  backward  carry (dx, layer i's gathered params); body: start gathering layer i-1, recompute
            layer i from its saved input, take its vjp, reduce-scatter the weight gradient.

The last layer of each pass has nothing left to prefetch, so it is peeled out of the loop (no
conditional collective, and the compiled program's collective count is exact). At most two
layers' gathered parameters are live at any time, and the collectives are zero3's: one all-gather
per layer in each direction and one reduce-scatter of each layer's gradient.

Meant for deep stacks. With 3 layers or fewer the loops are a single trip or none, XLA inlines
them, and (seen on XLA:CPU) merges a backward re-gather with the identical forward gather,
keeping that layer's weights alive in between; from 4 layers on the compiled program gathers
every layer once in each direction (experiments/comm_volume.py measures it).
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


def _at(inputs, i):
    """Layer i's input from the scan's stacked inputs (an array, or a tuple such as Gemma 3's
    activations with their layer counter)."""
    return jax.tree.map(lambda a: a[i], inputs)


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
                nxt = gather(_layer(stacked, i + 1))  # in flight while layer i computes
                return (run_layer(current, x, positions), nxt), x

            (x_last, last), inputs = lax.scan(body, (x, gather(_layer(stacked, 0))),
                                              jnp.arange(n - 1))
            y = run_layer(last, x_last, positions)
            return y, (stacked, inputs, x_last)

        def layer_grads(params, x, dy):
            _, vjp = jax.vjp(lambda p, h: run_layer(p, h, positions), params, x)
            dparams, dx = vjp(dy)
            return scatter(dparams), dx

        def backward(res, dy):
            stacked, inputs, x_last = res
            if n == 1:
                d_only, dx = layer_grads(gather(_layer(stacked, 0)), x_last, dy)
                return jax.tree.map(lambda g: g[None], d_only), dx
            prefetched = gather(_layer(stacked, n - 2))  # in flight while the last layer runs
            d_last, dx = layer_grads(gather(_layer(stacked, n - 1)), x_last, dy)

            def body(carry, i):
                dx, current = carry
                prev = gather(_layer(stacked, i - 1))  # in flight while layer i recomputes
                dshard, dx = layer_grads(current, _at(inputs, i), dx)
                return (dx, prev), dshard

            (dx, first), dshards = lax.scan(body, (dx, prefetched), jnp.arange(n - 2, 0, -1))
            d_first, dx = layer_grads(first, _at(inputs, 0), dx)
            # dshards holds layers n-2 .. 1; assemble 0 .. n-1.
            grads = jax.tree.map(
                lambda f, mid, last: jnp.concatenate([f[None], jnp.flip(mid, 0), last[None]]),
                d_first, dshards, d_last)
            return grads, dx

        stack.defvjp(forward, backward)
        return stack(stacked, x)

    return runner
