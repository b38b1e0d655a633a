"""int8 inference (quant/): quantiser bounds, int8 Dense vs float, the compiled integer dot,
SmoothQuant folding, outliers, automatic precision, the int8 checkpoint, generation, bad input.

References: the float model (same parameters), the rounding bound s/2 of symmetric absmax
quantisation, a float re-computation of the int8 product from the dequantised operands, the
float model's greedy tokens (trained tiny model), and plain w8a8 where SmoothQuant or the
outlier split must differ from it.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from experiments.pretrained import divergence
from model import DecoderLM
from model.cached_attention import CACHE_BLOCK
from model.flops import param_bytes
from model.generate import default_per_layer, generate
from model.layers import Dense
from parallel.mesh import make_mesh
from quant import alpha_search
from quant import checkpoint as qckpt
from quant import quantizers as qz
from quant.alpha_search import ALPHA_GRID
from quant.calibrate import calibrate
from quant.convert import QuantConfig, QuantError, apply_plan, make_plan, quantized_fraction
from quant.dense import QuantDense, int8_matmul, int8_matmul_t, quantized_product
from quant.kv_cache import init_int8_cache
from quant.pipeline import dense_bytes, quantize
from quant.rotation import rotate_kernel
from quant.smoothquant import fold
from tests.helpers import TINY, run_steps, synthetic_batches

CFG = TINY.model


@pytest.fixture(scope="module")
def float_model():
    graphdef, state = nnx.split(DecoderLM(CFG, rngs=nnx.Rngs(0)))
    return graphdef, jax.device_get(nnx.to_pure_dict(state))


@pytest.fixture(scope="module")
def batches():
    """Three calibration batches and a held-out one (the last), [4, max_len + 1] tokens each."""
    return [b[0] for b in synthetic_batches(4, 1, 4, CFG.max_len, seed=1)]


def logits(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(jnp.asarray(tokens))


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


def int8_dots(hlo: str) -> list[str]:
    """dot instructions of a compiled HLO text with s32 results and two s8 operands."""
    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
    found = []
    for line in hlo.splitlines():
        m = re.search(r"(%[\w.\-]+) = s32\[[^\]]*\]\S* dot\((%[\w.\-]+), (%[\w.\-]+)\)", line)
        if m and types.get(m.group(2)) == "s8" and types.get(m.group(3)) == "s8":
            found.append(line.strip())
    return found


def float_dot_widths(hlo: str) -> list[int]:
    """Contracted length of every f32 dot in a compiled HLO text."""
    shapes = {n: [int(d) for d in dims.split(",") if d]
              for n, dims in re.findall(r"(%[\w.\-]+) = \w+\[([\d,]*)\]", hlo)}
    widths = []
    for lhs, dim in re.findall(r"= f32\[[^\]]*\]\S* dot\((%[\w.\-]+), %[\w.\-]+\), "
                               r"lhs_contracting_dims=\{(\d+)\}", hlo):
        widths.append(shapes[lhs][int(dim)])
    return widths


def test_compiled_program_has_an_s8_dot_with_s32_accumulator():
    _, qd = dense_pair("token")
    graphdef, state = nnx.split(qd)
    fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
    x = jnp.ones((8, 64))
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
    hlo = jax.jit(lambda st, x: nnx.merge(g, st)(x)).lower(state, jnp.ones((8, 64))).compile()
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


# --- SmoothQuant, calibration, automatic precision --------------------------------------------

def test_smoothquant_folding_leaves_the_float_function_unchanged(float_model, batches):
    graphdef, params = float_model
    stats = calibrate(graphdef, params, batches[:2])
    model = nnx.merge(graphdef, params)
    factors = fold(model, stats["absmax"], alpha=0.5)
    assert any(abs(np.log(np.asarray(f))).max() > 0.1 for f in factors.values())  # it did move
    folded = nnx.to_pure_dict(nnx.state(model))
    tokens = batches[-1][:, :-1]
    ref = logits(graphdef, params, tokens)
    np.testing.assert_allclose(logits(graphdef, folded, tokens), ref, rtol=1e-4, atol=1e-4)
    # The folded inputs are flatter across channels than the raw ones (what smoothing is for).
    after = calibrate(graphdef, folded, batches[:2])["absmax"]["blocks/attn/q"]
    before = stats["absmax"]["blocks/attn/q"]
    spread = lambda a: float(np.mean(a.max(-1) / np.maximum(a.mean(-1), 1e-9)))
    assert spread(after) < spread(before)


@pytest.mark.parametrize("mode", ["w8", "w8a8-tensor", "w8a8", "w8a8-static", "smoothquant",
                                  "w8a8-outlier", "auto", "w8a8-rotated"])
def test_every_mode_tracks_the_float_model(float_model, batches, mode):
    graphdef, params = float_model
    g, q, plan, report = quantize(graphdef, params, QuantConfig(mode=mode), batches[:2])
    tokens = batches[-1][:, :-1]
    ref, out = logits(graphdef, params, tokens), logits(g, q, tokens)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert rel < 0.02, rel
    assert report["layers"] and all(r["rel_err"] < 0.05 for r in report["layers"])
    qb, fb = dense_bytes(q, plan)
    assert qb / fb < 0.29  # d=32: 4 scale bytes per 32 int8 bytes; 0.258 at d=128
    assert 0.5 < quantized_fraction(params, plan) < 1
    if QuantConfig(mode=mode).smooth:
        assert_smoothed(params, q)
    # w8a8-outlier: this model has no input column over the threshold (its outputs equal
    # w8a8's); test_outlier_split_takes_planted_columns_out_of_the_int8_product plants some.


def test_the_byte_tables_divergence_matches_a_float64_recomputation(float_model, batches):
    """quant_table's distance from float (experiments/pretrained/divergence.py) over validation
    batches: KL(float || int8) and top-1 agreement per position equal a float64 NumPy recomputation
    from both models' logits; the float model against itself diverges by nothing."""
    graphdef, params = float_model
    g, q, _, _ = quantize(graphdef, params, QuantConfig(mode="w8a8"), batches[:2])
    val = [batches[-1]]
    diverge = divergence.make_batch_divergence_fn(g, graphdef, make_mesh(1), val)
    got = diverge(q, params)
    tokens = batches[-1][:, :-1]
    logq, logp = (np.asarray(jax.nn.log_softmax(logits(gd, pr, tokens)), np.float64)
                  for gd, pr in ((g, q), (graphdef, params)))
    kl = np.sum(np.exp(logp) * (logp - logq), axis=-1).ravel()
    assert kl.size == tokens.size and got["reference"] == "none"
    # two programs compiled apart: a last-bit tie may flip one position's argmax
    assert got["top1_agree"] == pytest.approx(np.mean(logp.argmax(-1) == logq.argmax(-1)),
                                              abs=1.5 / kl.size)
    for key, value in (("kl_mean", kl.mean()), ("kl_median", np.median(kl)),
                       ("kl_p99", np.percentile(kl, 99)), ("kl_max", kl.max())):
        assert got[key] == pytest.approx(value, rel=1e-3, abs=1e-7), key
    assert got["kl_mean"] > 0
    same = divergence.make_batch_divergence_fn(graphdef, graphdef, make_mesh(1), val)(
        params, params)
    assert same["top1_agree"] == 1.0 and abs(same["kl_max"]) <= 1e-6


