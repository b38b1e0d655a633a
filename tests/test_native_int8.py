"""shardq's int8 kernels for few-row products (quant/native_int8.py, quant/native/int8_matvec.cc)
against XLA's operations for the same products. The per-token w8a8 product: the same float32
result, bit for bit, whatever the shapes (rows shorter than a vector, tails of the vectors and
of the threads' chunks), the rows, the scales (per channel or per tensor) and the values (zero
rows, NaN, the int8 extremes, -128 included). The weight-only products (one scale per row, or
per block of a row): equal to float32 rounding. One call for several kernels that read the same
rows: each kernel's result as its own call gives it, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import native_build
from quant import native_int8
from quant.dense import (
    QuantDense,
    blocked_weight_only_product,
    blocked_weight_only_product_fast,
    token_product,
    token_product_fast,
    use_grouped,
    use_native,
    weight_only_product,
    weight_only_product_fast,
)
from tests.helpers import native_kernel_built


def _built() -> bool:
    return native_kernel_built(native_int8.status())


def _operands(rng, rows, n, k, per_tensor=False):
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 30.0, (rows, 1))).astype(np.float32)
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    ws = rng.uniform(1e-4, 1e-2, (1, 1 if per_tensor else n)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(ws)


def _uses_kernel(fn, *args, target=native_int8.TARGET) -> bool:
    return target in jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("rows,n,k", [(1, 576, 576), (1, 1536, 576), (1, 576, 1536),
                                      (1, 49152, 64), (3, 4100, 96), (8, 5, 33), (2, 7, 1),
                                      (1, 130, 1000)])
def test_kernel_matches_xla_products_bit_for_bit(rows, n, k):
    if not _built():
        return
    x, w, ws = _operands(np.random.default_rng(rows * n + k), rows, n, k)
    assert _uses_kernel(token_product_fast, x, w, ws)
    assert not _uses_kernel(token_product, x, w, ws)  # the control: XLA's own operations
    got = np.asarray(jax.jit(token_product_fast)(x, w, ws))
    want = np.asarray(jax.jit(token_product)(x, w, ws))
    np.testing.assert_array_equal(got, want)


def test_kernel_matches_on_a_per_tensor_scale_and_extreme_values():
    if not _built():
        return
    rng = np.random.default_rng(1)
    x, w, ws = _operands(rng, 4, 64, 96, per_tensor=True)
    # -128 too: the kernel takes any int8 weight (the activations' values lie in -127..127)
    w = w.at[:, :8].set(127).at[:, 8:16].set(-127).at[:, 16:48].set(-128)
    x = x.at[1].set(0.0)  # an all-zero row: scale 1, every product 0
    x = x.at[2, 5].set(jnp.nan)  # a NaN row stays NaN
    x = x.at[3, 7].set(1e30)  # one huge value: the rest of its row rounds to 0
    got = np.asarray(jax.jit(token_product_fast)(x, w, ws))
    want = np.asarray(jax.jit(token_product)(x, w, ws))
    np.testing.assert_array_equal(got, want)
    assert (got[1] == 0).all() and np.isnan(got[2]).all()


def test_many_rows_stay_with_xla_and_a_changed_product_is_caught():
    if not _built():
        return
    x, w, ws = _operands(np.random.default_rng(2), native_int8.MAX_ROWS + 1, 64, 64)
    assert not _uses_kernel(token_product_fast, x, w, ws)  # a GEMM: XLA's
    x1 = x[:1]
    got = np.asarray(jax.jit(token_product_fast)(x1, w, ws))
    # One weight changed by one step moves the result: the comparison above can fail.
    other = np.asarray(jax.jit(token_product)(x1, w.at[0, 0].add(1), ws))
    assert not np.array_equal(got, other)


def test_quant_dense_routes_by_its_switch_and_agrees():
    if not _built():
        return
    rng = np.random.default_rng(3)
    _, w, ws = _operands(rng, 1, 48, 40)
    dense = QuantDense(w, ws, kernel_axes=(None, None), compute_dtype="float32")
    x = jnp.asarray(rng.standard_normal((1, 1, 40)).astype(np.float32))
    assert _uses_kernel(lambda v: dense(v), x)
    on = np.asarray(dense(x))
    use_native(dense, False)
    assert not _uses_kernel(lambda v: dense(v), x)
    np.testing.assert_array_equal(on, np.asarray(dense(x)))


def test_a_failed_build_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDQ_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        native_build.build(native_int8.SOURCE, ["false"])  # a "compiler" that always fails
    assert list(tmp_path.rglob("*.so")) == []  # nothing half-written is left


@pytest.mark.parametrize("rows,n,k", [(1, 1536, 576), (3, 4100, 96), (8, 5, 33)])
def test_weight_only_kernel_matches_xla_to_float_rounding(rows, n, k):
    if not _built():
        return
    x, w, ws = _operands(np.random.default_rng(rows + n + k), rows, n, k)
    w8 = native_int8.TARGET_W8
    assert _uses_kernel(weight_only_product_fast, x, w, ws, target=w8)
    assert not _uses_kernel(weight_only_product, x, w, ws, target=w8)
    got = np.asarray(jax.jit(weight_only_product_fast)(x, w, ws))
    want = np.asarray(jax.jit(weight_only_product)(x, w, ws))
    # the same products summed in another order: float32 rounding of the largest sums
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    other = np.asarray(jax.jit(weight_only_product)(x, w.at[0, 0].add(1), ws))
    assert np.abs(other - want).max() > 1e-6 * np.abs(want).max()  # the tolerance can fail


@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rows,n,k,blocks", [(1, 4100, 576, 18), (3, 130, 640, 20),
                                             (2, 9, 96, 3), (1, 7, 60, 5)])
def test_block_scaled_weight_only_kernel_matches_xla(rows, n, k, blocks, scale_dtype):
    """One scale per block of k / blocks weights of a row (an int8 embedding table's, as the
    tied head multiplies by it), in float32 or float16 (as a table's blocks store them, read by
    the kernel as they are); blocks of 12 run the kernel's plain C++ path."""
    if not _built():
        return
    rng = np.random.default_rng(rows + n + k)
    x, w, _ = _operands(rng, rows, n, k)
    ws = jnp.asarray(rng.uniform(1e-4, 1e-2, (n, blocks)).astype(scale_dtype))
    w8 = native_int8.TARGET_W8
    assert _uses_kernel(blocked_weight_only_product_fast, x, w, ws, target=w8)
    # float16 scales reach the kernel as they are stored: no conversion before the call
    direct = jax.jit(native_int8.product_weight_only).lower(x, w, ws).as_text()
    assert "stablehlo.convert" not in direct
    got = np.asarray(jax.jit(blocked_weight_only_product_fast)(x, w, ws))
    want = np.asarray(jax.jit(blocked_weight_only_product)(x, w, ws))
    tol = 1e-6 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    # Controls: the scales of one block of row 0 changed, and the blocks' scales of each row
    # reversed, move the result beyond the tolerance.
    for other_ws in (ws.at[0, blocks - 1].multiply(1.5), ws[:, ::-1]):
        other = np.asarray(jax.jit(blocked_weight_only_product)(x, w, other_ws))
        assert np.abs(other - want).max() > tol


