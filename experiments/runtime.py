"""Process start-up shared by the launchers: fake CPU devices, then (optionally) jax.distributed.

`start(devices)` must run before the first JAX operation (importing JAX is fine). Multi-process
runs use JAX's own runtime:
when SHARDQ_COORDINATOR (set by `experiments.launch_local`) or a cluster scheduler's environment
(SLURM, Open MPI, TPU pods: jax.distributed auto-detects them when SHARDQ_DISTRIBUTED=1) is
present, `jax.distributed.initialize` joins the job, with gloo for CPU collectives.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax

from experiments.config import ConfigError, check_devices, fail
from model import ModelConfig
from parallel.devices import request_cpu_devices

DEFAULT_CPU_DEVICES = 8


def _prog() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else os.path.basename(sys.argv[0])


def check_backend(model: ModelConfig) -> None:
    """What a model config asks of the backend that started: the fused cuDNN attention exists on
    an NVIDIA GPU only (checked here, before a run writes anything)."""
    backend = jax.default_backend()
    if model.attention == "cudnn" and backend != "gpu":
        raise ConfigError(f"attention='cudnn': needs an NVIDIA GPU, the JAX backend is "
                          f"{backend!r} (use --attention xla)")


def attention_here(model: ModelConfig) -> ModelConfig:
    """`model` with XLA's attention where the fused kernel does not exist: a run trained with
    attention='cudnn' on a GPU is evaluated and sampled anywhere (the same function)."""
    if model.attention == "cudnn" and jax.default_backend() != "gpu":
        return dataclasses.replace(model, attention="xla")
    return model


def start(devices: int | None, model: ModelConfig | None = None) -> None:
    """Fake CPU devices, then jax.distributed when asked; `model`: the run's model config,
    refused in one line when this backend cannot run it (exit 2)."""
    if devices is not None:
        try:
            check_devices(devices)
        except ConfigError as e:  # every launcher's --devices ends here: one line, exit 2
            fail(_prog(), str(e))
    request_cpu_devices(devices, DEFAULT_CPU_DEVICES)
    coordinator = os.environ.get("SHARDQ_COORDINATOR")
    if coordinator or os.environ.get("SHARDQ_DISTRIBUTED") == "1":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs = {}
        if coordinator:
            kwargs = dict(coordinator_address=coordinator,
                          num_processes=int(os.environ["SHARDQ_NUM_PROCESSES"]),
                          process_id=int(os.environ["SHARDQ_PROCESS_ID"]))
        # Bounded waits: a peer that never arrives or dies mid-run fails the job, not hangs it.
        kwargs["initialization_timeout"] = int(os.environ.get("SHARDQ_INIT_TIMEOUT_S", "120"))
        kwargs["heartbeat_timeout_seconds"] = int(os.environ.get("SHARDQ_HEARTBEAT_S", "60"))
        jax.distributed.initialize(**kwargs)
    if model is not None:  # after jax.distributed: asking for the backend starts it
        try:
            check_backend(model)
        except ConfigError as e:
            fail(_prog(), str(e))
