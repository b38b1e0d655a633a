"""One token through every block kernel of a decoder, per product form: what batch-1 decoding's
matrix-vector products cost on this host, apart from the rest of the model
(`experiments.bench_decode` records it beside the decoding speeds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.speed.gc_pause import timed_call
from quant import native_int8
from quant.dense import CONTRACT_IN, MIN_INT8_ROWS, int8_matmul, int8_matmul_t


def matvec_check(cfg, repeats: int) -> dict:
    """One token through every block kernel of the model (random weights of its shapes: speed
    does not depend on the values), interleaved: the float32 dot; the int8 dot against the
    kernel stored [out, in] (quant.dense's layout) on the single row and with the row padded to
    `MIN_INT8_ROWS` (what `quant.dense.int8_matmul_t` does), and padded against the kernel in
    the float layout [in, out]; and two weight-only forms, a float row times the int8 kernel
    converted first (what `w8` runs) or as a multiply-and-sum (which XLA fuses with the
    conversion); and shardq's own kernel (quant.native_int8: a float row in, quantised,
    multiplied and dequantised in one call) where it builds. Median ms of `repeats` calls
    each."""
    d, f, kv = cfg.d_model, cfg.d_ff, cfg.kv_heads * cfg.head_dim
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)] * cfg.n_layers
    keys = jax.random.split(jax.random.key(0), len(shapes))
    w_q = [jax.random.randint(k, s, -127, 128, jnp.int32).astype(jnp.int8)
           for k, s in zip(keys, shapes, strict=True)]  # [in, out]
    w_t = [jnp.asarray(w.T) for w in w_q]  # [out, in]
    w_f = [w.astype(jnp.float32) for w in w_q]

    def chain(product, stored_out_in: bool = False):
        @jax.jit
        def fn(ws, x):  # each product's input depends on the last: nothing runs ahead
            total = jnp.zeros((), jnp.float32)
            for w in ws:
                width = w.shape[1] if stored_out_in else w.shape[0]
                y = product(x[:, :width] + total.astype(x.dtype), w)
                total = total + y[0, 0].astype(jnp.float32) * 1e-9
            return total
        return fn

    x_f = jnp.ones((1, f), jnp.float32)
    x_q = jnp.ones((1, f), jnp.int8)
    cases = {"float32_dot": (chain(jnp.dot), w_f, x_f),
             "int8_dot_1_row": (chain(lambda a, w: int8_matmul_t(a, w, min_rows=1), True),
                                w_t, x_q),
             f"int8_dot_{MIN_INT8_ROWS}_rows": (chain(int8_matmul_t, True), w_t, x_q),
             f"int8_dot_{MIN_INT8_ROWS}_rows_in_out": (chain(int8_matmul), w_q, x_q),
             # weight-only (w8) candidates: float row times the int8 kernel
             "w8_convert_then_dot": (chain(lambda a, w: jax.lax.dot_general(
                 a, w.astype(jnp.float32), CONTRACT_IN), True), w_t, x_f),
             "w8_multiply_sum": (chain(lambda a, w: jnp.sum(
                 a.reshape(-1, 1) * w.astype(jnp.float32), axis=0, keepdims=True)), w_q, x_f)}
    if native_int8.status()["available"]:
        cases["shardq_int8_kernel"] = (chain(lambda a, w: native_int8.product(
            a, w, jnp.ones((w.shape[0],), jnp.float32)), True), w_t, x_f)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn, ws, x in cases.values():
        jax.block_until_ready(fn(ws, x))
    for _ in range(repeats):
        for name, (fn, ws, x) in cases.items():
            times[name].append(timed_call(fn, ws, x)[1])
    out = {"kernels": len(shapes), "int8_bytes": int(sum(w.size for w in w_q)),
           "ms": {k: 1e3 * float(np.median(v)) for k, v in times.items()}}
    del w_f, w_q, w_t
    return out
