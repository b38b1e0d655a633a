"""The real training step, lowered and compiled on abstract inputs (nothing is allocated).

Shared by the compile-only experiments (zero_memory, comm_volume, zero_release) and their tests.
JAX must already have its (fake) devices when these run.
"""

from __future__ import annotations


def lower_step(model_cfg, strategy: str, n_devices: int, *, seq_len: int, micro_steps: int,
               seqs_per_device: int = 1, mesh_spec: str | None = None):
    """Lower the real train step on abstract inputs; nothing is allocated.

    `strategy` is one of parallel.strategies.VARIANTS (zero3_prefetch included).

    Returns (lowered, args): args are the (state, batch) ShapeDtypeStructs, with the step's
    shardings, that it was lowered with. JAX must already have its fake devices.
    """
    import jax
    import jax.numpy as jnp

    from experiments.config import TrainConfig
    from experiments.optim import make_optimizer
    from parallel.mesh import make_mesh
    from parallel.state import abstract_model, check_divisible, init_state
    from parallel.strategies import parse_variant
    from parallel.train_step import StepConfig, make_train_step

    tx = make_optimizer(TrainConfig())  # the schedule's values change no shape or layout
    graphdef, axes, abstract_params = abstract_model(model_cfg)
    abstract_state = jax.eval_shape(lambda: init_state(model_cfg, tx, 0))
    mesh = make_mesh(n_devices, mesh_spec or f"fsdp={n_devices}")
    strategy, prefetch = parse_variant(strategy)
    check_divisible(abstract_params, axes, mesh, strategy)
    global_batch = seqs_per_device * n_devices
    step, state_shardings, batch_sharding = make_train_step(
        graphdef, axes, abstract_state, model_cfg, strategy, mesh, tx,
        StepConfig(global_batch=global_batch, seq_len=seq_len, micro_steps=micro_steps,
                   prefetch=prefetch))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract_state, state_shardings)
    batch = jax.ShapeDtypeStruct((micro_steps, global_batch, seq_len + 1), jnp.int32,
                                 sharding=batch_sharding)
    return step.lower(state, batch), (state, batch)


def compile_step(model_cfg, strategy: str, n_devices: int, **kwargs):
    """`lower_step` then compile: (compiled executable, args)."""
    lowered, args = lower_step(model_cfg, strategy, n_devices, **kwargs)
    return lowered.compile(), args
