"""Property-based fuzzing: the config parser, the data packer/sampler and the quantizers take
random and extreme input without crashing outside their documented errors, and never return a
silent NaN."""

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from experiments.cli.flags import add_override_flags, config_from_args
from experiments.training.config import PRESETS
from experiments.training.data import SequenceSampler, pack
from quant import quantizers as qz

FAST = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

_parser = argparse.ArgumentParser()
_parser.add_argument("--preset", default="tiny")
add_override_flags(_parser)
_ints = st.integers(min_value=-3, max_value=1 << 20)


@FAST
@given(preset=st.sampled_from([*PRESETS, "nope", ""]), steps=_ints, batch=_ints, heads=_ints,
       d_model=_ints, micro=_ints, strategy=st.sampled_from(["dp", "zero3", "zero9", ""]),
       lr=st.floats(allow_nan=True, allow_infinity=True))
def test_config_parser_accepts_or_names_the_field(preset, steps, batch, heads, d_model, micro,
                                                   strategy, lr):
    args = _parser.parse_args([])
    args.preset = preset
    for name, value in dict(steps=steps, batch_size=batch, n_heads=heads, d_model=d_model,
                            micro_steps=micro, strategy=strategy, lr=lr).items():
        setattr(args, f"override_{name}", value)
    try:
        cfg = config_from_args(args)
    except ValueError as e:  # the documented error: one line naming a field
        assert "\n" not in str(e) and "=" in str(e)
        return
    assert cfg.train.steps > 0 and cfg.model.d_model % cfg.model.n_heads == 0
    assert cfg.train.lr > 0 and np.isfinite(cfg.train.lr)


@FAST
@given(data=st.binary(min_size=0, max_size=4000), seq_len=st.integers(1, 300),
       seed=st.integers(0, 2**32 - 1), batches=st.integers(1, 5), batch=st.integers(1, 16))
def test_packer_and_sampler_on_random_bytes(data, seq_len, seed, batches, batch):
    stream = np.frombuffer(data, np.uint8)
    try:
        rows = pack(stream, seq_len)
    except ValueError as e:
        assert f"seq_len={seq_len}" in str(e)
        assert len(stream) - 1 < seq_len
        return
    assert rows.shape == ((len(stream) - 1) // seq_len, seq_len + 1)
    assert rows.min() >= 0 and rows.max() <= 255
    np.testing.assert_array_equal(rows[:, 1:][:-1, -1], rows[1:, 0])  # rows overlap by one
    sampler = SequenceSampler(rows, seed)
    drawn = np.concatenate([sampler.next_batch(batch) for _ in range(batches)])
    assert sampler.position == batches * batch
    if batches >= 2:  # resuming at a saved position continues the same order
        resumed = SequenceSampler(rows, seed, position=batch)
        np.testing.assert_array_equal(resumed.next_batch(batch), drawn[batch:2 * batch])


_values = st.floats(min_value=-2.0**126, max_value=2.0**126, allow_nan=False, allow_infinity=False,
                    width=32)


# The quantizers run jitted, as inside the model: one compile per drawn shape instead of one
# per operation and shape when run op by op (most of this file's time went to those).
@partial(jax.jit, static_argnames="granularity")
def _weight_round_trip(w, granularity):
    scale = qz.weight_scale(w, granularity)
    q = qz.quantize(w, scale)
    return scale, q, qz.dequantize(q, scale)


@partial(jax.jit, static_argnames="mode")
def _activation_round_trip(x, mode):
    scale = qz.token_scale(x) if mode == "token" else qz.tensor_scale(x).reshape(1, 1)
    return scale, qz.round_trip(x.astype(jnp.float32), scale)


@FAST
@given(w=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=3, max_side=12),
                    elements=_values), granularity=st.sampled_from(["channel", "tensor"]))
def test_weight_quantizer_bounds_the_error_and_never_makes_nan(w, granularity):
    scale, q, back = _weight_round_trip(jnp.asarray(w), granularity)
    back = np.asarray(back, np.float64)
    assert q.dtype == jnp.int8 and np.all(np.abs(np.asarray(q, np.int32)) <= 127)
    assert np.all(np.isfinite(np.asarray(scale))) and np.all(np.asarray(scale) > 0)
    # Symmetric absmax rounding: at most half a step per element (plus float slack).
    step = np.broadcast_to(np.asarray(scale, np.float64), w.shape)
    assert np.all(np.abs(back - w.astype(np.float64)) <= 0.5 * step * (1 + 1e-5) + 1e-30)


@FAST
@given(x=hnp.arrays(st.sampled_from([np.float32, np.float16]),
                    hnp.array_shapes(min_dims=2, max_dims=2, max_side=16),
                    elements=st.floats(-6e4, 6e4, allow_nan=False, width=16)),
       mode=st.sampled_from(["token", "tensor"]))
def test_activation_quantizers_on_extreme_rows(x, mode):
    scale, back = _activation_round_trip(jnp.asarray(x), mode)
    back = np.asarray(back, np.float64)
    assert np.all(np.isfinite(back))
    step = np.broadcast_to(np.asarray(scale, np.float64), x.shape)
    assert np.all(np.abs(back - x.astype(np.float64)) <= 0.5 * step * (1 + 1e-3) + 1e-30)


def test_subnormal_channel_gets_a_safe_scale():
    w = jnp.asarray([[1e-45, 1.0], [0.0, -2.0]], jnp.float32)
    scale = qz.weight_scale(w)
    assert np.all(np.asarray(scale) > 0)
    assert np.all(np.isfinite(np.asarray(qz.round_trip(w, scale))))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_weights_are_refused_before_quantizing(bad):
    from quant.convert import QuantError, check_finite

    with pytest.raises(QuantError, match="not finite|non-finite"):
        check_finite({"blocks": {"w": jnp.asarray([1.0, bad])}}, "parameter")
