"""Gemma 3's fields of the one decoder through int8 (every mode) and the layer-counted scan,
on the tiny transformers-made fixture tests/fixtures/hf/gemma3_text (parity with transformers
itself is in tests/test_hf_models.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import DecoderLM
from model.hf_decoder import load_hf
from model.rope import rope_freqs
from model.transformer import NO_WINDOW, layer_tables
from quant.modes import MODES, QuantConfig
from quant.pipeline import quantize

FOLDER = Path(__file__).parent / "fixtures" / "hf" / "gemma3_text"


@pytest.fixture(scope="module")
def gemma():
    cfg, params = load_hf(FOLDER)
    graphdef = nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))))[0]
    rng = np.random.default_rng(0)
    rows = rng.integers(0, cfg.vocab_size, (2, 1, 33)).astype(np.int32)
    return cfg, graphdef, params, rows


def mean_nll(graphdef, params, rows) -> float:
    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
    tokens = jnp.asarray(rows[:, 0])
    logp = jax.nn.log_softmax(model(tokens[:, :-1]), axis=-1)
    return float(-jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean())


def test_layer_tables_follow_the_pattern(gemma):
    cfg = gemma[0]
    windows, freqs = layer_tables(cfg)
    for i, kind in enumerate(cfg.layer_pattern):
        slides = kind == "s"
        assert windows[i] == (cfg.sliding_window if slides else NO_WINDOW)
        base = cfg.rope_local_base if slides else cfg.rope_base
        np.testing.assert_array_equal(freqs[i], rope_freqs(base, cfg.head_dim))


@pytest.mark.parametrize("mode", list(MODES))
def test_every_int8_mode_stays_near_float(gemma, mode):
    """Each mode quantises Gemma's blocks (post-norms, (1 + w) folds, GeGLU) and scores the
    calibration texts within a small distance of the float model; the control is the float
    model with its post-norms dropped, far away."""
    cfg, graphdef, params, rows = gemma
    qcfg = QuantConfig(mode=mode, alpha=0.5, calib_batches=len(rows)) \
        if MODES[mode][1] and not MODES[mode][3] else QuantConfig(mode=mode,
                                                                    calib_batches=len(rows))
    qgraph, qparams, _, _ = quantize(graphdef, params, qcfg, list(rows), error_report=False)
    base = mean_nll(graphdef, params, rows)
    assert abs(mean_nll(qgraph, qparams, rows) - base) < 0.5, mode


def test_dropping_post_norms_is_far(gemma):
    cfg, graphdef, params, rows = gemma
    off = dataclasses.replace(cfg, post_norms=False)
    blocks = {k: v for k, v in params["blocks"].items() if not k.startswith("post_")}
    g_off = nnx.split(nnx.eval_shape(lambda: DecoderLM(off, rngs=nnx.Rngs(0))))[0]
    assert abs(mean_nll(g_off, {**params, "blocks": blocks}, rows)
               - mean_nll(graphdef, params, rows)) > 0.5