@pytest.mark.parametrize("mode", ["smoothquant", "auto"])
def test_alpha_is_searched_unless_one_is_given(float_model, batches, mode):
    """By default the pipeline folds one alpha per layer and site (the report says which) and
    the int8 model tracks float; `alpha=0.5` folds the paper's one alpha instead (nothing
    searched, other factors). The search's own choice is tested against the int8 Dense in
    tests/test_smollm2.py."""
    graphdef, params = float_model
    g, q, plan, report = quantize(graphdef, params, QuantConfig(mode=mode), batches[:2],
                                  error_report=False)
    assert set(report["alpha"]) == {"blocks/attn_norm", "blocks/mlp_norm", "blocks/attn/o"}
    assert all(len(v) == CFG.n_layers and set(v) <= set(ALPHA_GRID)
               for v in report["alpha"].values())
    tokens = batches[-1][:, :-1]
    ref, out = logits(graphdef, params, tokens), logits(g, q, tokens)
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 0.02
    assert_smoothed(params, q)

    _, fixed, _, fixed_report = quantize(graphdef, params, QuantConfig(mode=mode, alpha=0.5),
                                         batches[:2], error_report=False)
    assert "alpha" not in fixed_report
    assert_smoothed(params, fixed)
    expected = fold(nnx.merge(graphdef, params),
                    calibrate(graphdef, params, batches[:2])["absmax"], alpha=0.5)
    s = np.asarray(params["blocks"]["mlp_norm"]["scale"]) / np.asarray(
        fixed["blocks"]["mlp_norm"]["scale"])
    np.testing.assert_allclose(s, np.asarray(expected["blocks/mlp_norm"]), rtol=1e-5)
    searched_s = np.asarray(params["blocks"]["mlp_norm"]["scale"]) / np.asarray(
        q["blocks"]["mlp_norm"]["scale"])
    if set(report["alpha"]["blocks/mlp_norm"]) != {0.5}:  # the search chose otherwise somewhere
        assert not np.allclose(searched_s, s, rtol=1e-5)


