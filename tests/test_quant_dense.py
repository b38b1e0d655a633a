"""int8 inference (quant/), the layer: quantiser bounds, the int8 Dense against its float twin,
the compiled integer dot, and the outlier split inside one product.

References: the rounding bound s/2 of symmetric absmax quantisation, a float re-computation of
the int8 product from the dequantised operands, the float Dense with the same kernel, and a
masked LLM.int8() written in the test.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.layers import Dense
from quant import quantizers as qz
from quant.convert import QuantConfig, QuantError, make_plan
from quant.dense import QuantDense, int8_matmul, int8_matmul_t, quantized_product
from quant.pipeline import quantize
from tests.hlo_checks import float_dot_widths, int8_dots
from tests.quant_models import CFG, calibration_batches, tiny_float_model


@pytest.fixture(scope="module")
def float_model():
    return tiny_float_model()


@pytest.fixture(scope="module")
def batches():
    return calibration_batches()


# --- quantisers ------------------------------------------------------------------------------

def adversarial_matrices():
    rng = np.random.default_rng(0)
    plain = rng.normal(size=(64, 48)).astype(np.float32)
    outlier_cols = plain.copy()
    outlier_cols[:, 3] *= 1000.0
    zero_channel = plain.copy()
    zero_channel[:, 5] = 0.0
    zero_channel[7, :] = 0.0
    huge = (plain * np.logspace(-30, 30, 48, dtype=np.float64)[None, :]).astype(np.float32)
    return {"plain": plain, "outlier_cols": outlier_cols, "zero_channel": zero_channel,
            "huge_range": huge, "all_zero": np.zeros_like(plain)}


@pytest.mark.parametrize("name", list(adversarial_matrices()))
@pytest.mark.parametrize("kind", ["channel", "token", "tensor"])
def test_round_trip_within_half_a_step(name, kind):
    x = jnp.asarray(adversarial_matrices()[name])
    scale = {"channel": lambda: qz.weight_scale(x, "channel"),  # [1, out], reduces rows
             "token": lambda: qz.token_scale(x),  # [rows, 1]
             "tensor": lambda: qz.tensor_scale(x)}[kind]()
    q = qz.quantize(x, scale)
    back = qz.dequantize(q, scale)
    assert q.dtype == jnp.int8 and bool(jnp.all(jnp.abs(q.astype(jnp.int32)) <= 127))
    assert bool(jnp.all(jnp.isfinite(scale))) and bool(jnp.all(scale > 0))
    assert bool(jnp.all(jnp.isfinite(back)))
    # The symmetric absmax bound: |x - deq(q(x))| <= s/2 elementwise (plus float rounding).
    bound = jnp.broadcast_to(scale, x.shape) * (0.5 + 1e-5)
    assert bool(jnp.all(jnp.abs(back - x) <= bound))
    if name == "plain":  # relative error of a well-behaved matrix is small
        rel = float(jnp.linalg.norm(back - x) / jnp.linalg.norm(x))
        assert rel < {"channel": 0.01, "token": 0.01, "tensor": 0.012}[kind]


def test_stacked_weights_get_scales_per_layer_and_channel():
    w = jax.random.normal(jax.random.key(0), (3, 16, 8)) * jnp.arange(1.0, 4.0)[:, None, None]
    assert qz.weight_scale(w).shape == (3, 1, 8)
    assert qz.weight_scale(w, "tensor").shape == (3, 1, 1)
    np.testing.assert_allclose(qz.weight_scale(w)[2], jnp.max(jnp.abs(w[2]), 0, keepdims=True)
                               / 127, rtol=1e-6)


def test_clipping_search_never_worse_than_absmax():
    w = jnp.asarray(adversarial_matrices()["outlier_cols"])
    w = w.at[0, :].multiply(30.0)  # one large weight per channel: clipping pays off there
    mse = lambda s: float(jnp.mean(jnp.square(qz.round_trip(w, s) - w)))
    plain, clipped = qz.weight_scale(w), qz.clipped_weight_scale(w)
    assert mse(clipped) <= mse(plain)
    assert bool(jnp.all(clipped <= plain + 1e-12))


# --- the int8 Dense --------------------------------------------------------------------------

def dense_pair(act, in_f=64, out_f=48, **kw):
    dense = Dense(in_f, out_f, axes=("embed", "mlp"), rngs=nnx.Rngs(3))
    w = dense.kernel[...]
    s = qz.weight_scale(w)
    qd = QuantDense(qz.quantize(w, s).T, s, kernel_axes=("embed", "mlp"),
                    compute_dtype="float32", act=act,
                    act_scale=jnp.asarray(4.0 / 127) if act == "static" else None, **kw)
    return dense, qd


@pytest.mark.parametrize("act,tol", [("none", 0.01), ("token", 0.02), ("tensor", 0.03),
                                     ("static", 0.03)])
def test_quant_dense_close_to_float_twin(act, tol):
    dense, qd = dense_pair(act)
    x = jax.random.normal(jax.random.key(1), (2, 5, 64))
    y, yq = dense(x), qd(x)
    assert yq.shape == y.shape and yq.dtype == y.dtype
    assert float(jnp.linalg.norm(yq - y) / jnp.linalg.norm(y)) < tol


def test_int8_product_is_exact_integer_arithmetic():
    """The int32 accumulation equals the float product of the dequantised operands."""
    x = jax.random.normal(jax.random.key(2), (16, 256)) * 3
    w = jax.random.normal(jax.random.key(3), (256, 32))
    s_w = qz.weight_scale(w)
    w_q = qz.quantize(w, s_w)
    s_x = qz.token_scale(x)
    ref = np.asarray(qz.quantize(x, s_x), np.float64) @ np.asarray(w_q, np.float64)
    ref = ref * np.asarray(s_x) * np.asarray(s_w)
    # The product reads the kernel stored [out, in] (QuantDense's layout).
    np.testing.assert_allclose(quantized_product(x, w_q.T, s_w, "token"), ref, rtol=1e-5,
                               atol=1e-5)


def test_zero_rows_and_channels_do_not_divide_by_zero():
    _, qd = dense_pair("token")
    x = jnp.zeros((4, 64)).at[1].set(1.0)
    y = qd(x)
    assert bool(jnp.all(jnp.isfinite(y))) and bool(jnp.all(y[0] == 0))


def test_compiled_program_has_an_s8_dot_with_s32_accumulator():
    _, qd = dense_pair("token")
    graphdef, state = nnx.split(qd)
    fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
    x = jnp.ones((16, 64))  # more rows than quant.native_int8.MAX_ROWS: XLA's own int8 GEMM
    assert int8_dots(fn.lower(state, x).compile().as_text())
    # ... and weight-only mode does not pretend to (its product is float).
    _, w8 = dense_pair("none")
    graphdef, state = nnx.split(w8)
    assert not int8_dots(jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
                         .lower(state, x).compile().as_text())


@pytest.mark.parametrize("stored", ["out_in", "in_out"])
def test_a_one_token_int8_product_stays_int8_and_exact(stored):
    """Batch-1 decoding multiplies one row. XLA:CPU compiles a 1-row s8 dot by converting the
    whole int8 kernel to s32 first (9 bytes moved per weight instead of 1): `int8_matmul_t`
    (QuantDense's kernel, stored [out, in]) and `int8_matmul` ([in, out]) pad the row so the
    compiled program keeps an s8 x s8 dot and never widens the kernel."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-127, 128, (1, 64)), jnp.int8)
    w = jnp.asarray(rng.integers(-127, 128, (64, 96)), jnp.int8)
    want = np.asarray(x, np.int64) @ np.asarray(w, np.int64)
    fn, kernel = (int8_matmul_t, w.T) if stored == "out_in" else (int8_matmul, w)
    np.testing.assert_array_equal(np.asarray(fn(x, kernel)), want)
    hlo = jax.jit(fn).lower(x, kernel).compile().as_text()
    shape = ",".join(map(str, kernel.shape))
    widened = [ln for ln in hlo.splitlines() if re.search(rf"= s32\[{shape}\]", ln)]
    assert not widened, widened
    assert f"s8[{shape}]" in hlo


def test_quantized_model_compiles_to_int8_dots_in_the_layer_scan(float_model, batches):
    graphdef, params = float_model
    g, q, plan, _ = quantize(graphdef, params, QuantConfig(mode="w8a8"), batches[:1])
    hlo = jax.jit(lambda p, t: nnx.merge(g, p)(t)).lower(q, batches[0][:, :-1]).compile()
    assert len(int8_dots(hlo.as_text())) >= 6  # q, k, v, o, up, down


def test_outlier_columns_go_through_float():
    _, plain = dense_pair("token")
    _, split = dense_pair("token", outlier_threshold=6.0)
    dense, _ = dense_pair("none")
    x = jax.random.normal(jax.random.key(4), (32, 64)).at[:, 7].multiply(200.0)
    err = lambda y: float(jnp.linalg.norm(y - dense(x)) / jnp.linalg.norm(dense(x)))
    assert err(split(x)) < 0.5 * err(plain(x))


def masked_llm_int8(x, w_q, w_scale, threshold):
    """Reference LLM.int8() with no capacity limit: every column over the threshold in float
    (w_q stored [out, in])."""
    outlier = jnp.max(jnp.abs(x), axis=0, keepdims=True) >= threshold
    regular = quantized_product(jnp.where(outlier, 0.0, x), w_q, w_scale, "token")
    return regular + jnp.where(outlier, x, 0.0) @ (w_q.T.astype(jnp.float32) * w_scale)


@pytest.mark.parametrize("n_outliers", [0, 1, 4])
def test_gathered_outlier_columns_match_the_masked_reference(n_outliers):
    """Capacity 4 of 64 columns: the gathered float product equals the full masked one."""
    _, split = dense_pair("token", outlier_threshold=6.0, outlier_capacity=4)
    x = jax.random.normal(jax.random.key(5), (32, 64))
    for c in (3, 17, 40, 63)[:n_outliers]:
        x = x.at[:, c].multiply(100.0)
    ref = masked_llm_int8(x, split.kernel_q[...], split.kernel_scale[...].reshape(1, -1), 6.0)
    np.testing.assert_allclose(split(x), ref, rtol=1e-5, atol=1e-4)


def test_outliers_beyond_capacity_stay_int8():
    """Capacity 1, two outlier columns: the larger (7) in float, the other (9) through int8."""
    dense, _ = dense_pair("none")
    _, one = dense_pair("token", outlier_threshold=6.0, outlier_capacity=1)
    _, plain = dense_pair("token")
    x = jax.random.normal(jax.random.key(6), (32, 64)).at[:, 7].multiply(300.0)
    x = x.at[:, 9].multiply(100.0)
    w_q, w_scale = one.kernel_q[...], one.kernel_scale[...].reshape(1, -1)
    ref = quantized_product(x.at[:, 7].set(0.0), w_q, w_scale, "token") \
        + x[:, 7:8] @ (w_q[:, 7:8].T.astype(jnp.float32) * w_scale)
    y = one(x)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-3)
    err = lambda v: float(jnp.linalg.norm(v - dense(x)) / jnp.linalg.norm(dense(x)))
    assert err(y) < err(plain(x))


