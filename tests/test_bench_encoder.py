"""experiments.bench_encoder's library on a few texts: the JSON holds sane figures, the PyTorch
side's protocol (a stand-in interpreter here: CI has no torch) lands in the ratios, and the
tables render from it."""

import json
import stat

import pytest

from tests.helpers import MINILM_WEIGHTS, require_package

require_package(MINILM_WEIGHTS, "the MiniLM weights")

from experiments.reporting.tables.speed import bench_encoder  # noqa: E402
from experiments.speed.encoder import bench_sentences, run  # noqa: E402
from tests.helpers import cli, one_line_error  # noqa: E402

# Speaks torch_encoder_reference.py's --serve protocol: every pass takes 2 s.
FAKE_TORCH = """#!/bin/sh
echo '{"ready": {"torch": "fake", "transformers": "fake", "threads": 1, \
"int8_cosine_mean": 0.9, "int8_cosine_min": 0.8}}'
while read line; do
  [ "$line" = quit ] && exit 0
  case "$line" in
    kernels*) echo '{"kernels": [{"m": 16, "k": 32, "n": 48, "float32_ms": 1.0, \
"int8_ms": 0.5}]}' ;;
    *) echo "{\\"variant\\": \\"$line\\", \\"seconds\\": 2.0}" ;;
  esac
done
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    fake = tmp_path_factory.mktemp("torch") / "python"
    fake.write_text(FAKE_TORCH)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    # Four texts of similar length: one padded shape, so few compilations.
    texts = [t for t in bench_sentences(16) if t.count(".") == 1][:4]
    return texts, run(texts, ["w8a8"], batch=4, rounds=2, torch_python=str(fake),
                      kernel_shapes=((16, 32, 48),), log=lambda msg: None)


def test_json_fields_are_sane(result):
    texts, d = result
    assert d["n_sentences"] == 4 and d["batch"] == 4 and d["machine"]["cpus"] >= 1
    assert d["load_1min"]["start"] >= 0 and d["token_lengths"]["max"] <= 256
    names = [r["variant"] for r in d["results"]]
    assert names == ["float", "w8a8"]
    flt, q = d["results"]
    assert flt["mean_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert 0.98 < q["min_cosine"] <= q["mean_cosine"] < 1.0  # int8: close, not identical
    for r in d["results"]:
        assert len(r["pass_s"]) == 2 and r["sentences_per_s"] > 0
        b = r["breakdown"]
        assert b["tokenize_s"] > 0 and b["compute_s"] > 0 and b["h2d_s"] >= 0
        assert list(b["compile_s"]) == [f"4x{b['padded_tokens'] // 4}"]  # one shape
        assert b["real_tokens"] <= b["padded_tokens"] and 0 <= b["padding_fraction"] < 1
    json.dumps(d)  # writable as is


def test_torch_side_lands_in_the_ratios(result):
    _, d = result
    t = d["torch"]
    assert t["pass_s"] == {"float": [2.0, 2.0], "int8": [2.0, 2.0]}
    assert t["float_sentences_per_s"] == pytest.approx(2.0)  # 4 texts in 2 s
    for r in d["results"]:
        assert d["ratios"][r["variant"]] == pytest.approx(r["sentences_per_s"] / 2.0)
    (k,) = d["kernels"]  # ours measured, theirs from the reference's reply
    assert (k["m"], k["k"], k["n"]) == (16, 32, 48) and k["torch_int8_ms"] == 0.5
    assert k["float32_ms"] > 0 and k["s8_dot_ms"] > 0 and k["int8_dense_ms"] > 0
    table = bench_encoder(d)
    assert "| w8a8 |" in table and "× PyTorch" in table and "| 16 × 32 × 48 |" in table


def test_bench_encoder_cli_bad_input():
    one_line_error(cli("bench_encoder", "--modes", "w4", "--out", ""), "modes='w4'")