def test_the_search_joins_calibration_batches_of_one_shape(monkeypatch):
    """Fewer, larger calls (quant/alpha_search.py: MERGE_TOKENS): consecutive batches of one
    row shape are joined in order, up to the cap; a batch of another shape starts a new one."""
    monkeypatch.setattr(alpha_search, "MERGE_TOKENS", 40)
    rows = [np.full((2, 9), i) for i in range(3)] + [np.full((1, 5), 7), np.full((1, 5), 8)]
    merged = alpha_search._merged(rows)
    assert [m.shape for m in merged] == [(4, 9), (2, 9), (2, 5)]
    np.testing.assert_array_equal(np.concatenate([m.ravel() for m in merged]),
                                  np.concatenate([r.ravel() for r in rows]))


def test_configs_written_with_the_alpha_search_flag_still_load():
    """Before alpha=None meant "searched", a stored quant_config had `alpha_search`."""
    old = {**QuantConfig(mode="smoothquant").to_json(), "alpha": 0.5}
    assert QuantConfig.from_json({**old, "alpha_search": True}).alpha is None
    assert QuantConfig.from_json({**old, "alpha_search": False}).alpha == 0.5
    assert QuantConfig.from_json({**old, "alpha": 0.7, "alpha_search": False}).alpha == 0.7
    w8a8 = {**QuantConfig(mode="w8a8").to_json(), "alpha": 0.5}  # every mode stored one then
    assert QuantConfig.from_json(w8a8).alpha is None
    QuantConfig.from_json(w8a8).validate()
    with pytest.raises(QuantError, match=r"alpha=1.5: must be in \[0, 1\]"):
        QuantConfig(mode="smoothquant", alpha=1.5).validate()
    with pytest.raises(QuantError, match="alpha=0.5: only for the modes that smooth "
                                         r"\(smoothquant, auto\), not w8a8"):
        QuantConfig(mode="w8a8", alpha=0.5).validate()


@pytest.mark.parametrize("mode,report,reads", [
    ("w8a8", False, False), ("w8a8", True, True), ("smoothquant", False, True),
    ("w8a8-static", False, True), ("auto", False, True)])
