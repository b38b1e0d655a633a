"""One way to build a sharded training run: abstract model -> eval_shape(init) -> shardings ->
jitted init and train step.

Every caller (the trainer, the equivalence runs, the compile-only experiments and the tests)
builds through `build`, so what they measure is the program the trainer runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from model import ModelConfig
from parallel.mesh import make_mesh
from parallel.state import abstract_model, check_divisible, init_state, state_from_params
from parallel.strategies import Strategy, from_label
from parallel.train_step import StepConfig, make_train_step


@dataclasses.dataclass(frozen=True)
class ShardedRun:
    model_cfg: ModelConfig
    strategy: Strategy
    mesh: Mesh
    tx: optax.GradientTransformation
    step_cfg: StepConfig
    graphdef: object
    axes: dict  # logical axis names of every parameter
    abstract_state: dict  # ShapeDtypeStructs: {"params", "opt", "step"}
    shardings: dict  # NamedSharding of every state leaf
    batch_sharding: NamedSharding
    step: Callable  # jitted (state, batch) -> (state, metrics); donates the state

    def init(self, seed: int) -> dict:
        """Fresh state, each leaf initialised straight into its shards (jitted init)."""
        return jax.jit(lambda: init_state(self.model_cfg, self.tx, seed),
                       out_shardings=self.shardings)()

    def init_from(self, params: dict) -> dict:
        """State around given parameters (e.g. pretrained ones already placed in their
        shards): master copy and optimizer moments are created straight into their shards."""
        return jax.jit(lambda p: state_from_params(self.model_cfg, self.tx, p),
                       out_shardings=self.shardings)(params)

    def abstract_args(self) -> tuple[dict, jax.ShapeDtypeStruct]:
        """(state, batch) as sharded ShapeDtypeStructs: lower the step without allocating."""
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             self.abstract_state, self.shardings)
        c = self.step_cfg
        batch = jax.ShapeDtypeStruct((c.micro_steps, c.global_batch, c.seq_len + 1), jnp.int32,
                                     sharding=self.batch_sharding)
        return state, batch


def build(model_cfg: ModelConfig, strategy: Strategy, mesh: Mesh,
          tx: optax.GradientTransformation, step_cfg: StepConfig) -> ShardedRun:
    """Everything a sharded run needs; nothing is allocated (ValueError on a layout that does
    not divide over the mesh)."""
    graphdef, axes, abstract_params = abstract_model(model_cfg)
    check_divisible(abstract_params, axes, mesh, strategy)
    abstract_state = jax.eval_shape(lambda: init_state(model_cfg, tx, 0))
    step, shardings, batch_sharding = make_train_step(
        graphdef, axes, abstract_state, model_cfg, strategy, mesh, tx, step_cfg)
    return ShardedRun(model_cfg, strategy, mesh, tx, step_cfg, graphdef, axes, abstract_state,
                      shardings, batch_sharding, step)


def lower_step(model_cfg: ModelConfig, strategy: str, n_devices: int, *,
               tx: optax.GradientTransformation, seq_len: int, micro_steps: int,
               seqs_per_device: int = 1, mesh_spec: str | None = None):
    """The real train step lowered on abstract inputs (nothing allocated): (lowered, args),
    args being the sharded (state, batch) ShapeDtypeStructs it was lowered with.

    `strategy` is a label of parallel.strategies.LABELS (zero3_prefetch included). The
    optimizer's hyper-parameters change no shape, layout or collective.
    """
    run = build(model_cfg, from_label(strategy), make_mesh(n_devices, mesh_spec or
                                                           f"fsdp={n_devices}"), tx,
                StepConfig(global_batch=seqs_per_device * n_devices, seq_len=seq_len,
                           micro_steps=micro_steps))
    args = run.abstract_args()
    return run.step.lower(*args), args


def compile_step(model_cfg: ModelConfig, strategy: str, n_devices: int, **kwargs):
    """`lower_step`, then compile: (compiled executable, args)."""
    lowered, args = lower_step(model_cfg, strategy, n_devices, **kwargs)
    return lowered.compile(), args


def run_steps(run: ShardedRun, batches, seed: int,
              init_params: dict | None = None) -> tuple[np.ndarray, dict]:
    """Per-step losses and the final params (host numpy) of len(batches) steps from a fresh
    state (or from `init_params`, e.g. pretrained weights): what the equivalence checks
    compare across strategies and meshes."""
    state = (run.init(seed) if init_params is None else
             run.init_from(jax.device_put(init_params, run.shardings["params"])))
    losses = []
    for b in batches:
        state, metrics = run.step(state, jax.device_put(b, run.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state["params"])


def run_label(label: str, devices: int, batches, model_cfg: ModelConfig,
              tx: optax.GradientTransformation, *, seed: int, clip_norm: float = 1.0,
              mesh_spec: str | None = None,
              init_params: dict | None = None) -> tuple[np.ndarray, dict]:
    """`run_steps` of one strategy label (zero3_prefetch included) on `devices` devices, the
    step shaped by the batches ([micro_steps, global_batch, seq_len + 1] each)."""
    micro, batch, length = batches[0].shape
    run = build(model_cfg, from_label(label), make_mesh(devices, mesh_spec), tx,
                StepConfig(global_batch=batch, seq_len=length - 1, micro_steps=micro,
                           clip_norm=clip_norm))
    return run_steps(run, batches, seed, init_params)


def max_tree_diff(a, b) -> float:
    """Largest elementwise |a - b| over two trees of the same structure (compared in fp32)."""
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