# Kernels that read the same rows, of widths that split the group's chunks unevenly (not
# multiples of 4; one below the size worth waking another thread for), per-channel and
# per-tensor scales.
GROUP_WIDTHS = [(576, False), (190, False), (7, True), (1536, False)]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("weight_only", [False, True])
def test_one_call_for_several_kernels_gives_each_kernels_own_result(rows, weight_only):
    if not _built():
        return
    rng = np.random.default_rng(rows + 10 * weight_only)
    k = 576
    x = _operands(rng, rows, 1, k)[0]
    kernels = [_operands(rng, rows, n, k, per_tensor)[1:] for n, per_tensor in GROUP_WIDTHS]
    group, one, target = ((native_int8.product_weight_only_group, native_int8.product_weight_only,
                           native_int8.TARGET_W8_GROUP) if weight_only else
                          (native_int8.product_group, native_int8.product,
                           native_int8.TARGET_GROUP))
    assert _uses_kernel(group, x, kernels, target=target)
    got = jax.jit(group)(x, kernels)
    for (w, ws), y in zip(kernels, got, strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(one)(x, w, ws)))
    # The control: the group's results are told apart (each kernel's output is its own).
    assert not np.array_equal(np.asarray(got[0]), np.asarray(jax.jit(one)(x, *kernels[3])[:, :576]))


@pytest.mark.parametrize("act", ["token", "none"])
def test_layers_reading_one_input_run_as_one_call_with_their_own_results(act):
    """`QuantDense.shared_call` (what `model.layers.shared_input` calls for an attention's q, k
    and v): one kernel call, each layer's result bit for bit, biases and leading axes kept; a
    layer that cannot join (an outlier split) sends the group back to one call each."""
    if not _built():
        return
    from model.layers import shared_input

    rng = np.random.default_rng(5)
    layers = [QuantDense(*_operands(rng, 1, n, 96, per_tensor)[1:], kernel_axes=(None, None),
                         compute_dtype="float32", act=act,
                         bias=jnp.asarray(rng.standard_normal(n).astype(np.float32)))
              for n, per_tensor in [(64, False), (20, True), (20, False)]]
    x = jnp.asarray(rng.standard_normal((1, 2, 96)).astype(np.float32))
    target = native_int8.TARGET_W8_GROUP if act == "none" else native_int8.TARGET_GROUP
    def grouped(v):  # traced anew at each use: the switches below are read at trace time
        return shared_input(v, *layers)

    assert _uses_kernel(grouped, x, target=target)
    got = jax.jit(grouped)(x)
    alone = [jax.jit(lambda v, layer=layer: layer(v))(x) for layer in layers]
    for y, want in zip(got, alone, strict=True):
        assert y.shape == want.shape
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    for layer in layers:
        use_grouped(layer, False)
    assert not _uses_kernel(lambda v: grouped(v), x, target=target)  # the switch: one each
    for layer in layers:
        use_grouped(layer, True)
    layers[1].outlier_threshold = 6.0
    assert not _uses_kernel(lambda v: grouped(v), x, target=target)
