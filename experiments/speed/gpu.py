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
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.cli.config import ConfigError, error_line
from experiments.cli.runtime import backend_refusal
from experiments.reporting.results_io import write_result
from experiments.speed.gc_pause import timed_call
from model import MODEL_PRESETS, DecoderLM, ModelConfig
from model.flops import param_bytes, param_count, train_flops_per_token
from model.layers import causal_attention, fused_causal_attention
from parallel.mesh import make_mesh
from parallel.sharded_run import build
from parallel.strategies import from_label
from parallel.train_step import StepConfig
from quant.dense import int8_matmul, int8_matmul_t
from quant.modes import QuantConfig
from quant.pipeline import quantize

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
        times.append(timed_call(fn)[1])
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

    # The first step's loss (same seed, same batch for every variant): variants that change how
    # the step is computed, not what, must agree on it to bf16 rounding.
    first_loss = float(one())
    sec, times = _median_time(one, max(warmup - 1, 0), steps)
    loss = float(one())  # after 1 + (warmup - 1) + steps + 1 updates: the same for every variant
    tokens_per_s = global_batch * seq_len / sec
    flops = train_flops_per_token(cfg, seq_len)
    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind)
    mem = compiled.memory_analysis()
    return {"strategy": strategy, "params": param_count(cfg), "devices": n_devices,
            "global_batch": global_batch, "seq_len": seq_len, "tokens_per_step":
            global_batch * seq_len, "compute_dtype": cfg.compute_dtype, "remat": cfg.remat,
            "attention": cfg.attention,
            "step_s": sec, "runs_s": [round(t, 5) for t in times], "compile_s": compile_s,
            "tokens_per_s": tokens_per_s, "model_flops_per_token": flops,
            "model_tflops_per_s": flops * tokens_per_s / 1e12,
            "peak_flops_per_device": peak,
            "mfu": flops * tokens_per_s / (n_devices * peak) if peak else None,
            "first_loss": first_loss, "last_loss": loss, "updates": warmup + steps + 1,
            "loss_finite": bool(np.isfinite(loss)),
            "compiled_temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0) or 0)}


# bf16 keeps 8 significant bits (a relative step of 2^-8 = 3.9e-3 near the top of a binade); two
# correct attentions of bf16 inputs differ by a few such steps of the largest value, a wrong one
# (a mask or a head mapping off) by its size.
PARITY_TOLERANCE = 2e-2


def attention_parity(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The fused cuDNN attention (`model.layers.fused_causal_attention`) against XLA's on the same
    bf16 inputs: largest |difference| of the outputs and of the gradients of sum(out * g) with
    respect to q, k and v, each over the XLA side's largest |value| (bf16 rounding is ~4e-3)."""
    keys = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.bfloat16)
            for kk in keys[1:3])
    g = jax.random.normal(keys[3], (batch, seq, heads, head_dim), jnp.bfloat16)

    def forward_and_grads(attend):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))
        out = jax.jit(attend)(q, k, v)
        return (out, *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))

    xla = forward_and_grads(causal_attention)
    fused = forward_and_grads(fused_causal_attention)
    rel = {name: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                       / float(jnp.max(jnp.abs(a.astype(jnp.float32)))))
           for name, a, b in zip(("out", "dq", "dk", "dv"), xla, fused, strict=True)}
    return {"shape": {"batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads,
                      "head_dim": head_dim}, "max_rel_diff": rel,
            "tolerance": PARITY_TOLERANCE, "ok": max(rel.values()) <= PARITY_TOLERANCE}


# Inference modes the prefill part times: the float model and the two int8 forms that need no
# calibration (int8 kernels with float activations; int8 kernels and per-token int8 activations).
INFERENCE_MODES = ("none", "w8", "w8a8")


def prefill_rate(cfg: ModelConfig, mode: str, batch: int, seq: int, steps: int = 5,
                 warmup: int = 2) -> dict:
    """Median time of one forward pass (the logits of every position, as scoring and prefill
    compute them) over [batch, seq] tokens: the float model in cfg's compute dtype, or its int8
    form under `mode` (`quant.pipeline.quantize`, every Dense and the head, no calibration)."""
    cfg = dataclasses.replace(cfg, max_len=max(cfg.max_len, seq))
    graphdef, state = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    if mode != "none":
        graphdef, params, _, _ = quantize(graphdef, params, QuantConfig(mode=mode), [],
                                          error_report=False)
    tokens = jax.random.randint(jax.random.key(3), (batch, seq), 0, cfg.vocab_size, jnp.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)).lower(params, tokens).compile()
    compile_s = time.perf_counter() - t0
    sec, times = _median_time(lambda: compiled(params, tokens), warmup, steps)
    logits = compiled(params, tokens)
    return {"mode": mode, "batch": batch, "seq": seq, "compute_dtype": cfg.compute_dtype,
            "step_s": sec, "runs_s": [round(t, 5) for t in times], "compile_s": compile_s,
            "tokens_per_s": batch * seq / sec, "param_bytes": param_bytes(params),
            "logits_finite": bool(jnp.all(jnp.isfinite(logits)))}


