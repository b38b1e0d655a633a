"""Process start-up shared by the launchers: fake CPU devices, then (optionally) jax.distributed.

`start(devices)` must run before the first JAX operation (importing JAX is fine). Multi-process
runs use JAX's own runtime:
when SHARDQ_COORDINATOR (set by `experiments.launch_local`) or a cluster scheduler's environment
(SLURM, Open MPI, TPU pods: jax.distributed auto-detects them when SHARDQ_DISTRIBUTED=1) is
present, `jax.distributed.initialize` joins the job, with gloo for CPU collectives.
"""

from __future__ import annotations

import os

import jax

from parallel.devices import request_cpu_devices

DEFAULT_CPU_DEVICES = 8


def start(devices: int | None) -> None:
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
