"""LongRoPE's config fields (model/config.py): what validate() refuses, which factor set a
context takes (model/rope.py), and that they survive a run's config.json and the command
line, where a tuple is a list or a comma-separated text."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

from experiments.cli.flags import add_override_flags, config_from_args
from experiments.training.config import Config, TrainConfig
from model.config import ModelConfig, differing_fields
from model.rope import attention_rope, rope_freqs

# 16 dimensions per head, RoPE on 12 of them: 6 frequencies
LONGROPE = dict(d_model=64, n_heads=4, rotary_dim=12, max_len=24, rope_original_max_len=24,
                rope_short_factors=(1.0, 1.05, 1.3, 1.9, 2.6, 3.1),
                rope_long_factors=(1.0, 1.4, 3.5, 9.0, 21.0, 40.0), rope_attention_factor=1.25)


def test_the_context_picks_the_factor_set():
    cfg = ModelConfig(**LONGROPE)
    cfg.validate()
    plain = rope_freqs(cfg.rope_base, cfg.rope_dim)
    short, scale = attention_rope(cfg)
    long, _ = attention_rope(dataclasses.replace(cfg, max_len=25))
    np.testing.assert_allclose(plain / short, cfg.rope_short_factors, rtol=1e-6)
    np.testing.assert_allclose(plain / long, cfg.rope_long_factors, rtol=1e-6)
    assert scale == 1.25
    assert attention_rope(ModelConfig()) == (None, 1.0)


@pytest.mark.parametrize("change, match", [
    (dict(rope_long_factors=(1.0,) * 5), "rope_long_factors: LongRoPE needs 6 positive finite"),
    (dict(rope_short_factors=(1.0, 0.0, 1.0, 1.0, 1.0, 1.0)),
     "rope_short_factors: LongRoPE needs 6 positive"),
    (dict(rope_short_factors=(1.0,) * 5 + (float("nan"),)), "rope_short_factors: LongRoPE"),
    (dict(rope_long_factors=None), "rope_long_factors: LongRoPE needs 6"),
    (dict(rope_original_max_len=0), "rope_original_max_len=0, rope_attention_factor=1.25: "
                                    "LongRoPE needs both positive"),
    (dict(rope_attention_factor=0.0), "LongRoPE needs both positive"),
    (dict(rope_low_freq_factor=1.0), "rope_low_freq_factor=1.0: only with rope_scale_factor"),
    (dict(rotary_dim=None, rope_scale_factor=8.0, rope_low_freq_factor=1.0,
          rope_high_freq_factor=4.0, rope_short_factors=(1.0,) * 8,
          rope_long_factors=(1.0,) * 8), "LongRoPE is not with rope_scale_factor"),
])
def test_validate_names_the_longrope_field(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**LONGROPE, **change}).validate()
    with pytest.raises(ValueError, match="rope_attention_factor=1.5: only with LongRoPE"):
        ModelConfig(rope_attention_factor=1.5).validate()


def test_a_runs_config_json_and_the_flags_give_the_same_model():
    """config.json writes the factors as lists; read back, they are tuples again (a model's
    static config must hash) and name no difference. The flags take them comma-separated."""
    cfg = Config("tiny", ModelConfig(**LONGROPE), TrainConfig())
    written = json.loads(json.dumps(cfg.to_json()))
    assert isinstance(written["model"]["rope_short_factors"], list)
    back = Config.from_json(written)
    assert back == cfg and hash(back.model) == hash(cfg.model)
    assert differing_fields(written["model"], cfg.model) == []
    assert differing_fields({**written["model"], "rope_long_factors": [1.0] * 6},
                            cfg.model) == ["rope_long_factors"]
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    add_override_flags(parser)
    flags = ["--d-model", "64", "--n-heads", "4", "--rotary-dim", "12", "--max-len", "24",
             "--rope-original-max-len", "24", "--rope-attention-factor", "1.25",
             "--rope-short-factors", "1,1.05,1.3,1.9,2.6,3.1",
             "--rope-long-factors", "1, 1.4, 3.5, 9, 21, 40"]
    model = config_from_args(parser.parse_args(flags)).model
    assert {k: getattr(model, k) for k in LONGROPE} == LONGROPE
    with pytest.raises(SystemExit):
        parser.parse_args(["--rope-short-factors", "1,x"])
