"""One jitted training step per strategy, with the collectives written out by hand.

dp/zero1/zero2/zero3 run under `jax.shard_map`: every device sees its local batch rows and its
local view of the state, and each reduction or gather is an explicit `lax` collective, so the
mechanism can be read here and counted in the compiled program. zero3_auto is the same state
layout left to the compiler (plain jit + sharding annotations).

The loss is the mean next-token NLL over the global batch; gradients are accumulated over
`micro_steps` micro-batches inside the step.

zero2 keeps whole parameters on every device but never the whole gradient: the step
differentiates with respect to this device's shards, and each layer's whole parameters enter
the layer through `attach_whole`, an identity whose backward reduce-scatters the layer's
gradient inside the backward layer scan, as the layer produces it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model import ModelConfig
from model.layer_stack import REMAT_POLICIES, Runner, scan_layers
from model.layers import dtype_of
from model.loss import nll_sum
from parallel.prefetch import prefetching_runner
from parallel.rules import BATCH_AXES, sharded_dim
from parallel.state import state_specs, to_shardings
from parallel.strategies import ALL_REDUCE, SCATTER_PER_MICRO, SCATTER_PER_STEP, Strategy

FSDP = "fsdp"
GATHERED = "gathered_layer_params"  # checkpoint name of a layer's params after its all-gather
# Labels clipping, the optimizer update and the update guard in the compiled program (a profile
# groups its time by name scope: experiments/speed/step_profile.py); it changes no computation.
UPDATE_SCOPE = "optimizer_update"


@dataclasses.dataclass(frozen=True)
class StepConfig:
    global_batch: int
    seq_len: int
    micro_steps: int = 1
    clip_norm: float = 1.0


def batch_spec() -> P:
    """Batch arrays are [micro_steps, global_batch, seq_len + 1], rows split over every device."""
    return P(None, BATCH_AXES)


def _gather_dims(axes: dict) -> dict:
    """For each leaf, the dimension sharded over fsdp (or None)."""
    return jax.tree.map(sharded_dim, axes, is_leaf=lambda x: isinstance(x, P))


def _gather(x, dim, dtype):
    """All-gather one parameter shard, in the compute dtype (the cast runs before the wire)."""
    if dim is None:
        return x.astype(dtype)
    return lax.all_gather(x.astype(dtype), FSDP, axis=dim, tiled=True)


def _per_layer_leaf(fn) -> Callable[[nnx.State], nnx.State]:
    """Apply fn(value, fsdp_dim) to every parameter of one layer's state.

    A leaf's metadata still names the stacked `layers` axis first; one layer's slice has lost
    that dimension, so the fsdp dimension is found among the remaining names.
    """

    def one(var: nnx.Variable):
        names = var.get_metadata()["out_sharding"][1:]
        return var.replace(fn(var[...], sharded_dim(P(*names))))

    return lambda layer_state: jax.tree.map(one, layer_state,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


# Primitives whose outputs are (views of) gathered or attached weights: cheap to redo, costly to
# keep (`custom_vjp_call` is zero2's `attach_whole`, the only custom_vjp inside a layer scan).
_GATHER_PRIMITIVES = frozenset({"all_gather", "pvary", "pcast", "custom_vjp_call"})


def _keep_all_but_gathered(prim, *_, **params) -> bool:
    """Remat policy for remat="none" under zero3: keep every activation, no gathered weight."""
    if prim.name in _GATHER_PRIMITIVES:
        return False
    return not (prim.name == "name" and params.get("name") == GATHERED)


def make_layer_gather(dtype) -> Callable[[nnx.State], nnx.State]:
    """One layer's shards -> its whole parameters, in the compute dtype."""
    return _per_layer_leaf(lambda x, d: _gather(x, d, dtype))


def _also_keep_gathered(policy):
    """`policy`, but every gathered layer is saved for the backward pass as well."""
    base = policy or (lambda *_, **__: True)
    return lambda prim, *args, **params: (
        (prim.name == "name" and params.get("name") == GATHERED) or base(prim, *args, **params))