def widened_operands(hlo: str) -> list[str]:
    """Instructions of the entry computation of a compiled int8-dot program that convert
    something (an int8 operand widened before the matmul would show up here)."""
    entry = hlo[hlo.index("ENTRY"):]
    return [ln.strip()[:160] for ln in entry.splitlines() if "convert" in ln]


def gemm_backends(hlo: str) -> list[str]:
    """The library calls and generated kernels a compiled program is made of: its custom-call
    targets (cuBLAS, cuBLASLt) and the kinds of its custom fusions (a Triton GEMM, or any other
    Triton kernel such as a transpose; XLA:CPU's own fusions), sorted."""
    found = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    found |= set(re.findall(r'"kind":"(__[A-Za-z0-9_$]+)"', hlo))
    return sorted(found)


def entry_instructions(hlo: str, limit: int = 40) -> list[str]:
    """The compiled program's entry computation, one instruction per line (metadata cut, each at
    most 240 characters): what surrounds the GEMM call (layout copies, fusions) at a glance."""
    entry = hlo[hlo.index("ENTRY"):].splitlines()[1:]
    lines = [re.sub(r", metadata=\{.*?\}", "", ln.strip())[:240] for ln in entry
             if ln.strip() and ln.strip() != "}"]
    return lines[:limit]


def matmul_ratio(n: int, repeats: int = 10) -> dict:
    """n x n x n: bf16 (f32 accumulation, bf16 result) against s8 x s8 -> s32 with the int8
    kernel stored [in, out] (the float Dense's layout; quant/'s before its format /4) and
    [out, in] (K-major, quant/'s layout: both operands contract their last, contiguous axis, as
    cuBLASLt's int8 GEMM reads them), the three programs timed interleaved; the int8 ones are
    checked to multiply int8 operands and to agree exactly."""
    kx, kw = jax.random.split(jax.random.key(0))
    a = jax.random.normal(kx, (n, n), jnp.bfloat16)
    b = jax.random.normal(kw, (n, n), jnp.bfloat16)
    a8 = jax.random.randint(kx, (n, n), -127, 128, jnp.int32).astype(jnp.int8)
    b8 = jax.random.randint(kw, (n, n), -127, 128, jnp.int32).astype(jnp.int8)
    b8_t = jnp.asarray(b8.T)  # the same kernel, stored [out, in]
    programs = {"bf16": (jax.jit(jnp.dot).lower(a, b).compile(), (a, b)),
                "int8": (jax.jit(int8_matmul).lower(a8, b8).compile(), (a8, b8)),
                "int8_kmajor": (jax.jit(int8_matmul_t).lower(a8, b8_t).compile(),
                                (a8, b8_t))}
    hlo = {k: fn.as_text() for k, (fn, _) in programs.items()}
    same = bool(jnp.array_equal(programs["int8"][0](a8, b8), programs["int8_kmajor"][0](a8, b8_t)))
    times: dict[str, list[float]] = {k: [] for k in programs}
    for fn, args in programs.values():
        jax.block_until_ready(fn(*args))
    for _ in range(repeats):
        for name, (fn, args) in programs.items():
            times[name].append(timed_call(fn, *args)[1])
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    widened = widened_operands(hlo["int8"]) + widened_operands(hlo["int8_kmajor"])
    return {"n": n, "bf16_ms": ms["bf16"], "int8_ms": ms["int8"],
            "bf16_tflops": 2 * n**3 / ms["bf16"] / 1e9, "int8_tops": 2 * n**3 / ms["int8"] / 1e9,
            "int8_speedup_vs_bf16": ms["bf16"] / ms["int8"],
            "int8_kmajor_ms": ms["int8_kmajor"],
            "int8_kmajor_speedup_vs_bf16": ms["bf16"] / ms["int8_kmajor"],
            "int8_kmajor_equal": same,
            "hlo_keeps_s8": not widened and f"s8[{n},{n}]" in hlo["int8"], "hlo_converts": widened,
            "gemm_backends": {k: gemm_backends(h) for k, h in hlo.items()},
            "entry": {k: entry_instructions(h) for k, h in hlo.items()}}


