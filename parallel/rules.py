"""The one table from logical axis names (spoken by `model/`) to mesh axes.

Mesh axes: `data` (replicate parameters, split the batch) and `fsdp` (split the batch *and*
shard whatever the strategy shards). Every parameter of the models has an `embed` dimension,
so sharding `embed` over `fsdp` shards every parameter.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")  # the batch is split over every device

# Where a parameter-like leaf (params, grads, optimizer moments) is split when it is sharded.
SHARDED_RULES: dict[str, str | None] = {
    "embed": "fsdp",
    "layers": None,
    "vocab": None,
    "heads": None,
    "kv_heads": None,  # key/value output columns (fewer than heads under grouped-query attention)
    "mlp": None,
}


def _mapped(logical_axes: P, rules: dict[str, str | None]) -> P:
    return P(*(rules.get(a) if a else None for a in logical_axes))


def spec_for(logical_axes: P, sharded: bool) -> P:
    """PartitionSpec of one leaf: replicated, or with its logical axes mapped through the rules."""
    return _mapped(logical_axes, SHARDED_RULES) if sharded else P()


def sharded_dim(logical_axes: P) -> int | None:
    """Index of the dimension that `fsdp` shards, or None if the leaf stays whole."""
    for i, a in enumerate(logical_axes):
        if a and SHARDED_RULES.get(a) == "fsdp":
            return i
    return None


# Batch-1 decoding split over devices by output features (parallel/decode_split.py): each device
# holds part of the MLP's hidden features and of the vocabulary (the output head). Attention stays
# whole on every device: its head counts need not divide the device count.
DECODE_SPLIT_RULES: dict[str, str] = {"mlp": "fsdp", "vocab": "fsdp"}


def decode_split_spec(logical_axes: P) -> P:
    """PartitionSpec of one parameter under DECODE_SPLIT_RULES (other axes whole)."""
    return _mapped(logical_axes, DECODE_SPLIT_RULES)