def gathering_runner(gather: Callable[[nnx.State], nnx.State], model_cfg: ModelConfig,
                     keep_gathered: bool = False) -> Runner:
    """Gather-then-release: the model's layer scan, each layer's shards all-gathered inside the
    scan body right before the layer runs. The gathered weights are never kept for the backward
    pass (it gathers them again): "full" and "save_dots" keep no weights anyway, and under
    remat "none" every activation is kept except the gathered weights.

    `keep_gathered` builds the control the release check must catch: the same step, but every
    gathered layer is saved for the backward pass (no re-gather, one gathered layer per layer
    of depth kept alive)."""
    policy = REMAT_POLICIES[model_cfg.remat]
    policy = _also_keep_gathered(policy) if keep_gathered else policy or _keep_all_but_gathered

    def gathered(run_layer):
        def run(layer_params, x, aux):
            whole = jax.tree.map(lambda p: checkpoint_name(p, GATHERED), gather(layer_params))
            return run_layer(whole, x, aux)
        return run

    def runner(run_layer, stacked, x, aux):
        return scan_layers(gathered(run_layer), stacked, x, aux, policy=policy,
                           unroll=model_cfg.scan_unroll)

    return runner


def attach_whole(shard, whole, dim):
    """`whole` (this leaf's replicated parameter) as a value the layer computes with, with its
    gradient delivered to `shard` (this device's slice of it) reduce-scattered over fsdp.

    Forward it is the identity on `whole` (no communication); backward the whole-size
    cotangent is reduce-scattered right where it is produced, so only the shard outlives the
    layer. The gradient stays unreduced over `data` (summed once per step); a leaf without an
    fsdp dimension is summed over every device here."""

    @jax.custom_vjp
    def attach(shard, whole):
        return lax.pcast(whole, BATCH_AXES, to="varying")

    def fwd(shard, whole):
        return attach(shard, whole), None

    def bwd(_, g):
        if dim is None:
            return lax.psum(g, BATCH_AXES), None
        return lax.psum_scatter(g, FSDP, scatter_dimension=dim, tiled=True), None

    attach.defvjp(fwd, bwd)
    return attach(shard, whole)


def attaching_runner(whole_blocks, model_cfg: ModelConfig) -> Runner:
    """ZeRO-2's layer scan: the runner receives the blocks' shards (what is differentiated) and
    scans them beside the whole stacked blocks (`whole_blocks`, a pure dict, not
    differentiated); each layer computes with its whole weights through `attach_whole`."""
    # As under zero3, the backward pass redoes the (free) attach instead of saving its output:
    # a saved copy would stack every layer's whole weights again.
    policy = REMAT_POLICIES[model_cfg.remat] or _keep_all_but_gathered
    is_var = lambda x: isinstance(x, nnx.Variable)

    def attached(run_layer):
        def run(pair, x, aux):
            shards, whole = pair
            variables, treedef = jax.tree.flatten(shards, is_leaf=is_var)

            def one(var, w):
                dim = sharded_dim(P(*var.get_metadata()["out_sharding"][1:]))
                return var.replace(checkpoint_name(attach_whole(var[...], w, dim), GATHERED))

            layer = jax.tree.unflatten(treedef, [one(v, w) for v, w in
                                                 zip(variables, whole, strict=True)])
            return run_layer(layer, x, aux)
        return run

    def runner(run_layer, stacked, x, aux):
        # Both trees flatten in key order, so the i-th whole leaf is the i-th variable's.
        whole = jax.tree.leaves(whole_blocks)
        return scan_layers(attached(run_layer), (stacked, whole), x, aux, policy=policy,
                           unroll=model_cfg.scan_unroll)

    return runner


