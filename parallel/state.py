"""Sharded train state built abstractly: eval_shape -> shardings -> jitted init.

No device ever holds the whole model unless the strategy replicates it. The state is a plain
dict pytree (what Orbax saves):
  {"params": working params (model param dtype),
   "opt": {"adam": optax state, "master": fp32 params (mixed precision only)},
   "step": int32}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model import DecoderLM, ModelConfig
from parallel.rules import spec_for
from parallel.strategies import Strategy


def is_mixed(cfg: ModelConfig) -> bool:
    return cfg.param_dtype != "float32"


def logical_specs(state: nnx.State) -> dict:
    """Pure dict of PartitionSpecs holding each parameter's *logical* axis names."""
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = P(*var.get_metadata()["out_sharding"])
    return out


def abstract_model(cfg: ModelConfig):
    """(graphdef, logical specs, abstract pure params) without allocating anything."""
    model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return graphdef, logical_specs(state), nnx.to_pure_dict(state)


def init_params(cfg: ModelConfig, seed: int) -> dict:
    return nnx.to_pure_dict(nnx.state(DecoderLM(cfg, rngs=nnx.Rngs(seed))))


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int) -> dict:
    return state_from_params(cfg, tx, init_params(cfg, seed))


def state_from_params(cfg: ModelConfig, tx: optax.GradientTransformation, params: dict) -> dict:
    """Training state around given parameters (fresh or pretrained): working copies in the
    param dtype, fp32 master weights when mixed, fresh optimizer moments, step 0."""
    # The master copy comes from the given values before any cast: pretrained fp32 weights
    # keep their precision there when the working copy is bf16.
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params) if is_mixed(cfg) else None
    params = jax.tree.map(lambda p: p.astype(jnp.dtype(cfg.param_dtype)), params)
    opt = {"adam": tx.init(master if master is not None else params)}
    if master is not None:
        opt["master"] = master
    return {"params": params, "opt": opt, "step": jnp.zeros((), jnp.int32)}


def logical_shardings(axes, mesh: Mesh, sharded: bool):
    """The one map from logical axes (a tree of PartitionSpecs of logical names, as
    `logical_specs` returns) to NamedShardings: through the rules table when `sharded`,
    replicated otherwise."""
    return jax.tree.map(lambda a: NamedSharding(mesh, spec_for(a, sharded)), axes,
                        is_leaf=lambda x: isinstance(x, P))


def place_params(params: dict, axes: dict, mesh: Mesh, strategy: Strategy) -> dict:
    """Params on a mesh: sharded by their logical axes where the strategy shards parameters,
    replicated otherwise (clear error if a sharded dimension does not divide)."""
    check_divisible(params, axes, mesh, strategy)
    return jax.device_put(params, logical_shardings(axes, mesh, strategy.shards_params))


def place_model_params(graphdef: nnx.GraphDef, params: dict, mesh: Mesh,
                       strategy: Strategy) -> dict:
    """`place_params` for the params of the model `graphdef` describes: their logical axes are
    read from the model's own parameter metadata."""
    axes = logical_specs(nnx.state(nnx.merge(graphdef, params)))
    return place_params(params, axes, mesh, strategy)


def state_specs(abstract_state: dict, axes: dict, strategy: Strategy,
                tx: optax.GradientTransformation) -> dict:
    """PartitionSpec tree matching the state, from the logical axes and the strategy."""
    param_specs = jax.tree.map(lambda a: spec_for(a, strategy.shards_params), axes)
    opt_param_specs = jax.tree.map(lambda a: spec_for(a, strategy.shards_optimizer), axes)
    opt = {"adam": optax.tree_map_params(
        tx, lambda _, spec: spec, abstract_state["opt"]["adam"], opt_param_specs,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))}
    if "master" in abstract_state["opt"]:
        opt["master"] = opt_param_specs
    return {"params": param_specs, "opt": opt, "step": P()}


def to_shardings(specs, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def check_divisible(abstract_params: dict, axes: dict, mesh: Mesh, strategy: Strategy) -> None:
    """Every sharded dimension must split evenly over the fsdp axis (clear error otherwise)."""
    if not strategy.shards_optimizer:
        return
    n = mesh.shape["fsdp"]
    flat_axes = dict(jax.tree_util.tree_flatten_with_path(axes)[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        spec = spec_for(flat_axes[path], True)
        for dim, mesh_axis in zip(leaf.shape, spec, strict=False):
            if mesh_axis == "fsdp" and dim % n:
                name = jax.tree_util.keystr(path)
                raise ValueError(f"mesh: parameter {name} dimension {dim} does not divide over "
                                 f"fsdp={n}; choose an fsdp size that divides {dim}")
