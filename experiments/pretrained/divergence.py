"""How far a model's next-token predictions lie from a reference model's at the same positions
(an int8 model against its float one): KL(reference || model) per position, and whether both
put the same token first. A perplexity change sums per-token changes of both signs, which can
cancel; these cannot. Summarised with the statistics llama.cpp's `perplexity --kl-divergence`
reports. Used by the pretrained LM's perplexity (`experiments.pretrained.scoring`) and the byte
model's int8 table (`experiments.quant_table`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from parallel.rules import BATCH_AXES


def per_position(ref_logp: jax.Array, logp: jax.Array) -> tuple[jax.Array, jax.Array]:
    """KL(reference || model) in nats, and whether the most likely token is the same, at each
    position of two log-probability arrays [..., vocab] (float32)."""
    kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
    return kl, jnp.argmax(ref_logp, axis=-1) == jnp.argmax(logp, axis=-1)


def summary(kl: np.ndarray, same_top1: np.ndarray, reference: str) -> dict:
    """The KL's mean, median, 99th percentile and largest, and the share of positions whose
    most likely next token is the reference's (the token greedy decoding follows)."""
    kl = np.asarray(kl, np.float64).ravel()
    return {"reference": reference, "kl_mean": float(np.mean(kl)),
            "kl_median": float(np.median(kl)), "kl_p99": float(np.percentile(kl, 99)),
            "kl_max": float(np.max(kl)), "top1_agree": float(np.mean(same_top1))}


def make_batch_divergence_fn(graphdef: nnx.GraphDef, ref_graphdef: nnx.GraphDef,
                             mesh: jax.sharding.Mesh, val: list):
    """(params, ref_params) -> `summary` over every next-token position of the validation
    batches `val` ([B, T + 1] token rows each, as `experiments.training.trainer.make_eval_fn` reads
    them, the batch split over the mesh's data axes). One process: the per-position values
    are brought to the host."""
    sharding = NamedSharding(mesh, P(BATCH_AXES))

    @jax.jit
    def fn(params, ref_params, tokens):
        inputs = tokens[:, :-1]
        logp = jax.nn.log_softmax(nnx.merge(graphdef, params)(inputs).astype(jnp.float32))
        ref_logp = jax.nn.log_softmax(
            nnx.merge(ref_graphdef, ref_params)(inputs).astype(jnp.float32))
        return per_position(ref_logp, logp)

    def evaluate(params, ref_params, reference: str = "none") -> dict:
        if jax.process_count() > 1:
            raise RuntimeError("make_batch_divergence_fn: one process only")
        kls, same = [], []
        for rows in val:
            kl, top1 = fn(params, ref_params, jax.device_put(rows, sharding))
            kls.append(np.asarray(kl, np.float64).ravel())
            same.append(np.asarray(top1).ravel())
        return summary(np.concatenate(kls), np.concatenate(same), reference)

    return evaluate
