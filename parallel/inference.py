"""Running a model whose parameters are stored sharded (ZeRO-3 layout) for inference.

Left to itself, XLA partitions the computation of sharded weights (each device multiplies by its
slice and the partial results are all-reduced), which sums in another order than one device
does: float results move in the last bits, and an int8 model's activation rounding can flip.
ZeRO-3 instead gathers each layer's parameters right before the layer runs and releases them
after: every device computes with whole weights on its share of the batch, exactly as one device
would. `gathered_runner` does that inside the layer scan; `gather_all_but_layers` does it for
the few parameters outside the stack (embedding, final norm, head).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from model.layer_stack import Runner, scan_layers


def _replicated(tree, mesh):
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: rep, tree))


def gathered_runner(mesh) -> Runner:
    """A runner (model/layer_stack.py) that all-gathers each layer's shards inside the scan,
    right before the layer runs; nothing gathered outlives its iteration."""

    def runner(run_layer, stacked, x, aux):
        return scan_layers(lambda p, x, aux: run_layer(_replicated(p, mesh), x, aux),
                           stacked, x, aux)

    return runner


def gather_all_but_layers(params: dict, mesh, layers_key: str = "blocks") -> dict:
    """The parameters outside the layer stack, gathered; the stack left sharded (inside jit)."""
    return {k: (v if k == layers_key else _replicated(v, mesh)) for k, v in params.items()}


def mesh_of(params):
    """The mesh a pytree of arrays is sharded over, or None (single device / unsharded)."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None