def _varies_over(x, axis: str) -> bool:
    """Whether shard_map's type system says x may differ across `axis` (not yet reduced)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # JAX 0.10; older releases call it `vma`
    return axis in (mat.varying if mat is not None else aval.vma)


def make_layer_scatter(dtype) -> Callable[[nnx.State], nnx.State]:
    """A whole layer's weight gradient -> this device's shard, summed over every device."""

    def scatter(g, d):
        g = lax.psum(g, FSDP) if d is None else lax.psum_scatter(g, FSDP, scatter_dimension=d,
                                                                  tiled=True)
        # Shards are replicated across `data`, so their gradient is summed over it. The vjp that
        # produced g already did so if the weights entered it typed as replicated over `data`.
        if _varies_over(g, "data"):
            g = lax.psum(g, "data")
        return g.astype(dtype)

    return _per_layer_leaf(scatter)


def _global_norm_sq(grads, dims, sharded: bool):
    """Squared global norm; shards are disjoint, so their partial sums add up over fsdp."""
    leaves, dim_leaves = jax.tree.leaves(grads), jax.tree.leaves(dims, is_leaf=lambda x: x is None)
    whole = sum((jnp.sum(jnp.square(g.astype(jnp.float32)))
                 for g, d in zip(leaves, dim_leaves, strict=True)
                 if not (sharded and d is not None)), jnp.zeros((), jnp.float32))
    if not sharded:
        return whole
    parts = sum((jnp.sum(jnp.square(g.astype(jnp.float32)))
                 for g, d in zip(leaves, dim_leaves, strict=True) if d is not None),
                jnp.zeros((), jnp.float32))
    return whole + lax.psum(parts, FSDP)


def _clip(grads, norm_sq, clip_norm):
    norm = jnp.sqrt(norm_sq)
    scale = jnp.minimum(1.0, clip_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads), norm


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a step builder reads: the model, the strategy and its state layout, the update."""
    graphdef: nnx.GraphDef
    axes: dict  # logical axis names of every parameter
    model_cfg: ModelConfig
    strategy: Strategy
    mesh: Mesh
    specs: dict  # PartitionSpec of every state leaf
    tx: optax.GradientTransformation
    step_cfg: StepConfig
    keep_gathered: bool = False  # the release check's control (see gathering_runner)

    @property
    def denom(self) -> int:
        """Tokens per step: the loss is a sum of per-token NLLs divided by this."""
        c = self.step_cfg
        return c.global_batch * c.seq_len * c.micro_steps


def make_train_step(graphdef, axes: dict, abstract_state: dict, model_cfg: ModelConfig,
                    strategy: Strategy, mesh: Mesh, tx: optax.GradientTransformation,
                    step_cfg: StepConfig, *, keep_gathered: bool = False):
    """Returns (jitted step(state, batch) -> (state, metrics), state shardings, batch sharding).

    `keep_gathered` (zero3 without prefetch only) builds the release check's control, never a
    training step: see `gathering_runner`."""
    if keep_gathered and not (strategy.gathers_layers and not strategy.prefetch):
        raise ValueError(f"keep_gathered=True: only for zero3 without prefetch, not "
                         f"{strategy.label!r}")
    specs = state_specs(abstract_state, axes, strategy, tx)
    shardings = to_shardings(specs, mesh)
    batch_sharding = NamedSharding(mesh, batch_spec())
    plan = StepPlan(graphdef, axes, model_cfg, strategy, mesh, specs, tx, step_cfg,
                    keep_gathered)
    fn = (_explicit_step if strategy.explicit else _auto_step)(plan)
    step = jax.jit(fn, in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=(0,))
    return step, shardings, batch_sharding


def _all_finite(tree) -> jax.Array:
    """Whether every element of tree is finite: one isfinite reduction per leaf, which XLA fuses
    with the update that produced it. Inside shard_map a leaf may be this device's shard, so the
    verdict is then agreed on (a min) over the mesh axes it varies over."""
    ok = jnp.ones((), jnp.int32)
    for x in jax.tree.leaves(tree):
        ok = jnp.minimum(ok, jnp.all(jnp.isfinite(x)).astype(jnp.int32))
    axes = tuple(a for a in BATCH_AXES if _varies_over(ok, a))
    return (lax.pmin(ok, axes) if axes else ok) > 0


def _finish(state, target, adam, params, mixed, metrics):
    """The updated state, or the previous one unchanged when the loss, the gradient norm or the
    updated parameters are not finite (a finite gradient times a huge learning rate can still
    overflow): a NaN or Inf never enters the parameters or optimizer state (nor, so, a
    checkpoint). The step counter moves on either way, so the data position stays exact."""
    opt = {"adam": adam}
    if mixed:
        opt["master"] = target
    params_finite = _all_finite(params)  # a non-finite master shows up in its cast too
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]) & params_finite
    keep = lambda new, old: jnp.where(finite, new, old)
    return {"params": jax.tree.map(keep, params, state["params"]),
            "opt": jax.tree.map(keep, opt, state["opt"]),
            "step": state["step"] + 1}, {**metrics, "finite": finite,
                                         "params_finite": params_finite}


