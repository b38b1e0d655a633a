"""int8 against float on this machine: matmul throughput per shape and greedy decoding tokens/s
(the library of `experiments.bench_int8`, whose docstring says what each row holds).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.speed.machine import host_cpu
from model import MODEL_PRESETS, DecoderLM
from model.generate import generate
from quant import quantizers as qz
from quant.convert import QuantConfig, apply_plan, make_plan
from quant.dense import QuantDense, int8_matmul, int8_matmul_t, quantized_product
from quant.pipeline import param_bytes

# The last two: batch-1 decoding's products at a 1.3B model's widths (one row is padded to
# MIN_INT8_ROWS = 4 by the int8 product).
SHAPES = ((16, 1024, 1024), (256, 1024, 1024), (1024, 1024, 1024), (1024, 2048, 2048),
          (4, 2048, 8192), (4, 8192, 2048))


def timed(fn, *args, repeats: int) -> float:
    """Best wall time of `repeats` calls after a compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def module_fn(module):
    """A jitted call of an NNX module that takes its state as an argument (not baked in)."""

    graphdef = nnx.graphdef(module)
    return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))


def bench_matmuls(shapes, repeats: int) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        kx, kw = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (m, k), jnp.float32)
        w = jax.random.normal(kw, (k, n), jnp.float32)
        s_w = qz.weight_scale(w)
        w_q, x_q = qz.quantize(w, s_w), qz.quantize(x, qz.token_scale(x))
        w_t = jnp.asarray(w_q.T)  # [n, k]: QuantDense's layout
        x_hot = x.at[:, : 8 * k // 1024].multiply(20.0)  # columns over the threshold of 6
        outlier = QuantDense(w_t, s_w, kernel_axes=(None, None), compute_dtype="float32",
                             outlier_threshold=6.0, outlier_capacity=k // 16)
        # Every column allowed through float (capacity = k): the unbounded LLM.int8() split.
        outlier_full = QuantDense(w_t, s_w, kernel_axes=(None, None), compute_dtype="float32",
                                  outlier_threshold=6.0, outlier_capacity=k)
        cases = {
            "float32": (jax.jit(jnp.dot), x, w),
            "bfloat16": (jax.jit(jnp.dot), x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)),
            "int8_dot": (jax.jit(int8_matmul_t), x_q, w_t),
            "int8_dot_in_out": (jax.jit(int8_matmul), x_q, w_q),
            "int8_dense": (jax.jit(lambda a, b, s: quantized_product(a, b, s, "token")),
                           x, w_t, s_w),
            "int8_outlier_dense": (module_fn(outlier), nnx.state(outlier), x_hot),
            "int8_outlier_full_dense": (module_fn(outlier_full), nnx.state(outlier_full), x_hot),
        }
        # The two layouts time the same product: integer sums, so equal to the last bit.
        row = {"m": m, "k": k, "n": n, "int8_layouts_equal": bool(jnp.array_equal(
            int8_matmul_t(x_q, w_t), int8_matmul(x_q, w_q)))}
        for name, (fn, *args) in cases.items():
            sec = timed(fn, *args, repeats=repeats)
            row[f"{name}_ms"] = sec * 1e3
            row[f"{name}_tops"] = 2 * m * k * n / sec / 1e12
        for name in ("int8_dot", "int8_dense", "int8_outlier_dense", "int8_outlier_full_dense"):
            row[f"{name}_speedup_vs_f32"] = row["float32_ms"] / row[f"{name}_ms"]
            row[f"{name}_speedup_vs_bf16"] = row["bfloat16_ms"] / row[f"{name}_ms"]
        # > 1: the stored [out, in] kernel is faster than the same product on [in, out]
        row["kmajor_speedup"] = row["int8_dot_in_out_ms"] / row["int8_dot_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_decoding(preset: str, batch: int, new_tokens: int, repeats: int) -> list[dict]:
    cfg = MODEL_PRESETS[preset]
    prompt_len = min(16, cfg.max_len // 2)
    new_tokens = min(new_tokens, cfg.max_len - prompt_len)
    prompt = jnp.ones((batch, prompt_len), jnp.int32)
    rows = []
    for mode in ("none", "w8", "w8a8"):
        model = DecoderLM(cfg, rngs=nnx.Rngs(0))
        if mode != "none":
            qcfg = QuantConfig(mode=mode)
            model = apply_plan(model, make_plan(qcfg, model), qcfg)
        graphdef, state = nnx.split(model)
        params = nnx.to_pure_dict(state)
        gen = jax.jit(generate, static_argnums=(0, 3))
        sec = timed(gen, graphdef, params, prompt, new_tokens, jax.random.key(0),
                    repeats=repeats)
        rows.append({"mode": mode, "preset": preset, "batch": batch, "new_tokens": new_tokens,
                     "seconds": sec, "tokens_per_s": batch * new_tokens / sec,
                     "param_bytes": param_bytes(params)})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_float"] = r["tokens_per_s"] / base
    return rows


def measure(preset: str, batch: int, new_tokens: int, repeats: int, big: bool = False) -> dict:
    """The matmul rows (with the 4096^3 and 8192^3 shapes when `big`, or on an accelerator) and
    the decoding rows of `preset`, with the backend and host they ran on."""
    # The large shapes are where an accelerator's int8 rate shows; too slow for a 2-core CPU.
    big = big or jax.default_backend() != "cpu"
    shapes = SHAPES + (((4096, 4096, 4096), (8192, 8192, 8192)) if big else ())
    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind,
            "jax_version": jax.__version__, "host_cpu": host_cpu(),
            "matmuls": bench_matmuls(shapes, repeats),
            "decoding": bench_decoding(preset, batch, new_tokens, repeats)}