def test_calibration_batches_are_built_once_and_only_when_a_pass_reads_them(
        float_model, batches, mode, report, reads):
    """A caller hands quantize a recipe for its calibration batches: a mode that runs no pass
    never builds them; one that runs several (smoothquant calibrates twice, then the report)
    builds them once; the report counts what was read; the model is the same as from a list."""
    graphdef, params = float_model
    built = []

    def recipe():
        built.append(1)
        return batches[:2]

    g, q, _, rep = quantize(graphdef, params, QuantConfig(mode=mode), recipe, report)
    assert len(built) == int(reads) and rep["calib_batches"] == (2 if reads else 0)
    _, q_list, _, _ = quantize(graphdef, params, QuantConfig(mode=mode), batches[:2], report)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(q_list), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_smoothed(params, q):
    """SmoothQuant moved the norm scales by per-channel factors s and the int8 kernels the norms
    feed store diag(s) W, not W: each dequantised weight is within half a quantisation step of
    the folded one (so plain w8a8's kernels, which round W itself, would fail it)."""
    # (v is left out: its output columns also carry the v->o fold)
    for norm, (block, dense) in (("attn_norm", ("attn", "q")), ("attn_norm", ("attn", "k")),
                                 ("mlp_norm", ("mlp", "up"))):
        s = np.asarray(params["blocks"][norm]["scale"]) / np.asarray(q["blocks"][norm]["scale"])
        assert np.abs(np.log(s)).max() > 0.1  # [layers, in]: the norm scales did move
        node = q["blocks"][block][dense]
        w_scale = np.asarray(node["kernel_scale"])[:, None, :]  # [layers, 1, out]
        deq = np.swapaxes(np.asarray(node["kernel_q"], np.float32), 1, 2) * w_scale
        folded = np.asarray(params["blocks"][block][dense]["kernel"]) * s[:, :, None]
        assert np.all(np.abs(deq - folded) <= w_scale * (0.5 + 1e-4))
        plain = np.asarray(params["blocks"][block][dense]["kernel"])
        assert not np.all(np.abs(deq - plain) <= w_scale * (0.5 + 1e-4))


def test_outlier_split_takes_planted_columns_out_of_the_int8_product(float_model, batches):
    """An LLM.int8()-style outlier planted without changing the float function: channel 5 of the
    MLP norm scaled up 40x, the matching input row of blocks/mlp/up scaled down 40x. That column
    of mlp/up's input then reaches far over the threshold in every layer; w8a8's per-token scale
    is set by it, w8a8-outlier multiplies it in float. Measured: the layer's error 0.04 against
    w8a8's 0.10, the model's 0.018 against 0.045. Layers without an outlier column compute
    exactly what w8a8 computes."""
    graphdef, params = float_model
    planted = jax.tree.map(np.array, params)
    planted["blocks"]["mlp_norm"]["scale"][:, 5] *= 40.0
    planted["blocks"]["mlp"]["up"]["kernel"][:, 5, :] /= 40.0
    tokens = batches[-1][:, :-1]
    ref = np.asarray(logits(graphdef, params, tokens))
    np.testing.assert_allclose(logits(graphdef, planted, tokens), ref, rtol=1e-5, atol=1e-5)
    runs = {mode: quantize(graphdef, planted, QuantConfig(mode=mode), batches[:2])
            for mode in ("w8a8", "w8a8-outlier")}
    split, plain = ({(r["module"], r["layer"]): r for r in runs[mode][3]["layers"]}
                    for mode in ("w8a8-outlier", "w8a8"))
    for key, r in split.items():
        if key[0] == "blocks/mlp/up":
            assert r["outlier_cols_max"] >= 1 and not r["over_capacity"]
            assert r["rel_err"] < 0.6 * plain[key]["rel_err"]
        else:
            assert r["outlier_cols_max"] == 0
            assert r["rel_err"] == pytest.approx(plain[key]["rel_err"], rel=1e-6)
    err = {mode: np.linalg.norm(np.asarray(logits(*run[:2], tokens)) - ref) / np.linalg.norm(ref)
           for mode, run in runs.items()}
    assert err["w8a8-outlier"] < 0.6 * err["w8a8"]


