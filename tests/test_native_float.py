"""shardq's float32 product for a few rows (model/native_float.py) against XLA's dot.

The kernel reads its weights [out, in] and sums each output in another order than XLA, so it
agrees to float32 rounding; grouped calls give each kernel's own result bit for bit. Shapes
cover the vector path and its tails (depths not a multiple of 64 or 16), several rows, and
kernels split into many chunks.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import DecoderLM, native_float
from model.generate import generate
from model.layers import Dense, Embed, shared_input, use_native_float
from tests.helpers import TINY, native_kernel_built


def _built() -> bool:
    return native_kernel_built(native_float.status())


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("rows,k,n", [(1, 576, 576), (1, 1536, 576), (1, 576, 3072),
                                      (3, 100, 7), (8, 33, 130), (2, 4100, 20), (1, 5, 1),
                                      (2, 56, 40), (1, 120, 17)])
def test_kernel_matches_xla_to_float_rounding(rows, k, n):
    if not _built():
        return
    rng = np.random.default_rng(rows * k + n)
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32))  # [out, in]
    assert native_float.TARGET in _lowered(native_float.product, x, w)
    got = np.asarray(jax.jit(native_float.product)(x, w))
    want = np.asarray(jax.jit(jnp.dot)(x, w.T))
    # sums of k products in another order: float32 rounding of sums of |x||w|
    tol = 4e-7 * k ** 0.5 * np.abs(np.asarray(x)) @ np.abs(np.asarray(w)).T
    assert np.all(np.abs(got - want) <= tol + 1e-30)
    other = np.asarray(jax.jit(native_float.product)(x, w.at[n - 1, k // 2].add(1.0)))
    assert np.any(np.abs(other - want) > tol)  # one changed weight is caught
    if rows > 1:  # a row alone gives the same sums as among the others (one order per output)
        np.testing.assert_array_equal(np.asarray(jax.jit(native_float.product)(x[-1:], w))[0],
                                      got[-1])


def test_grouped_call_gives_each_kernel_its_own_result_and_repeats_exactly():
    if not _built():
        return
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 576)).astype(np.float32))
    ws = [jnp.asarray(rng.standard_normal((n, 576)).astype(np.float32)) for n in (576, 190, 9)]
    group = jax.jit(native_float.product_group)
    assert native_float.TARGET_GROUP in _lowered(native_float.product_group, x, ws)
    together = [np.asarray(y) for y in group(x, ws)]
    for w, y in zip(ws, together, strict=True):
        np.testing.assert_array_equal(y, np.asarray(jax.jit(native_float.product)(x, w)))
    # each output's sum runs in a fixed order, whichever thread ran it
    np.testing.assert_array_equal(together[0], np.asarray(group(x, ws)[0]))


def test_outputs_do_not_depend_on_how_the_threads_split_them():
    """A kernel large enough to be shared out over the threads, and its first 64 outputs
    alone (few enough bytes to run on the calling thread): the same sums, bit for bit."""
    if not _built():
        return
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((2, 576)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((4096, 576)).astype(np.float32))
    whole = np.asarray(jax.jit(native_float.product)(x, w))
    np.testing.assert_array_equal(np.asarray(jax.jit(native_float.product)(x, w[:64])),
                                  whole[:, :64])


def _dense(rng, k, n, dtype="float32", bias=False):
    d = Dense(k, n, axes=(None, None), rngs=nnx.Rngs(int(rng.integers(1 << 30))),
              param_dtype=dtype, compute_dtype=dtype, use_bias=bias)
    if bias:
        d.bias[...] = jnp.asarray(rng.standard_normal(n).astype(np.float32)).astype(d.bias.dtype)
    return d


def test_dense_routes_by_its_switch_and_groups_layers_that_share_an_input():
    """Off by default (training: the kernel has no gradient); switched on, a few rows run in
    the kernel and agree with XLA's dot; q/k/v-like layers that read one input share a call;
    many rows, or a bfloat16 kernel, stay with XLA."""
    if not _built():
        return
    rng = np.random.default_rng(3)
    q, k, v = _dense(rng, 64, 64, bias=True), _dense(rng, 64, 16), _dense(rng, 64, 16)
    x = jnp.asarray(rng.standard_normal((1, 2, 64)).astype(np.float32))
    # a new function each time: jit keeps the program it traced for a function object, and
    # the switch is part of the layers' structure, not of the traced arguments
    call = lambda: lambda x: shared_input(x, q, k, v)  # noqa: E731
    off = [np.asarray(y) for y in call()(x)]
    assert native_float.TARGET not in _lowered(call(), x)  # the default: XLA's dots
    for layer in (q, k, v):
        use_native_float(layer, True)
    text = _lowered(call(), x)
    assert text.count(native_float.TARGET_GROUP) == 1  # one call for the three kernels
    on = [np.asarray(y) for y in call()(x)]
    for a, b in zip(on, off, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    assert native_float.TARGET in _lowered(lambda x: q(x), x)  # alone: the single entry
    many = jnp.ones((1, native_float.MAX_ROWS + 1, 64))
    assert native_float.TARGET not in _lowered(call(), many)  # a GEMM: XLA's
    half = use_native_float(_dense(rng, 64, 64, "bfloat16"), True)
    assert native_float.TARGET not in _lowered(lambda x: half(x), x.astype(jnp.bfloat16))


def test_switch_stores_kernels_out_in_and_back_exactly():
    """Switched on, a float32 kernel is stored [out, in] with its axis names swapped, and a
    GEMM (many rows) still multiplies it as [in, out]; switched off, the kernel and its names
    are the original ones, bit for bit. A bfloat16 kernel keeps its layout."""
    rng = np.random.default_rng(11)
    d = Dense(48, 20, axes=("embed", "mlp"), rngs=nnx.Rngs(5))
    before = np.asarray(d.kernel[...])
    x = jnp.asarray(rng.standard_normal((2, 12, 48)).astype(np.float32))
    want = np.asarray(d(x))
    use_native_float(d, True)
    assert d.out_in and d.kernel.shape == (20, 48)
    assert tuple(d.kernel.get_metadata()["out_sharding"]) == ("mlp", "embed")
    np.testing.assert_array_equal(np.asarray(d.weight()), before)
    np.testing.assert_allclose(np.asarray(d(x)), want, rtol=0, atol=1e-5 * np.abs(want).max())
    use_native_float(d, False)
    assert not d.out_in and tuple(d.kernel.get_metadata()["out_sharding"]) == ("embed", "mlp")
    np.testing.assert_array_equal(np.asarray(d.kernel[...]), before)
    half = use_native_float(_dense(rng, 64, 32, "bfloat16"), True)
    assert not half.out_in and half.kernel.shape == (64, 32)


def test_tied_head_runs_in_the_kernel_when_switched_on():
    """The tied head (x times the [vocab, embed] table, transposed) reads the table as it is
    stored: switched on, one row runs in the kernel and agrees with XLA's product."""
    if not _built():
        return
    rng = np.random.default_rng(12)
    table = Embed(1000, 96, rngs=nnx.Rngs(2))
    x = jnp.asarray(rng.standard_normal((1, 1, 96)).astype(np.float32))
    want = np.asarray(table.attend(x))
    assert native_float.TARGET not in _lowered(lambda x: table.attend(x), x)
    use_native_float(table, True)
    assert native_float.TARGET in _lowered(lambda x: table.attend(x), x)
    got = np.asarray(table.attend(x))
    assert got.shape == want.shape == (1, 1, 1000)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_tied_model_decodes_the_same_tokens_with_the_head_in_the_kernel():
    """A tied model switched to the kernels (Dense kernels stored [out, in], the head reading
    the table) writes the tokens XLA's operations write, and its one-position step holds a
    kernel call with the vocabulary's width: the head."""
    if not _built():
        return
    cfg = dataclasses.replace(TINY.model, tie_embeddings=True)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    prompt = jnp.asarray([[3, 17, 5, 9, 21]], jnp.int32)

    def run(on: bool):
        graphdef, params = nnx.split(use_native_float(nnx.clone(model), on))
        step = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
        return (np.asarray(generate(graphdef, params, prompt, 8, jax.random.key(0))),
                step.lower(params, prompt[:, :1]).as_text())

    (on, text_on), (off, text_off) = run(True), run(False)
    np.testing.assert_array_equal(on, off)
    head = re.compile(rf"@{native_float.TARGET}\(.*-> tensor<1x{cfg.vocab_size}xf32>")
    assert head.search(text_on) and not head.search(text_off)
