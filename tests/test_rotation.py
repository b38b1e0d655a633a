"""The input rotation of mode w8a8-rotated (quant/rotation.py): an orthogonal, cheap R; the same
float product; an int8 product that really is int8 and beats unrotated per-token int8 where
channels are uneven."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import DecoderLM
from model.layers import Dense
from quant import quantizers as qz
from quant.dense import QuantDense
from quant.modes import QuantConfig, QuantError
from quant.pipeline import quantize
from quant.rotation import rotate, rotate_kernel, rotation_factors
from tests.helpers import TINY
from tests.hlo_checks import int8_dots


def dense_matrix(n: int) -> np.ndarray:
    r = np.ones((1, 1))
    for f in rotation_factors(n):
        r = np.kron(r, f)
    return r


# 576 / 1536: SmolLM2's width and MLP width; 384: MiniLM's; 100 and 7 have no Hadamard factor
# (their odd part takes the fixed orthogonal matrix); 4096 splits into Sylvester factors.
@pytest.mark.parametrize("n", [1, 2, 7, 12, 64, 100, 384, 576, 1536, 4096])
def test_rotation_is_orthogonal_and_matches_its_dense_matrix(n):
    r = dense_matrix(n)
    np.testing.assert_allclose(r @ r.T, np.eye(n), atol=1e-12)
    assert max(f.shape[0] for f in rotation_factors(n)) <= max(128, n // 8)  # cheap: no n x n
    x = np.random.default_rng(n).standard_normal((3, 2, n))
    np.testing.assert_allclose(rotate(jnp.asarray(x, jnp.float32)), x @ r, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("n", [12, 64, 384, 576, 1536])
def test_hadamard_sizes_spread_every_channel_evenly(n):
    """Where n is a power of two times a Paley order, R is a scaled Hadamard matrix: every
    input channel reaches every output channel with weight ±1/√n."""
    np.testing.assert_allclose(np.abs(dense_matrix(n)), 1 / np.sqrt(n), rtol=1e-12)


def test_rotated_kernel_gives_the_same_float_product():
    x = jax.random.normal(jax.random.key(0), (5, 576))
    w = jax.random.normal(jax.random.key(1), (2, 576, 48))  # stacked: [layers, in, out]
    got = jnp.einsum("ti,lio->lto", rotate(x), rotate_kernel(w))
    want = jnp.einsum("ti,lio->lto", x, w)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_seed_gives_another_rotation_with_the_same_product():
    """R = D H with random signs D: orthogonal, as even as H, different from H, and the float
    product is unchanged."""
    x = jax.random.normal(jax.random.key(4), (3, 576))
    w = jax.random.normal(jax.random.key(5), (576, 8))
    eye = jnp.eye(576)
    r0, r7 = rotate(eye), rotate(eye, 7)  # the rows of I R are R's rows
    np.testing.assert_allclose(r7 @ r7.T, eye, atol=1e-5)
    np.testing.assert_allclose(jnp.abs(r7), 1 / np.sqrt(576), rtol=1e-5)
    assert float(jnp.max(jnp.abs(r7 - r0))) > 0.05
    np.testing.assert_allclose(rotate(x, 7) @ rotate_kernel(w, 7), x @ w, rtol=1e-4, atol=1e-4)
    with pytest.raises(QuantError, match=r"^rotation_seed=-1: must be in \[0, 4294967296\)"):
        QuantConfig(mode="w8a8-rotated", rotation_seed=-1).validate()


def quant_dense(w: jax.Array, rotated: bool) -> QuantDense:
    w_int = rotate_kernel(w) if rotated else w
    s = qz.weight_scale(w_int)
    return QuantDense(qz.quantize(w_int, s).T, s, kernel_axes=("embed", "mlp"),
                      compute_dtype="float32", act="token", rotate=rotated)


def test_rotation_rescues_uneven_and_massive_channels_and_stays_int8():
    """Two cases from Llama-family models, each against the float product of the same weights.
    Uneven channels (an RMSNorm's output: a few channels steadily ~20x the rest): unrotated, they
    set every token's scale and the ordinary channels get a few levels. Massive activations (a
    few tokens carry one channel ~1000x the rest): unrotated, the other channels of those tokens
    round to a few levels; rotated, the spike is spread over all 576 channels."""
    dense = Dense(576, 96, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (64, 576))
    x = x * jnp.ones((1, 576)).at[0, 40:48].set(20.0)  # uneven channels
    spike = jnp.zeros((64, 576)).at[::8, 123].set(1500.0)  # every 8th token: a massive channel
    ordinary_rows = np.arange(64) % 8 != 0
    err = {}
    for rotated in (False, True):
        qd = quant_dense(dense.kernel[...], rotated)
        y = qd(x + spike)
        # A spiked token's error against what its other channels contribute (the spike's own
        # term dwarfs it and is exact in both), an ordinary token's against its output.
        rel = jnp.linalg.norm(y - dense(x + spike), axis=-1) / jnp.linalg.norm(dense(x), axis=-1)
        err[rotated] = (float(jnp.mean(rel[ordinary_rows])), float(jnp.mean(rel[::8])))
        graphdef, state = nnx.split(qd)
        hlo = jax.jit(lambda st, v, g=graphdef: nnx.merge(g, st)(v)).lower(state, x).compile()
        assert int8_dots(hlo.as_text()), rotated  # a real s8 x s8 -> s32 product either way
    (plain_ordinary, plain_spiked), (rot_ordinary, rot_spiked) = err[False], err[True]
    assert rot_ordinary < 0.5 * plain_ordinary, err
    # The spiked tokens keep an error in both: the spike times the kernel's own rounding.
    assert rot_spiked < 0.6 * plain_spiked, err


def test_inputs_shared_by_q_k_v_are_rotated_once_in_the_compiled_model():
    """q, k and v quantise the same input; each QuantDense asks for its rotation, and XLA
    computes it once. The tiny model's widths (32, 128) are single Sylvester factors, one float
    product each: rotated inputs add 4 products per layer (q/k/v's, o's, up's, down's), not 6."""
    cfg = dataclasses.replace(TINY.model, scan_unroll=1)
    graphdef, state = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    tokens = jnp.zeros((2, 8), jnp.int32)
    count = {}
    for mode in ("w8a8", "w8a8-rotated"):
        g, q, _, _ = quantize(graphdef, params, QuantConfig(mode=mode), [tokens])
        hlo = jax.jit(lambda p, t, g=g: nnx.merge(g, p)(t)).lower(q, tokens).compile().as_text()
        count[mode] = len(re.findall(r"= f32\[[\d,]*\]\S* dot\(", hlo))
    assert count["w8a8-rotated"] - count["w8a8"] == 4, count
