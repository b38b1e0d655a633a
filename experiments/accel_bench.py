"""What an accelerator does with this codebase: training MFU of a sharded run, and the int8 dot
rate against bf16 (library of `experiments.bench_gpu`).

`train_mfu` times the real train step (`parallel.sharded_run.build`: the trainer's program) and
divides the model FLOPs it does (`model.flops.train_flops_per_token`, rematerialisation not
counted) by the chip's dense bf16 peak. `matmul_ratio` times an s8 x s8 -> s32 dot against a
bf16 dot of the same shape and reads the compiled program to check the int8 operands reach the
matmul as int8 (no conversion of either operand to a wider type before it).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from model import ModelConfig
from model.flops import param_count, train_flops_per_token
from parallel.mesh import make_mesh
from parallel.sharded_run import build
from parallel.strategies import from_label
from parallel.train_step import StepConfig
from quant.dense import int8_matmul

# Dense bf16 tensor-core peak per chip, FLOP/s (vendor datasheets, SXM parts, no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops(device_kind: str) -> float | None:
    """The dense bf16 peak of a device kind we know, else None (MFU is then not computed)."""
    return next((v for k, v in PEAK_BF16.items() if k in device_kind), None)


def _median_time(fn, warmup: int, steps: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), times


def train_mfu(cfg: ModelConfig, strategy: str, global_batch: int, seq_len: int,
              steps: int = 5, warmup: int = 2, n_devices: int = 1) -> dict:
    """Median step time of `steps` train steps (after `warmup`, which include the compile) and
    the MFU it implies: tokens/s x model FLOPs per token / (devices x peak)."""
    cfg = dataclasses.replace(cfg, max_len=max(cfg.max_len, seq_len))
    mesh = make_mesh(n_devices, f"fsdp={n_devices}")
    run = build(cfg, from_label(strategy), mesh, optax.adamw(1e-4),
                StepConfig(global_batch=global_batch, seq_len=seq_len, micro_steps=1))
    t0 = time.perf_counter()
    state = run.init(0)
    batch = jax.device_put(jax.random.randint(jax.random.key(1), (1, global_batch, seq_len + 1),
                                              0, cfg.vocab_size, jnp.int32),
                           run.batch_sharding)
    compiled = run.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    box = {"state": state}

    def one():
        box["state"], metrics = compiled(box["state"], batch)
        return metrics["loss"]

    sec, times = _median_time(one, warmup, steps)
    loss = float(one())
    tokens_per_s = global_batch * seq_len / sec
    flops = train_flops_per_token(cfg, seq_len)
    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind)
    mem = compiled.memory_analysis()
    return {"strategy": strategy, "params": param_count(cfg), "devices": n_devices,
            "global_batch": global_batch, "seq_len": seq_len, "tokens_per_step":
            global_batch * seq_len, "compute_dtype": cfg.compute_dtype, "remat": cfg.remat,
            "step_s": sec, "runs_s": [round(t, 5) for t in times], "compile_s": compile_s,
            "tokens_per_s": tokens_per_s, "model_flops_per_token": flops,
            "model_tflops_per_s": flops * tokens_per_s / 1e12,
            "peak_flops_per_device": peak,
            "mfu": flops * tokens_per_s / (n_devices * peak) if peak else None,
            "loss_finite": bool(np.isfinite(loss)),
            "compiled_temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0) or 0)}


def widened_operands(hlo: str) -> list[str]:
    """Instructions of the entry computation of a compiled int8-dot program that convert
    something (an int8 operand widened before the matmul would show up here)."""
    entry = hlo[hlo.index("ENTRY"):]
    return [ln.strip()[:160] for ln in entry.splitlines() if "convert" in ln]


def matmul_ratio(n: int, repeats: int = 10) -> dict:
    """n x n x n: bf16 (f32 accumulation, bf16 result) against s8 x s8 -> s32, timed
    interleaved; the compiled int8 program is checked to multiply int8 operands."""
    kx, kw = jax.random.split(jax.random.key(0))
    a = jax.random.normal(kx, (n, n), jnp.bfloat16)
    b = jax.random.normal(kw, (n, n), jnp.bfloat16)
    a8 = jax.random.randint(kx, (n, n), -127, 128, jnp.int32).astype(jnp.int8)
    b8 = jax.random.randint(kw, (n, n), -127, 128, jnp.int32).astype(jnp.int8)
    bf16 = jax.jit(jnp.dot).lower(a, b).compile()
    int8 = jax.jit(int8_matmul).lower(a8, b8).compile()
    hlo = int8.as_text()
    times: dict[str, list[float]] = {"bf16": [], "int8": []}
    for fn, args in ((bf16, (a, b)), (int8, (a8, b8))):
        jax.block_until_ready(fn(*args))
    for _ in range(repeats):
        for name, fn, args in (("bf16", bf16, (a, b)), ("int8", int8, (a8, b8))):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    widened = widened_operands(hlo)
    return {"n": n, "bf16_ms": ms["bf16"], "int8_ms": ms["int8"],
            "bf16_tflops": 2 * n**3 / ms["bf16"] / 1e9, "int8_tops": 2 * n**3 / ms["int8"] / 1e9,
            "int8_speedup_vs_bf16": ms["bf16"] / ms["int8"],
            "hlo_keeps_s8": not widened and f"s8[{n},{n}]" in hlo, "hlo_converts": widened}
