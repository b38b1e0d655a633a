"""shardq's greedy pick (model/native_argmax.py) against jnp.argmax: the first of equal maxima,
-0 equal to +0, a row's first NaN, infinities, and rows whose length is not a multiple of the
kernel's sixteen lanes; greedy decoding picks its tokens there on a CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import native_argmax
from model.generate import sample_token
from tests.helpers import native_kernel_built


def _built() -> bool:
    return native_kernel_built(native_argmax.status())


def _rows(n: int, seed: int) -> np.ndarray:
    """Rows that put the answer where a lane-wise pick could get it wrong."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((12, n)).astype(np.float32)
    top = np.float32(9.0)
    x[1, [n // 3, n - 1]] = top  # equal maxima: the first wins
    x[2, [n - 1, n // 2, 3 % n]] = top
    x[3] = -np.inf
    x[4, :] = np.float32(-0.0)
    x[4, n // 2] = np.float32(0.0)  # equals -0: index 0 stays the pick
    x[5, n // 2] = np.nan  # a NaN is the pick, before any larger value
    x[5, n - 1] = np.inf
    x[6, [n - 1, n // 4]] = np.nan  # the first NaN
    x[7, n - 1] = np.inf
    x[8, 0] = top  # the first element
    x[9, n - 1] = top  # the last, in the tail past the lanes
    x[10, n - 1] = np.nan
    x[11, min(n - 1, 17)] = top  # a lane other than the first
    return x


@pytest.mark.parametrize("n", [1, 5, 16, 31, 32, 47, 100, 49152, 49157])
def test_pick_is_jnp_argmax(n):
    if not _built():
        return
    x = jnp.asarray(_rows(n, n))
    assert native_argmax.TARGET in jax.jit(native_argmax.argmax).lower(x).as_text()
    got = np.asarray(jax.jit(native_argmax.argmax)(x))
    want = np.asarray(jax.jit(lambda x: jnp.argmax(x, -1))(x))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32


def test_leading_dimensions_vmap_and_narrow_floats():
    if not _built():
        return
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 700)).astype(np.float32))
    want = np.asarray(jnp.argmax(x, -1))
    np.testing.assert_array_equal(np.asarray(jax.jit(native_argmax.argmax)(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(native_argmax.argmax))(x)), want)
    xb = x.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax.jit(native_argmax.argmax)(xb)),
                                  np.asarray(jnp.argmax(xb, -1)))


def test_greedy_sampling_picks_there():
    if not _built():
        return
    logits = jnp.asarray(np.random.default_rng(4).standard_normal((2, 3000)).astype(np.float32))
    pick = jax.jit(lambda x: sample_token(x, None, 0.0, 0))
    assert native_argmax.TARGET in pick.lower(logits).as_text()
    np.testing.assert_array_equal(np.asarray(pick(logits)), np.asarray(jnp.argmax(logits, -1)))
    xla = jax.jit(lambda x: sample_token(x, None, 0.0, 0, native=False))
    assert native_argmax.TARGET not in xla.lower(logits).as_text()
    assert xla(logits).dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(xla(logits)), np.asarray(pick(logits)))


def test_bench_decode_pick_check_times_both_forms_on_the_same_pick():
    from experiments.speed.greedy_pick import pick_check

    out = pick_check(4099, repeats=1)
    assert out["same_pick"] and out["vocab"] == 4099
    assert set(out["us_per_pick"]) == ({"xla_argmax", "shardq_kernel"} if _built()
                                       else {"xla_argmax"})
    assert all(us > 0 for us in out["us_per_pick"].values())
