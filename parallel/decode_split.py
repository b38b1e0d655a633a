"""Batch-1 decoding with each step split over the CPU's cores as devices.

A one-token step is a chain of matrix-vector products. Here every device holds a slice of each
MLP kernel and of the output head (by output features, `parallel.rules.DECODE_SPLIT_RULES`) and
multiplies only its slice; XLA inserts the exchanges of the few-KB activations between them (an
all-reduce after each MLP's down projection and the head's logits). The weights each device
reads per token shrink with the device count; what each step pays on top is those exchanges,
and whether it gains depends on how busy one device already keeps the cores
(`experiments.bench_decode` times both).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding

from parallel.mesh import make_mesh
from parallel.rules import decode_split_spec
from parallel.state import logical_specs


def split_params(graphdef, params, n_devices: int):
    """`params` (a pure dict of the model `graphdef` describes) placed on the first `n_devices`
    devices, split by DECODE_SPLIT_RULES; a jitted decode of them then runs split."""
    mesh = make_mesh(n_devices)
    specs = logical_specs(nnx.state(nnx.merge(graphdef, params)))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, decode_split_spec(spec)), specs,
                             is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return jax.device_put(params, shardings)