def test_auto_keeps_over_budget_layers_in_float(float_model, batches):
    graphdef, params = float_model
    g, q, plan, report = quantize(graphdef, params,
                                  QuantConfig(mode="auto", error_budget=0.006), batches[:2])
    kept = [(r["module"], r["layer"]) for r in report["layers"] if r["precision"] == "float"]
    assert kept and all(r["rel_err"] > 0.006 for r in report["layers"]
                        if (r["module"], r["layer"]) in kept)
    # With every layer kept, the model is the (smoothed) float model with bf16-rounded kernels:
    # exactly, against that model built from the stored copies; and within bf16 rounding of the
    # original float model.
    g_all, q_all, _, _ = quantize(graphdef, params,
                                  QuantConfig(mode="auto", error_budget=1e-9), batches[:1])
    kept_kernels = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(q_all)[0]
                    if "kernel_float" in jax.tree_util.keystr(path)]
    assert len(kept_kernels) == 6 and all(k.dtype == jnp.bfloat16 for k in kept_kernels)

    def as_float(node):  # an int8 Dense's entry -> the float Dense it runs in every layer
        if isinstance(node, dict) and "kernel_float" in node:
            return {"kernel": jnp.asarray(node["kernel_float"], jnp.float32)}
        return {k: as_float(v) for k, v in node.items()} if isinstance(node, dict) else node

    tokens = batches[-1][:, :-1]
    all_kept = np.asarray(logits(g_all, q_all, tokens))
    np.testing.assert_allclose(all_kept, logits(graphdef, as_float(q_all), tokens), rtol=1e-5,
                               atol=1e-5)
    ref = np.asarray(logits(graphdef, params, tokens))
    assert np.linalg.norm(all_kept - ref) / np.linalg.norm(ref) < 1e-2
    assert bool(jnp.all(jnp.isfinite(logits(g, q, tokens))))


def test_report_flags_layers_whose_outliers_exceed_the_capacity(float_model, batches):
    """A threshold every input column reaches and a capacity of one column: every layer is over
    capacity; a threshold none reaches: no layer is, and no outlier column is counted."""
    graphdef, params = float_model
    for threshold, over in ((1e-6, True), (1e9, False)):
        qcfg = QuantConfig(mode="w8a8-outlier", outlier_threshold=threshold,
                           outlier_capacity=1e-3)
        _, _, plan, report = quantize(graphdef, params, qcfg, batches[:1])
        assert all(e["outlier_capacity"] == 1 for e in plan.values())
        rows = report["layers"]
        assert rows and all(r["over_capacity"] is over for r in rows)
        assert all((r["outlier_cols_max"] > 1) is over for r in rows)


# --- checkpoint, sharding, generation ---------------------------------------------------------

def save_plan(path, q, plan, qcfg_json, fmt=qckpt.FORMAT, model=None):
    qckpt.save(path, q, {"format": fmt, "quant_config": qcfg_json, "plan": plan,
                         "model": model or dataclasses.asdict(CFG), "source_step": 0})


def assert_identical(tree_a, tree_b):
    for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_round_trip_loads_sharded(tmp_path, float_model, batches):
    graphdef, params = float_model
    qcfg = QuantConfig(mode="w8a8-static", rules=("blocks/*", "head", "embed"))
    g, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    save_plan(tmp_path / "q", q, plan, qcfg.to_json())
    mesh = make_mesh(8)
    g2, q2, meta2 = qckpt.load(tmp_path / "q", CFG, mesh, sharded=True)
    assert meta2["plan"] == plan
    assert_identical(q, q2)
    kernel = q2["blocks"]["attn"]["q"]["kernel_q"]
    # Stored [layers, out, in]: q's input (embed) and down's output (embed) over fsdp.
    assert kernel.dtype == jnp.int8 and kernel.sharding.spec == P(None, None, "fsdp")
    assert q2["blocks"]["mlp"]["down"]["kernel_q"].sharding.spec == P(None, "fsdp", None)
    # The int8 values are identical; the sharded program sums floats (norms, attention) in
    # another order, which may flip one activation's int8 rounding and move that token's row by
    # a quantisation step (seen on one host). So: nearly every token row identical, and the whole
    # far closer to the single-device int8 model than int8 is to float.
    tokens = batches[-1][:, :-1]
    sharded, single = (np.asarray(logits(*m, tokens)) for m in ((g2, q2), (g, q)))
    assert np.mean(np.all(np.isclose(sharded, single, rtol=1e-5, atol=1e-5), -1)) >= 0.95
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel(sharded, single) < 0.2 * rel(single, np.asarray(logits(graphdef, params, tokens)))
    float_disk = qckpt.save_float_reference(tmp_path / "f", params)
    # tiny model: per-channel scales and Orbax metadata weigh (~2.4x); small reaches > 3.5x
    assert float_disk / qckpt.disk_bytes(tmp_path / "q" / "ckpt") > 2.0


