"""The greedy pick over a vocabulary's logits, XLA's argmax against shardq's kernel
(model.native_argmax): what batch-1 greedy decoding pays per token to choose it
(`experiments.bench_decode` records it beside the decoding speeds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.speed.gc_pause import timed_call
from model import native_argmax

PICKS = 64  # picks per timed call, each waiting for the one before


def pick_check(vocab: int, repeats: int) -> dict:
    """Median µs per pick of [1, vocab] random logits, each form timed in turn: a jitted loop of
    `PICKS` picks, each pick's input shifted by the one before (one elementwise pass over the
    logits, in both forms, as a step's head writes them) so that none runs ahead."""
    logits = jax.random.normal(jax.random.key(0), (1, vocab), jnp.float32)

    def loop(pick):
        @jax.jit
        def fn(x):
            def body(_, p):
                return pick(x + p[0].astype(jnp.float32) * 1e-30)
            return jax.lax.fori_loop(0, PICKS, body, jnp.zeros((1,), jnp.int32))
        return fn

    forms = {"xla_argmax": loop(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))}
    if native_argmax.status()["available"]:
        forms["shardq_kernel"] = loop(native_argmax.argmax)
    picked = {name: int(fn(logits)[0]) for name, fn in forms.items()}
    times: dict[str, list[float]] = {k: [] for k in forms}
    for _ in range(repeats):
        for name, fn in forms.items():
            times[name].append(timed_call(fn, logits)[1])
    return {"vocab": vocab, "picks_per_call": PICKS, "same_pick": len(set(picked.values())) == 1,
            "us_per_pick": {k: 1e6 * float(np.median(v)) / PICKS for k, v in times.items()}}
