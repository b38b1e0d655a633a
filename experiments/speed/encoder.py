"""Library of experiments.bench_encoder: MiniLM sentence-embedding speed, float and int8, with a
breakdown of where a pass goes, fidelity to our float embeddings, and (optionally) the PyTorch
reference (experiments/reference/torch_encoder_reference.py, run by another interpreter) interleaved
with ours so that both sides see the same machine load. Each speed change measured against what
it replaced is encoder_ablations.py.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.pretrained.minilm import (
    BATCH,
    batch_rows,
    batch_sharding,
    encode,
    load_encoder,
    make_encode_fn,
    place,
    plan_batches,
    quantize_encoder,
    stdlib_sentences,
)
from experiments.speed.machine import describe
from experiments.speed.step_profile import median_call_s
from model.hf_bert import package_model_dir
from quant.dense import int8_matmul_t, quantized_product
from quant.quantizers import weight_scale

TORCH_SCRIPT = Path(__file__).resolve().parents[1] / "reference" / "torch_encoder_reference.py"
# How many stdlib sentences each benchmark text joins, cycling: mostly single sentences, some
# short paragraphs, so that lengths vary as in a real corpus (all within the 256 tokens that
# sentence-transformers keeps, so both sides embed the same tokens).
JOIN_PATTERN = (1, 1, 2, 1, 3, 1, 2, 4)
CALIB_OFFSET = 2000  # calibration sentences come from past every benchmark text


def bench_sentences(n: int) -> list[str]:
    """n deterministic texts of varied length built from the stdlib docstring sentences."""
    need = sum(JOIN_PATTERN[i % len(JOIN_PATTERN)] for i in range(n))
    pool = stdlib_sentences(need)
    out, at = [], 0
    for i in range(n):
        k = JOIN_PATTERN[i % len(JOIN_PATTERN)]
        out.append(" ".join(pool[at:at + k]))
        at += k
    return out


def load_1min() -> float:
    return os.getloadavg()[0]


def pass_seconds(fn, params, tok, texts, batch: int, mesh=None) -> float:
    """Wall time of one end-to-end pass (tokenise, pad, transfer, compute, fetch)."""
    start = time.perf_counter()
    encode(fn, params, tok, texts, batch, mesh)
    return time.perf_counter() - start


def breakdown(graphdef, params, tok, texts, batch: int, mesh=None) -> dict:
    """One pass taken apart, each stage waited for before the next: tokenisation (ids and
    padding), compilation of every padded shape (a fresh jit: what a new process pays),
    host->device, compute, device->host. The stages of a normal pass overlap, so these sum to
    more than `pass_seconds`."""
    t0 = time.perf_counter()
    ids = tok.ids(texts)
    plan = plan_batches([len(r) for r in ids], batch)
    multiple = mesh.size if mesh is not None else 1
    host = [tok.pad([ids[i] for i in idx], length, batch_rows(len(idx), batch, multiple))
            for idx, length in plan]
    sharding = batch_sharding(mesh) if mesh is not None else None
    tokenize_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    dev = jax.block_until_ready(jax.device_put(host, sharding))
    h2d_s = time.perf_counter() - t0
    fresh = make_encode_fn.__wrapped__(graphdef)  # not the cached one: nothing compiled
    compiled, compile_s = {}, {}
    for tokens, mask in dev:
        shape = tokens.shape
        if shape not in compiled:
            t0 = time.perf_counter()
            compiled[shape] = fresh.lower(params, tokens, mask).compile()
            compile_s[f"{shape[0]}x{shape[1]}"] = time.perf_counter() - t0

    for shape, exe in compiled.items():  # each executable's first run sets up buffers
        jax.block_until_ready(exe(params, *next(d for d in dev if d[0].shape == shape)))
    t0 = time.perf_counter()
    outs = jax.block_until_ready([compiled[t.shape](params, t, m) for t, m in dev])
    compute_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    [np.asarray(o) for o in outs]
    d2h_s = time.perf_counter() - t0
    padded = sum(t.size for t, _ in host)
    real = sum(len(r) for r in ids)
    return {"tokenize_s": tokenize_s, "compile_s": compile_s,
            "compile_total_s": sum(compile_s.values()), "h2d_s": h2d_s,
            "compute_s": compute_s, "d2h_s": d2h_s, "padded_tokens": padded,
            "real_tokens": real, "padding_fraction": 1 - real / padded}


class TorchReference:
    """The PyTorch script as a server (one timed pass per request) in another interpreter."""

    def __init__(self, python: str, texts: list[str], batch: int, model_dir: Path):
        self._tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(texts, self._tmp)
        self._tmp.close()
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)  # the reference must not see the project's packages
        self.proc = subprocess.Popen(
            [python, str(TORCH_SCRIPT), "--serve", "--model-dir", str(model_dir),
             "--sentences", self._tmp.name, "--batch", str(batch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._reply()["ready"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the PyTorch reference exited (code {self.proc.wait()})")
        return json.loads(line)

    def kernels(self, shapes) -> list[dict]:
        self.proc.stdin.write("kernels " + ";".join(",".join(map(str, s)) for s in shapes) + "\n")
        self.proc.stdin.flush()
        return self._reply()["kernels"]

    def seconds(self, variant: str) -> float:
        self.proc.stdin.write(variant + "\n")
        self.proc.stdin.flush()
        return float(self._reply()["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        os.unlink(self._tmp.name)


# One encoder layer's Dense shapes at 1024 token rows (32 texts of 32 tokens): q/k/v/o, up, down.
KERNEL_SHAPES = ((1024, 384, 384), (1024, 384, 1536), (1024, 1536, 384))


def kernel_times(shapes=KERNEL_SHAPES, calls: int = 30) -> list[dict]:
    """Median ms per shape of XLA:CPU's float32 dot, its bare s8 x s8 -> s32 dot, and our whole
    int8 Dense (per-token quantisation, the s8 dot, dequantisation), all on one device: where
    the int8 layer's time goes against the float one, and (with the PyTorch rows) against
    quantize_dynamic's."""
    rng = np.random.default_rng(0)

    def median_ms(fn, *args) -> float:
        return 1e3 * median_call_s(fn, *args, calls=calls)

    f32 = jax.jit(lambda x, w: x @ w)
    s8 = jax.jit(int8_matmul_t)  # the int8 kernel stored [out, in], as QuantDense stores it
    dense = jax.jit(lambda x, w, s: quantized_product(x, w, s, "token"))
    rows = []
    for m, k, n in shapes:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32)
        w_q, w_s = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8), weight_scale(w)
        x_q = jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
        rows.append({"m": m, "k": k, "n": n, "float32_ms": median_ms(f32, x, w),
                     "s8_dot_ms": median_ms(s8, x_q, w_q),
                     "int8_dense_ms": median_ms(dense, x, w_q, w_s)})
    return rows