@pytest.mark.parametrize("mode,extra", [("w8a8-outlier", {}), ("auto", {"error_budget": 0.006}),
                                        ("w8a8-rotated", {"rotation_seed": 7})])
def test_checkpoint_round_trip_keeps_capacity_kept_layers_and_rotation(tmp_path, float_model,
                                                                       batches, mode, extra):
    graphdef, params = float_model
    qcfg = QuantConfig(mode=mode, **extra)
    g, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    save_plan(tmp_path / "q", q, plan, qcfg.to_json())
    g2, q2, meta = qckpt.load(tmp_path / "q", CFG)
    assert meta["plan"] == plan and QuantConfig.from_json(meta["quant_config"]) == qcfg
    assert_identical(q, q2)
    down = nnx.merge(g2, q2).blocks.mlp.down
    assert down.rotate == (mode == "w8a8-rotated")
    if mode == "auto":
        assert any(e["float_layers"] for e in plan.values())
    elif mode == "w8a8-outlier":
        assert down.outlier_capacity == -(-CFG.d_ff // 16)
    else:  # the stored kernel is the rotated one, Rᵀ W, and the model reads it back as such
        assert plan["blocks/mlp/down"]["rotation_seed"] == 7 and down.rotation_seed == 7
        rw = rotate_kernel(params["blocks"]["mlp"]["down"]["kernel"], 7)
        np.testing.assert_array_equal(q2["blocks"]["mlp"]["down"]["kernel_q"],
                                      jnp.swapaxes(qz.quantize(rw, qz.weight_scale(rw)), 1, 2))
    tokens = batches[-1][:, :-1]
    np.testing.assert_allclose(logits(g2, q2, tokens), logits(g, q, tokens), rtol=1e-6)


def test_format_1_checkpoint_loads_uncapped_and_unknown_fields_are_refused(tmp_path,
                                                                           float_model, batches):
    graphdef, params = float_model
    qcfg = QuantConfig(mode="w8a8-outlier")
    _, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    drop = lambda d: {k: v for k, v in d.items() if k not in ("outlier_capacity", "rotate")}
    save_plan(tmp_path / "v1", kernels_in_out(q), {p: drop(e) for p, e in plan.items()},
              drop(qcfg.to_json()), fmt="shardq-int8/1")
    g1, q1, _ = qckpt.load(tmp_path / "v1", CFG)
    down = nnx.merge(g1, q1).blocks.mlp.down
    assert down.outlier_capacity == CFG.d_ff and not down.rotate  # as written
    save_plan(tmp_path / "new", q, plan, {**qcfg.to_json(), "group_size": 128})
    with pytest.raises(QuantError, match="quant_config: unknown field.*group_size"):
        qckpt.load(tmp_path / "new", CFG)


def kernels_in_out(q: dict) -> dict:
    """The int8 parameters as formats /1 to /3 stored them: QuantDense kernels [.., in, out]."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: np.swapaxes(a, -1, -2) if path[-1].key == "kernel_q" else a, q)


def test_a_format_3_checkpoint_is_transposed_onto_the_stored_layout(tmp_path, float_model,
                                                                    batches):
    """Files written before int8 kernels were stored [out, in] hold them [in, out]: read onto
    8 devices in the zero3 layout, they come back as the new layout's parameters bit for bit,
    sharded as a new file would be, and compute the same logits. Such a file's model config
    also predates the `attention` field (it counts as its default, "xla") and may name another
    remat policy (how the model is computed, not what)."""
    graphdef, params = float_model
    qcfg = QuantConfig(mode="w8a8", rules=("blocks/*", "embed"))
    g, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    old = kernels_in_out(q)
    assert old["blocks"]["attn"]["q"]["kernel_q"].shape[1:] == (CFG.d_model, CFG.d_model) and \
        old["blocks"]["mlp"]["up"]["kernel_q"].shape[1:] == (CFG.d_model, CFG.d_ff)
    written = {k: v for k, v in dataclasses.asdict(CFG).items() if k != "attention"}
    save_plan(tmp_path / "v3", old, plan, qcfg.to_json(), fmt="shardq-int8/3",
              model={**written, "remat": "full"})
    save_plan(tmp_path / "v4", q, plan, qcfg.to_json())
    mesh = make_mesh(8)
    _, q3, meta3 = qckpt.load(tmp_path / "v3", CFG, mesh, sharded=True)
    _, q4, _ = qckpt.load(tmp_path / "v4", CFG, mesh, sharded=True)
    assert meta3["format"] == "shardq-int8/3"
    assert_identical(q3, q)
    assert jax.tree.map(lambda a: a.sharding, q3) == jax.tree.map(lambda a: a.sharding, q4)
    tokens = batches[-1][:, :-1]
    np.testing.assert_array_equal(logits(g, jax.device_get(q3), tokens), logits(g, q, tokens))


def test_checkpoint_for_another_model_is_refused(tmp_path, float_model, batches):
    graphdef, params = float_model
    qcfg = QuantConfig(mode="w8")
    _, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    save_plan(tmp_path / "q", q, plan, qcfg.to_json())
    other = dataclasses.replace(CFG, d_ff=64, remat="save_dots")
    with pytest.raises(QuantError, match=rf"written for a different model \(d_ff: {CFG.d_ff} in "
                                         rf"the file, 64 here\); quantise this run again$"):
        qckpt.load(tmp_path / "q", other)
    assert qckpt.model_differences({**dataclasses.asdict(CFG), "n_experts": 4}, CFG) == \
        ["n_experts: 4 in the file, no such field here"]
    with pytest.raises(QuantError, match="no quantised checkpoint"):
        qckpt.load(tmp_path / "missing", CFG)


@pytest.fixture(scope="module")
def trained_model():
    """The tiny model after 100 AdamW steps on the synthetic sequences: confident enough that
    greedy decoding is not decided by rounding noise. (An untrained model's near-flat logits
    are: int8 and float greedy tokens agreed on 79% of positions there, 84% after 30 steps, and
    a token that flips early changes the rest of its row.)"""
    train = dataclasses.replace(TINY.train, steps=100)
    _, params = run_steps("dp", 1, synthetic_batches(100, 1, 16, CFG.max_len, seed=2),
                          train=train)
    return nnx.graphdef(nnx.eval_shape(lambda: DecoderLM(CFG, rngs=nnx.Rngs(0)))), params


def test_generation_with_a_quantized_model(trained_model, batches):
    graphdef, params = trained_model
    g, q, _, _ = quantize(graphdef, params, QuantConfig(mode="w8a8"), batches[:1])
    prompt = jnp.asarray(np.concatenate([batches[0][:, :8], batches[1][:, :8]]))  # 8 rows
    gen = jax.jit(generate, static_argnums=(0, 3))
    out = gen(g, q, prompt, 16, jax.random.key(0))
    ref = gen(graphdef, params, prompt, 16, jax.random.key(0))
    assert out.shape == (8, 24)
    np.testing.assert_array_equal(out[:, :8], prompt)
    agree = float(jnp.mean(out[:, 8:] == ref[:, 8:]))
    # Measured: all 128 greedy tokens agreed (the float model's smallest top-2 probability gap
    # there is 0.008). 0.85 leaves room for one row that diverges early on another host's
    # rounding, not for a broken int8 path.
    assert agree >= 0.85
    # int8 kernels keep the layer scan by default; both layouts write the same tokens.
    assert default_per_layer(nnx.merge(graphdef, params))
    assert not default_per_layer(nnx.merge(g, q))
    per_layer = jax.jit(functools.partial(generate, per_layer=True), static_argnums=(0, 3))
    np.testing.assert_array_equal(per_layer(g, q, prompt, 16, jax.random.key(0)), out)


# --- bad input -------------------------------------------------------------------------------

def test_non_finite_weights_are_refused(float_model, batches):
    graphdef, params = float_model
    bad = jax.tree.map(np.array, params)
    bad["blocks"]["mlp"]["up"]["kernel"][0, 0, 0] = np.nan
    with pytest.raises(QuantError, match="non-finite"):
        quantize(graphdef, bad, QuantConfig(mode="w8a8"), batches[:1])


def test_non_finite_calibration_activations_are_refused(float_model, batches):
    graphdef, params = float_model
    bad = jax.tree.map(np.array, params)
    bad["blocks"]["attn_norm"]["scale"][0, 0] = np.inf  # finite tokens, non-finite activations
    with pytest.raises(QuantError, match="calibration"):
        calibrate(graphdef, bad, batches[:1])


def test_unsupported_mode_rules_and_dtype_are_refused(float_model):
    graphdef, params = float_model
    model = nnx.merge(graphdef, params)
    with pytest.raises(QuantError, match="mode='w4'"):
        make_plan(QuantConfig(mode="w4"), model)
    with pytest.raises(QuantError, match="select no module"):
        make_plan(QuantConfig(rules=("nothing/*",)), model)
    plan = make_plan(QuantConfig(rules=("head",)), model)
    model.head.kernel.set_value(model.head.kernel[...].astype(jnp.int32))
    with pytest.raises(QuantError, match="dtype int32"):
        apply_plan(model, plan, QuantConfig())


def test_int8_kv_cache_decodes_like_the_float_cache():
    cfg = TINY.model
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (2, 12)), jnp.int32)
    full = model(tokens)
    cache = init_int8_cache(cfg, 2, 12)
    logits, cache = model.decode(tokens[:, :7], cache, 0)
    steps = [logits]
    for i in range(7, 12):
        step_logits, cache = model.decode(tokens[:, i:i + 1], cache, i)
        steps.append(step_logits)
    assert cache.k.dtype == jnp.int8 and cache.k_scale.dtype == jnp.float32
    # int8 keys/values (per token and head) perturb logits by well under the logits' spread.
    err = float(jnp.max(jnp.abs(jnp.concatenate(steps, axis=1) - full)))
    assert 0 < err < 0.05 * float(jnp.std(full))
    head_dim = cfg.head_dim
    assert param_bytes(cache) == param_bytes(model.init_cache(2, 12, jnp.float32)) * \
        (1 + 4 / head_dim) / 4
    out = generate(graphdef, params, tokens[:, :4], 8, jax.random.key(0),
                   make_cache=init_int8_cache)
    ref = generate(graphdef, params, tokens[:, :4], 8, jax.random.key(0))
    assert out.shape == ref.shape == (2, 12)
    assert float(jnp.mean(out == ref)) > 0.9  # greedy decoding barely changes


def test_int8_kv_cache_decoding_does_not_depend_on_the_cache_length():
    """The int8 cache is read a block at a time like the float one: past a block boundary
    (prefill up to 8 positions before it, steps to 12 past it), a longer cache gives
    bit-identical logits."""
    cfg = dataclasses.replace(TINY.model, max_len=3 * CACHE_BLOCK)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    n, start = CACHE_BLOCK + 12, CACHE_BLOCK - 8
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 256, (1, n)), jnp.int32)
    step = jax.jit(lambda t, c, i: model.decode(t, c, i))
    runs = []
    for length in (n, 3 * CACHE_BLOCK):
        logits, cache = step(tokens[:, :start], init_int8_cache(cfg, 1, length), 0)
        out = [logits]
        for i in range(start, n):
            logits, cache = step(tokens[:, i:i + 1], cache, i)
            out.append(logits)
        runs.append(np.asarray(jnp.concatenate(out, axis=1)))
    assert cache.length == 3 * CACHE_BLOCK and cache.k.dtype == jnp.int8
    np.testing.assert_array_equal(runs[1], runs[0])


def test_results_record_workdirs_relative_to_the_project_root(tmp_path):
    """quant_table stores its --workdir through project_relative: a committed results file must
    not hold the absolute paths of the machine that wrote it."""
    import json

    from experiments.reporting.results_io import PROJECT_ROOT, RESULTS_DIR, project_relative

    assert project_relative(PROJECT_ROOT / "runs" / "main") == "runs/main"
    outside = project_relative(tmp_path / "run")
    assert not outside.startswith("/") and (PROJECT_ROOT / outside).resolve() == \
        (tmp_path / "run").resolve()
    for f in sorted(RESULTS_DIR.glob("*.json")):
        workdir = json.loads(f.read_text()).get("workdir")
        assert workdir is None or not workdir.startswith("/"), f.name