def _is_dim(x) -> bool:
    return x is None or isinstance(x, int)


def _explicit_loss(plan: StepPlan, dims: dict):
    """loss(diff_params, params, tokens) as each strategy differentiates it: diff_params are
    what the gradient is taken with respect to (shards for zero2 and zero3, a device-varying
    copy of the whole parameters for dp and zero1); `params` are the step's parameters."""
    strategy, cfg = plan.strategy, plan.model_cfg
    cdt, pdt = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
    gather_runner = None
    if strategy.gathers_layers:
        gather = make_layer_gather(cdt)
        gather_runner = (prefetching_runner(gather, make_layer_scatter(pdt)) if strategy.prefetch
                         else gathering_runner(gather, cfg, plan.keep_gathered))

    def loss_fn(diff_params, params, tokens):
        runner = gather_runner
        if strategy.gathers_layers:  # the embedding, final norm and head are gathered whole
            diff_params = {k: v if k == "blocks" else jax.tree.map(
                lambda x, d: _gather(x, d, cdt), v, dims[k], is_leaf=None)
                for k, v in diff_params.items()}
        elif strategy.grad_reduce == SCATTER_PER_MICRO:  # zero2: shards carry whole weights
            runner = attaching_runner(params["blocks"], cfg)
            diff_params = {k: v if k == "blocks" else jax.tree.map(
                attach_whole, v, params[k], dims[k], is_leaf=_is_dim)
                for k, v in diff_params.items()}
        logits = nnx.merge(plan.graphdef, diff_params)(tokens[:, :-1], runner=runner)
        return nll_sum(logits, tokens[:, 1:]) / plan.denom

    return loss_fn


def _differentiated(strategy: Strategy, params, dims):
    """What each strategy differentiates (see `_explicit_loss`)."""
    if strategy.gathers_layers:
        # Autodiff transposes each all_gather into a psum_scatter: gradients arrive sharded.
        return params
    if strategy.grad_reduce == SCATTER_PER_MICRO:
        # This device's shards, typed as varying so their gradient may stay unreduced over
        # `data` until the step sums it; a leaf without an fsdp dimension is summed whole.
        return jax.tree.map(lambda p, d: p if d is None else _varying(_local_slice(p, d),
                                                                      BATCH_AXES),
                            params, dims, is_leaf=_is_dim)
    # A device-varying copy, so gradients stay local (unreduced) until reduced once per step.
    return lax.pcast(params, BATCH_AXES, to="varying")


def _reduce_step_grads(strategy: Strategy, grads, dims):
    """The accumulated gradient, summed over every device as the strategy's layout needs."""
    if strategy.grad_reduce == ALL_REDUCE:
        grads = lax.psum(grads, BATCH_AXES)
    elif strategy.grad_reduce == SCATTER_PER_STEP:
        grads = jax.tree.map(lambda g, d: lax.psum(g, BATCH_AXES) if d is None else
                             lax.psum_scatter(g, FSDP, scatter_dimension=d, tiled=True),
                             grads, dims, is_leaf=_is_dim)
    if strategy.updates_shards_of_replicas:  # shards are replicated across `data`
        grads = jax.tree.map(lambda g, d: g if d is None else lax.psum(g, "data"), grads, dims,
                             is_leaf=_is_dim)
    return grads


