"""shardq's log-sum-exp kernel (model/native_logsumexp.py) against jax.nn.logsumexp, and the
scoring function that uses it against the log-softmax it replaces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.pretrained import scoring
from model import native_argmax, native_logsumexp
from tests.helpers import native_kernel_built
from tests.quant_models import tiny_float_model


def _built() -> bool:
    return native_kernel_built(native_logsumexp.status())


@pytest.mark.parametrize("shape", [(512, 4099), (3, 16), (2, 5, 33), (1, 1), (7, 64)])
def test_kernel_matches_jax_to_float_rounding(shape):
    if not _built():
        return
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray((rng.standard_normal(shape) * 4).astype(np.float32))
    assert native_logsumexp.TARGET in jax.jit(native_logsumexp.logsumexp).lower(x).as_text()
    got = np.asarray(jax.jit(native_logsumexp.logsumexp)(x))
    want = np.asarray(jax.nn.logsumexp(x, axis=-1))
    assert got.shape == want.shape == shape[:-1]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    # a changed entry is caught: the row's largest moved up by one
    i = np.unravel_index(int(np.argmax(np.asarray(x))), shape)
    moved = np.asarray(jax.nn.logsumexp(x.at[i].add(1.0), axis=-1))
    assert np.any(np.abs(moved - got) > 1e-3)


def test_rows_with_infinities_and_nans_as_jax_gives_them():
    if not _built():
        return
    inf, nan = np.inf, np.nan
    x = np.zeros((5, 40), np.float32)
    x[0] = -inf  # every entry -inf: -inf
    x[1, 3] = inf  # one +inf: +inf
    x[2, 17] = nan  # a NaN: NaN
    x[3, :20] = -inf  # some -inf: the rest's sum
    x[4] = np.linspace(-200, 80, 40)  # exponentials under- and near-overflow
    got = np.asarray(jax.jit(native_logsumexp.logsumexp)(jnp.asarray(x)))
    want = np.asarray(jax.nn.logsumexp(jnp.asarray(x), axis=-1))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=2e-6)


def test_score_fn_picks_the_log_softmax_values_and_its_argmax():
    graphdef, params = tiny_float_model()
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 200, (1, 48)), jnp.int32)
    picked, top = scoring.make_score_fn(graphdef)(params, tokens)
    logp = np.asarray(scoring.make_logprob_fn(graphdef)(params, tokens))
    want = logp[np.arange(47), np.asarray(tokens)[0, 1:]]
    np.testing.assert_allclose(np.asarray(picked), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(top), logp.argmax(-1))
    text = jax.jit(scoring.make_score_fn(graphdef)).lower(params, tokens).as_text()
    if _built() and native_kernel_built(native_argmax.status()):
        assert native_logsumexp.TARGET in text and native_argmax.TARGET in text