# The fused attention against XLA's before any timing: the 1.3b preset's heads, and a grouped one.
ATTENTION_CHECKS = ((2, 2048, 16, 16, 128), (2, 2048, 16, 4, 128))


def train_variant(shape: dict, strategy: str, remat: str, attention: str) -> dict:
    """One training row; a variant that cannot run here is a row with its reason, not a crash."""
    label = {"strategy": strategy, "remat": remat, "attention": attention}
    cfg = dataclasses.replace(MODEL_PRESETS[shape["preset"]], compute_dtype="bfloat16",
                              remat=remat, attention=attention)
    refusal = backend_refusal(cfg)  # no NVIDIA GPU, or a head dimension its cuDNN lacks
    if refusal:
        return {**label, "skipped": refusal}
    try:
        return train_mfu(cfg, strategy, shape["global_batch"], shape["seq_len"],
                         shape["steps"], shape["warmup"])
    except (RuntimeError, NotImplementedError) as e:  # out of memory (JaxRuntimeError), a
        # kernel this chip or library lacks: a result here; anything else is a bug and stops
        return {**label, "error": error_line(e)}


def measure(shape: dict, parts: tuple[str, ...], variants, out: dict, path) -> None:
    """Fill `out` with the benchmark's `parts` at `shape` (bench_gpu's FULL or TINY), the
    training part for each (strategy, remat, attention) of `variants`, rewriting the results
    file `path` after every row so that a run cut short keeps what it measured."""
    out.update(preset=shape["preset"], attention_parity=[], training=[], matmuls=[],
               inference=[], decode=[], decode_skipped={}, complete=False)
    # The parity checks' head dimension (the last of each ATTENTION_CHECKS entry) decides too.
    refusal = backend_refusal(ModelConfig(d_model=ATTENTION_CHECKS[0][-1], n_heads=1,
                                          attention="cudnn", compute_dtype="bfloat16"))
    if "attention" in parts and refusal:
        out["attention_skipped"] = refusal
    elif "attention" in parts:
        for dims in ATTENTION_CHECKS:
            out["attention_parity"].append(attention_parity(*dims))
            write_result(path, out)
            print(json.dumps(out["attention_parity"][-1]), flush=True)
    if "training" in parts:
        for variant in variants:
            row = train_variant(shape, *variant)
            out["training"].append(row)
            write_result(path, out)
            print(json.dumps({k: row[k] for k in ("strategy", "remat", "attention", "step_s",
                                                   "tokens_per_s", "mfu", "error", "skipped")
                              if k in row}), flush=True)
    if "matmuls" in parts:
        for n in shape["matmuls"]:
            out["matmuls"].append(matmul_ratio(n, shape["matmul_repeats"]))
            write_result(path, out)
    if "inference" in parts:
        cfg = dataclasses.replace(MODEL_PRESETS[shape["preset"]], compute_dtype="bfloat16")
        for mode in INFERENCE_MODES:
            row = prefill_rate(cfg, mode, shape["inference_batch"], shape["seq_len"],
                               shape["steps"], shape["warmup"])
            out["inference"].append(row)
            write_result(path, out)
            print(json.dumps({k: row[k] for k in ("mode", "step_s", "tokens_per_s")}), flush=True)
    if "decode" in parts:
        from experiments.speed import gpu_decode  # loads the tokenizer and GGUF readers too

        for name in filter(None, (shape["decode_pretrained"], shape["decode_preset"])):
            model = None  # the last model freed before the next loads
            try:
                model, weights, why = gpu_decode.load_model(name, shape)
                out["decode"] += gpu_decode.model_rows(model, shape, weights, why)
                said = {f"{r['model']}/{r['form']}": round(r["decode_tokens_per_s"], 1)
                        for r in out["decode"] if r["model"] == name}
            except (ConfigError, RuntimeError, NotImplementedError) as e:  # not installed and
                # no preset; out of memory; a kernel this chip lacks: said, and the next runs
                out["decode_skipped"][name] = said = error_line(e)
            write_result(path, out)
            print(json.dumps({name: said}), flush=True)
    out["complete"] = True
