"""int8 encoder: w8a8 stays close to float on real sentences; the encoder's SmoothQuant fold
leaves the float function unchanged; quantised params shard like float ones."""

import re

import jax
import numpy as np
import pytest

from tests.helpers import MINILM_WEIGHTS, require_package

require_package(MINILM_WEIGHTS, "the MiniLM weights")

from experiments.pretrained.minilm import (  # noqa: E402
    encode,
    load_encoder,
    make_encode_fn,
    place,
    quantize_encoder,
    retrieval,
    stdlib_sentences,
)
from tests.hlo_checks import float_dot_widths, int8_dots  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    graphdef, params, tok = load_encoder()
    texts = stdlib_sentences(24)
    calib = stdlib_sentences(32, offset=24)
    ref = encode(make_encode_fn(graphdef), params, tok, texts)
    return graphdef, params, tok, texts, calib, ref


def test_w8a8_close_to_float(setup, n_devices):
    graphdef, params, tok, texts, calib, ref = setup
    qdef, qparams, _ = quantize_encoder(graphdef, params, tok, "w8a8", calib)
    assert qparams["blocks"]["attn"]["q"]["kernel_q"].dtype == np.int8
    emb = encode(make_encode_fn(qdef), qparams, tok, texts)
    cos = np.sum(emb * ref, axis=1)
    assert cos.mean() >= 0.995 and cos.min() >= 0.98, (cos.mean(), cos.min())
    top1, top10 = retrieval(ref, emb)
    assert top1 >= 0.8 and top10 >= 0.8
    sharded, _ = place(qparams, qdef, n_devices, "zero3")  # int8 kernels shard like float ones
    assert sharded["blocks"]["attn"]["o"]["bias"].sharding.spec[1] == "fsdp"
    # Not bitwise: sharded float reductions round differently, which flips a few int8 roundings
    # downstream (a token scale set by an outlier channel moves the whole row); the two int8
    # runs still agree as well as int8 agrees with float.
    got = encode(make_encode_fn(qdef), sharded, tok, texts)
    assert np.min(np.sum(got * emb, axis=1)) >= 0.995


@pytest.mark.parametrize("alpha", [0.5, "searched"])
def test_smoothing_fold_keeps_the_float_function(setup, alpha):
    from flax import nnx

    from quant.alpha_search import search_alphas
    from quant.calibrate import calibrate
    from quant.encoder import Smooth, calibration_rows, encoder_sites, fold_encoder

    graphdef, params, tok, texts, calib, ref = setup
    batches = calibration_rows(tok.encode(calib)[0], 16)
    stats = calibrate(graphdef, params, batches)
    model = nnx.merge(graphdef, params)
    if alpha == "searched":  # one alpha per layer and site, as QuantConfig folds by default
        alpha = search_alphas(graphdef, params, batches, encoder_sites(model, stats["absmax"]))
        assert set(alpha) == {"blocks/attn/o", "blocks/attn/q", "blocks/mlp/up",
                              "blocks/mlp/down"}
        assert all(len(v) == len(stats["absmax"]["blocks/attn/q"]) for v in alpha.values())
    fold_encoder(model, stats["absmax"], alpha=alpha)
    assert isinstance(model.blocks.mlp.down, Smooth)
    sdef, sstate = nnx.split(model)
    emb = encode(make_encode_fn(sdef), nnx.to_pure_dict(sstate), tok, texts)
    np.testing.assert_allclose(emb, ref, atol=2e-5)


def test_w8a8_encoder_multiplies_in_int8(setup):
    """The compiled w8a8 encoder: every Dense product is an s8 x s8 -> s32 dot (q, k, v, o,
    up, down in the layer scan), and the only float dots left are attention's (contracting
    over head_dim or the sequence), so no int8 operand was widened to float; and no int8
    operand is transposed on the way (the stored [in, out] kernels feed the dot as they are)."""
    graphdef, params, tok, texts, calib, _ = setup
    qdef, qparams, _ = quantize_encoder(graphdef, params, tok, "w8a8", calib)
    tokens, mask = tok.encode(texts[:4], pad_to=16)
    hlo = make_encode_fn(qdef).lower(qparams, tokens, mask).compile().as_text()
    assert len(int8_dots(hlo)) == 6, int8_dots(hlo)
    cfg_head_dim, T = 384 // 12, tokens.shape[1]
    assert set(float_dot_widths(hlo)) <= {cfg_head_dim, T}, float_dot_widths(hlo)
    assert not re.findall(r"= s8\[[^\]]*\]\S* transpose\(", hlo)


def test_modes_without_calibration_skip_the_eager_passes(setup, monkeypatch):
    """embed --quant w8a8 needs no calibration data: quantising runs no eager pass over
    calibration batches (each costs compilations) unless the error report is asked for, and
    the model is the same either way."""
    import quant.pipeline

    graphdef, params, tok, texts, calib, _ = setup
    with_report = quantize_encoder(graphdef, params, tok, "w8a8", calib, error_report=True)
    assert "layers" in with_report[2]

    def no_pass(*args, **kwargs):
        raise AssertionError("calibrate() ran")

    monkeypatch.setattr(quant.pipeline, "calibrate", no_pass)
    qdef, qparams, report = quantize_encoder(graphdef, params, tok, "w8a8")
    assert "layers" not in report
    for a, b in zip(jax.tree.leaves(qparams), jax.tree.leaves(with_report[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