def _explicit_step(plan: StepPlan):
    strategy, cfg = plan.strategy, plan.model_cfg
    dims = _gather_dims(plan.axes)
    pdt = dtype_of(cfg.param_dtype)
    mixed = cfg.param_dtype != "float32"
    loss_fn = _explicit_loss(plan, dims)

    def local_step(state, batch):
        params = state["params"]
        diff_params = _differentiated(strategy, params, dims)

        def micro(carry, tokens):
            acc, loss_acc = carry
            loss, g = jax.value_and_grad(loss_fn)(diff_params, params, tokens)
            return (jax.tree.map(jnp.add, acc, g), loss_acc + loss), None

        # The accumulator has the gradient's shapes and device-variance: those of diff_params.
        acc0 = jax.tree.map(_zeros_varying_like, diff_params)
        (grads, loss), _ = lax.scan(micro, (acc0, lax.pcast(jnp.zeros((), jnp.float32),
                                                           BATCH_AXES, to="varying")), batch)
        loss = lax.psum(loss, BATCH_AXES)
        grads = _reduce_step_grads(strategy, grads, dims)
        with jax.named_scope(UPDATE_SCOPE):
            norm_sq = _global_norm_sq(grads, dims, strategy.shards_optimizer)
            grads, gnorm = _clip(grads, norm_sq, plan.step_cfg.clip_norm)

            if mixed:
                target = state["opt"]["master"]
            elif strategy.updates_shards_of_replicas:  # this device's slice of the whole params
                target = jax.tree.map(_local_slice, params, dims, is_leaf=_is_dim)
            else:
                target = params
            updates, adam = plan.tx.update(grads, state["opt"]["adam"], target)
            target = optax.apply_updates(target, updates)
            if strategy.updates_shards_of_replicas:  # re-assemble the whole parameters everywhere
                new_params = jax.tree.map(
                    lambda t, d: t.astype(pdt) if d is None else lax.all_gather(
                        t.astype(pdt), FSDP, axis=d, tiled=True, to="invarying"),
                    target, dims, is_leaf=_is_dim)
            else:
                new_params = jax.tree.map(lambda t: t.astype(pdt), target)
            return _finish(state, target, adam, new_params, mixed,
                           {"loss": loss, "grad_norm": gnorm})

    return jax.shard_map(local_step, mesh=plan.mesh, in_specs=(plan.specs, batch_spec()),
                         out_specs=(plan.specs, P()))


def _varying(x, axes):
    """x typed as varying over `axes` (those it already varies over are left as they are)."""
    missing = tuple(a for a in axes if not _varies_over(x, a))
    return lax.pcast(x, missing, to="varying") if missing else x


def _zeros_varying_like(x):
    """Zeros of x's shape and dtype, typed as varying over the mesh axes x varies over."""
    return _varying(jnp.zeros(x.shape, x.dtype),
                    tuple(a for a in BATCH_AXES if _varies_over(x, a)))


def _local_slice(x, dim):
    if dim is None:
        return x
    size = x.shape[dim] // lax.axis_size(FSDP)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(FSDP) * size, size, axis=dim)


def _auto_step(plan: StepPlan):
    """zero3_auto: global-view code; shardings are annotations, the compiler adds collectives."""
    mixed = plan.model_cfg.param_dtype != "float32"
    pdt = dtype_of(plan.model_cfg.param_dtype)
    grad_shardings = to_shardings(plan.specs["params"], plan.mesh)

    def loss_fn(params, tokens):
        return nll_sum(nnx.merge(plan.graphdef, params)(tokens[:, :-1]),
                       tokens[:, 1:]) / plan.denom

    def step(state, batch):
        params = state["params"]

        def micro(carry, tokens):
            acc, loss_acc = carry
            loss, g = jax.value_and_grad(loss_fn)(params, tokens)
            g = jax.lax.with_sharding_constraint(g, grad_shardings)
            return (jax.tree.map(jnp.add, acc, g), loss_acc + loss), None

        acc0 = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params),
                                                grad_shardings)
        (grads, loss), _ = lax.scan(micro, (acc0, jnp.zeros((), jnp.float32)), batch)
        with jax.named_scope(UPDATE_SCOPE):
            dims = jax.tree.map(lambda _: None, params)
            grads, gnorm = _clip(grads, _global_norm_sq(grads, dims, False),
                                 plan.step_cfg.clip_norm)
            target = state["opt"]["master"] if mixed else params
            updates, adam = plan.tx.update(grads, state["opt"]["adam"], target)
            target = optax.apply_updates(target, updates)
            new_params = jax.tree.map(lambda t: t.astype(pdt), target)
            return _finish(state, target, adam, new_params, mixed,
                           {"loss": loss, "grad_norm": gnorm})

    return step
