"""Next-token cross-entropy, summed (callers divide by the global token count)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_SCOPE = "nll_loss"  # labels the loss in the compiled program (for a profile's breakdown)


def nll_sum(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    with jax.named_scope(LOSS_SCOPE):
        logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1).sum()