def run(texts: list[str], modes: list[str], batch: int = BATCH, rounds: int = 3,
        torch_python: str | None = None, calib: list[str] | None = None, devices: int = 1,
        kernel_shapes=KERNEL_SHAPES,
        log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """Sentences/s of our float encoder and each int8 mode (median of `rounds` passes, the
    variants interleaved), the breakdown of each, cosine fidelity to our float embeddings, and
    with `torch_python` the PyTorch float / dynamic-int8 passes interleaved with ours.

    Each batch is split over `devices` CPU devices (embed's dp placement: the parameters
    replicated, the rows of a batch divided), as `experiments.embed` runs by default."""
    load_start = load_1min()
    graphdef, params, tok = load_encoder()
    if calib is None:
        calib = stdlib_sentences(64, offset=CALIB_OFFSET)
    placed, mesh = place(params, graphdef, devices, "dp")
    variants = {"float": (graphdef, placed)}
    for mode in modes:
        qdef, qparams, _ = quantize_encoder(graphdef, params, tok, mode, calib)
        variants[mode] = (qdef, place(qparams, qdef, devices, "dp")[0])
    torch_ref = None
    if torch_python:
        log(f"starting the PyTorch reference ({torch_python})")
        torch_ref = TorchReference(torch_python, texts, batch, package_model_dir())
    try:
        results = {}
        ref = None
        for name, (gd, p) in variants.items():
            log(f"{name}: breakdown and warm-up")
            fn = make_encode_fn(gd)
            results[name] = {"variant": name,
                             "breakdown": breakdown(gd, p, tok, texts, batch, mesh)}
            emb = encode(fn, p, tok, texts, batch, mesh)  # compiles the shapes, checks fidelity
            if ref is None:
                ref = emb
            cos = np.sum(emb * ref, axis=1)
            results[name].update(mean_cosine=float(cos.mean()), min_cosine=float(cos.min()),
                                 pass_s=[])
        torch_s = {"float": [], "int8": []}
        for r in range(rounds):
            for name, (gd, p) in variants.items():
                results[name]["pass_s"].append(
                    pass_seconds(make_encode_fn(gd), p, tok, texts, batch, mesh))
            if torch_ref:
                for v in torch_s:
                    torch_s[v].append(torch_ref.seconds(v))
            log(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {len(texts) / res['pass_s'][-1]:.0f}/s" for n, res in results.items()))
        log("kernels: one Dense layer per shape")
        kernels = kernel_times(kernel_shapes)
        if torch_ref:
            for row, theirs in zip(kernels, torch_ref.kernels(kernel_shapes), strict=True):
                row["torch_float32_ms"] = theirs["float32_ms"]
                row["torch_int8_ms"] = theirs["int8_ms"]
    finally:
        if torch_ref:
            torch_ref.close()
    n = len(texts)
    for res in results.values():
        res["sentences_per_s"] = n / statistics.median(res["pass_s"])
    out = {"machine": describe(), "load_1min": {"start": load_start, "end": load_1min()},
           "n_sentences": n, "batch": batch, "rounds": rounds, "devices": devices,
           "token_lengths": _lengths(tok, texts), "results": list(results.values()),
           "kernels": kernels}
    if torch_ref:
        t = {**torch_ref.info, "pass_s": torch_s,
             **{f"{v}_sentences_per_s": n / statistics.median(s) for v, s in torch_s.items()}}
        out["torch"] = t
        out["ratios"] = {name: res["sentences_per_s"] / t[
            "float_sentences_per_s" if name == "float" else "int8_sentences_per_s"]
            for name, res in results.items()}
    return out


def _lengths(tok, texts) -> dict:
    lengths = sorted(len(r) for r in tok.ids(texts))
    return {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]}
