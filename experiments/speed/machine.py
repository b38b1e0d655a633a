"""The machine a benchmark ran on, recorded beside its figures (CPU types change between hosts)."""

from __future__ import annotations

import os
from pathlib import Path

import jax

INT8_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8", "avx512_bw"}
# What fp32/bf16 matmul speed depends on (training benchmarks record these).
VECTOR_FLAGS = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def host_cpu() -> dict:
    """The host CPU's model name and the int8 dot and vector instruction sets it advertises
    (Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {"model": None, "int8_flags": [], "vector_flags": []}
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in lines
                              if ln.startswith(key)), "")
    flags = set(field("flags").split())
    return {"model": field("model name") or None, "int8_flags": sorted(flags & INT8_FLAGS),
            "vector_flags": sorted(flags & VECTOR_FLAGS)}


def describe() -> dict:
    """Backend, device kind, JAX version, host CPU and core count."""
    return {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "jax_version": jax.__version__, "host_cpu": host_cpu(), "cpus": os.cpu_count()}
