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

from experiments.cli.config import ConfigError, check_devices, fail
from model import ModelConfig
from model.config import CUDNN_MAX_HEAD_DIM_BEFORE_HOPPER
from parallel.devices import request_cpu_devices

DEFAULT_CPU_DEVICES = 8


def _prog() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else os.path.basename(sys.argv[0])


def is_nvidia_gpu(backend: str, platform_version: str) -> bool:
    """Whether a started backend is CUDA's: JAX calls ROCm "gpu" too (its platform version
    says which)."""
    return backend == "gpu" and "rocm" not in platform_version.lower()


def on_nvidia_gpu() -> bool:
    """`is_nvidia_gpu` of the backend this process starts (starting it)."""
    return is_nvidia_gpu(jax.default_backend(),
                         str(getattr(jax.devices()[0].client, "platform_version", "")))


def cudnn_refusal(model: ModelConfig, backend: str, platform_version: str,
                  compute_capability: str | None) -> str | None:
    """Why this backend cannot run `model`'s fused cuDNN attention, or None when it can.
    Decided from what the started backend reports, so that it is testable without a GPU."""
    if model.attention != "cudnn":
        return None
    if not is_nvidia_gpu(backend, platform_version):
        where = "ROCm" if backend == "gpu" else repr(backend)
        return (f"attention='cudnn': needs an NVIDIA GPU, the JAX backend is {where} "
                f"(use --attention xla)")
    if compute_capability is not None and model.head_dim > CUDNN_MAX_HEAD_DIM_BEFORE_HOPPER:
        major = int(compute_capability.split(".")[0])
        if major < 9:
            return (f"attention='cudnn': a head dimension of {model.head_dim} needs a Hopper or "
                    f"later GPU (at most {CUDNN_MAX_HEAD_DIM_BEFORE_HOPPER} on compute capability "
                    f"{compute_capability}; use --attention xla)")
    return None


def backend_refusal(model: ModelConfig) -> str | None:
    """Why the backend that started cannot run `model` (None when it can); starts the backend."""
    if model.attention != "cudnn":
        return None
    device = jax.devices()[0]
    return cudnn_refusal(model, jax.default_backend(),
                         str(getattr(device.client, "platform_version", "")),
                         getattr(device, "compute_capability", None))


def check_backend(model: ModelConfig) -> None:
    """What a model config asks of the backend that started: the fused cuDNN attention exists on
    an NVIDIA GPU only (checked here, before a run writes anything)."""
    problem = backend_refusal(model)
    if problem:
        raise ConfigError(problem)


def attention_here(model: ModelConfig) -> ModelConfig:
    """`model` with XLA's attention where the fused kernel cannot run: a run trained with
    attention='cudnn' on a GPU is evaluated and sampled anywhere (the same function)."""
    if backend_refusal(model):
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