def test_float_side_of_the_outlier_split_is_capacity_wide(float_model):
    """The plan sizes the float product (1/16 of the inputs by default) and the compiled layer
    multiplies only that many columns in float, beside the full-width int8 dot."""
    graphdef, params = float_model
    plan = make_plan(QuantConfig(mode="w8a8-outlier"), nnx.merge(graphdef, params))
    assert plan["blocks/mlp/down"]["outlier_capacity"] == -(-CFG.d_ff // 16)
    _, split = dense_pair("token", outlier_threshold=6.0, outlier_capacity=4)
    g, state = nnx.split(split)
    hlo = jax.jit(lambda st, x: nnx.merge(g, st)(x)).lower(state, jnp.ones((16, 64))).compile()
    assert float_dot_widths(hlo.as_text()) == [4] and int8_dots(hlo.as_text())


@pytest.mark.parametrize("act", ["token", "tensor", "static"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_activation_stays_nonfinite(act, bad):
    """As in float: a NaN/inf in a token's input makes that token's output non-finite (and with
    a per-tensor scale every token's), rather than rounding away into an int8 value."""
    dense, qd = dense_pair(act)
    x = jax.random.normal(jax.random.key(7), (4, 64)).at[2, 5].set(bad)
    y, ref = np.asarray(qd(x)), np.asarray(dense(x))
    assert not np.all(np.isfinite(ref[2])) and not np.all(np.isfinite(y[2]))
    others = np.isfinite(y[[0, 1, 3]])
    assert not np.any(others) if act == "tensor" else np.all(others)



# --- the int8 embedding table ----------------------------------------------------------------

@pytest.mark.parametrize("scale_dtype", ["float32", "float16"])
def test_block_scaled_table_rounds_each_block_and_its_head_multiplies_by_it(scale_dtype):
    """A table whose rows mix a large-valued block with small ones: one scale per block of 32
    (stored in float32 or float16) keeps every value within half its block's step (per-row
    scales lose the small blocks); the lookup is the dequantised rows and the tied head the
    product with the dequantised table, in XLA's operations and in shardq's kernel alike."""
    from model.layers import Embed
    from quant.convert import quantize_embed

    embed = Embed(100, 96, rngs=nnx.Rngs(0))
    table = np.asarray(embed.embedding[...]) * 0.01
    table[:, :32] *= 100.0  # the first block of every row is 100x the others
    embed.embedding[...] = jnp.asarray(table)
    blocked = quantize_embed(embed, "token", 32, scale_dtype)
    per_row = quantize_embed(embed, "token", None)
    assert blocked.block_scale[...].shape == (100, 3) and blocked.act == "none"
    assert blocked.block_scale[...].dtype == jnp.dtype(scale_dtype)
    scale = np.repeat(np.asarray(blocked.block_scale[...], np.float32), 32, axis=1)
    deq = np.asarray(blocked.embedding_q[...], np.float32) * scale
    assert np.all(np.abs(deq - table) <= 0.5 * scale * (1 + 1e-6))
    row_err = np.abs(np.asarray(per_row(jnp.arange(100))) - table)[:, 32:].max()
    assert np.abs(deq - table)[:, 32:].max() < 0.05 * row_err
    tokens = jnp.asarray([[3, 99, 0]])
    np.testing.assert_array_equal(np.asarray(blocked(tokens))[0], deq[[3, 99, 0]])
    x = jax.random.normal(jax.random.key(1), (1, 2, 96))
    want = np.asarray(x) @ deq.T
    for native in (False, True):
        blocked.native = native
        np.testing.assert_allclose(np.asarray(blocked.attend(x)), want, rtol=0,
                                   atol=1e-5 * np.abs(want).max())


def test_float16_block_scales_hold_a_q8_0_table_exactly_and_keep_tiny_blocks(float_model):
    """Block scales in float16, as the default plan stores them (GGUF Q8_0's): a table already
    on a float16-scaled int8 grid (a Q8_0 file's) comes back exactly; a block below float16's
    normal range quantises on its smallest normal step, to within half of it; a zero row stays
    zero; and the plan refuses a table whose scales float16 cannot hold."""
    from model.layers import Embed
    from quant.convert import QuantError, quantize_embed

    rng = np.random.default_rng(0)
    d = rng.uniform(1e-3, 1e-2, (4, 2)).astype(np.float16)  # Q8_0's block scales
    q = rng.integers(-127, 128, (4, 2, 32)).astype(np.int8)
    q[:, :, 0] = 127  # each block spans its full range, so its absmax is 127 d
    table = (q.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(4, 64)
    table[2] = 0.0
    table[3, :32] = rng.uniform(-1e-3, 1e-3, 32)  # absmax / 127 below float16's normal range
    embed = Embed(4, 64, rngs=nnx.Rngs(0))
    embed.embedding[...] = jnp.asarray(table)
    got = quantize_embed(embed, "none", 32, "float16")
    scale = np.asarray(got.block_scale[...], np.float32)
    deq = np.asarray(got(jnp.arange(4)[None]))[0]
    np.testing.assert_array_equal(deq[:2], table[:2])
    np.testing.assert_array_equal(scale[:2], d[:2].astype(np.float32))
    assert not np.any(deq[2]) and np.all(scale >= qz.HALF_MIN)
    assert scale[3, 0] == np.float32(qz.HALF_MIN)
    assert np.abs(deq[3, :32] - table[3, :32]).max() <= 0.5 * qz.HALF_MIN
    np.testing.assert_array_equal(deq[3, 32:], table[3, 32:])

    graphdef, params = float_model
    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
    plan = make_plan(QuantConfig(mode="w8a8"), model)
    assert plan["embed"]["block"] == 32 and plan["embed"]["scale_dtype"] == "float16"
    model.embed.embedding[...] = model.embed.embedding[...].at[0, 0].set(1e7)
    with pytest.raises(QuantError, match="embed: a value of 1e[+]07 needs a block scale"):
        make_plan(QuantConfig(mode="w8a8"), model)


def test_a_model_stored_for_decoding_is_refused_with_its_layer_named(float_model):
    """Quantisation reads a Dense kernel as [in, out]; after use_native_float (decoding) a float
    kernel is stored [out, in], and planning any model with such a layer names it instead of
    quantising (or smoothing) the transpose. Switched back, the same model plans."""
    from model.layers import use_native_float

    model = nnx.merge(*float_model)
    qcfg = QuantConfig(mode="w8a8")
    use_native_float(model, True)
    with pytest.raises(QuantError, match=r"blocks/.*stored for decoding"):
        make_plan(qcfg, model)
    # rules that leave the block layers float still refuse: smoothing would scale them
    with pytest.raises(QuantError, match=r"blocks/.*stored for decoding"):
        make_plan(QuantConfig(mode="smoothquant", rules=("head",)), model)
    use_native_float(model, False)
    assert make_plan(qcfg, model)
