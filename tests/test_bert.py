"""all-MiniLM-L6-v2 as a Flax NNX encoder: parity with sentence-transformers (stored fixture),
loader errors that leave nothing written, the embed CLI, zero3-sharded == unsharded."""

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.helpers import MINILM_WEIGHTS, require_package

require_package(MINILM_WEIGHTS, "the MiniLM weights")

from experiments.pretrained.minilm import (  # noqa: E402
    convert,
    encode,
    load_encoder,
    make_encode_fn,
    place,
)
from experiments.pretrained.minilm import load as load_converted  # noqa: E402
from model.bert import BertConfig, gelu  # noqa: E402
from model.hf_bert import (  # noqa: E402
    _LAYER_MAP,
    _TOP_MAP,
    CheckpointError,
    Tokenizer,
    expected_shapes,
    load_pretrained,
    package_model_dir,
)
from tests.helpers import cli, one_line_error  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "minilm_reference.json"


def test_missing_weights_skip_for_users_and_fail_under_ci(tmp_path):
    """The gate above: without the package a user's run skips these modules, CI's fails."""
    missing = "shardq-no-such-distribution"
    with pytest.raises(pytest.skip.Exception, match="needs the weights"):
        require_package(missing, "the weights", env={})
    with pytest.raises(pytest.skip.Exception):
        require_package(missing, "the weights", env={"CI": "false"})
    for ci in ("true", "1"):
        with pytest.raises(pytest.fail.Exception, match="CI is set and needs the weights"):
            require_package(missing, "the weights", env={"CI": ci})
    require_package(MINILM_WEIGHTS, "the weights", env={"CI": "true"})  # installed: no-op
    # ... and a module gated that way makes a CI pytest run fail rather than pass by skipping.
    (tmp_path / "test_gated.py").write_text(
        f"from tests.helpers import require_package\nrequire_package({missing!r}, 'x')\n"
        "def test_never_runs():\n    pass\n")
    env = {**os.environ, "CI": "true", "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode not in (0, 5) and "CI is set and needs x" in run.stdout, run.stdout


@pytest.fixture(scope="module")
def encoder():
    graphdef, params, tok = load_encoder()
    return graphdef, params, tok, make_encode_fn(graphdef)


@pytest.fixture(scope="module")
def reference():
    d = json.loads(FIXTURE.read_text())
    emb = np.frombuffer(base64.b64decode(d["embeddings_f32_b64"]), "<f4").reshape(d["shape"])
    return d, emb


def test_parity_with_sentence_transformers(encoder, reference):
    graphdef, params, tok, fn = encoder
    d, ref = reference
    assert len(d["sentences"]) >= 50 and max(d["token_counts"]) > 200
    _, mask = tok.encode(d["sentences"])
    assert [int(m.sum()) for m in mask] == d["token_counts"]  # same tokens as the reference
    emb = encode(fn, params, tok, d["sentences"], batch=len(d["sentences"]))
    assert np.max(np.abs(emb - ref)) <= 1e-4
    assert np.min(np.sum(emb * ref, axis=1)) >= 0.99999


def test_padding_does_not_change_embeddings(encoder):
    _, params, tok, fn = encoder
    texts = ["short one.", "a much longer sentence that forces padding on the first one."]
    together = encode(fn, params, tok, texts)
    alone = encode(fn, params, tok, texts[:1])
    np.testing.assert_allclose(together[0], alone[0], atol=1e-5)


def test_gelu_is_the_exact_erf_form_to_float32_rounding():
    from scipy.special import erf

    x = np.linspace(-12, 12, 100_001, dtype=np.float32)
    x64 = x.astype(np.float64)
    want = 0.5 * x64 * (1 + erf(x64 / np.sqrt(2)))
    got = np.asarray(gelu(x), np.float64)
    # A few float32 ulps of 1 at most (the tanh approximation is off by 1e-3), and the tails
    # saturate exactly: x for large x, 0 for very negative x.
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1)) < 2e-6
    assert got[-1] == 12.0 and got[0] == 0.0


def test_batches_are_bucketed_by_length(encoder):
    from experiments.pretrained.minilm import BUCKETS, batch_rows, plan_batches

    lengths = [5, 300, 17, 16, 90, 33]
    plan = plan_batches(lengths, batch=2)
    assert [idx for idx, _ in plan] == [[1, 4], [5, 2], [3, 0]]  # longest first
    assert [length for _, length in plan] == [320, 40, 16]  # multiples of 8, 32 past 256
    assert all(length in BUCKETS for _, length in plan)
    assert [batch_rows(n, 32) for n in (1, 3, 17, 32)] == [1, 4, 32, 32]
    assert batch_rows(3, 32, multiple=8) == 8
    # Order restored, and a partial batch's repeated rows dropped.
    _, params, tok, fn = encoder
    texts = ["one.", "a rather longer second text here.", "three", "four four."]
    np.testing.assert_allclose(encode(fn, params, tok, texts, batch=3),
                               np.concatenate([encode(fn, params, tok, [t]) for t in texts]),
                               atol=1e-5)


def test_empty_text_and_truncation(encoder):
    tok = encoder[2]
    with pytest.raises(CheckpointError, match="empty"):
        tok.encode(["fine", "  "])
    with pytest.warns(UserWarning, match="truncated to 512"):
        tokens, mask = tok.encode(["word " * 600])
    assert tokens.shape == (1, 512) and mask.all() and tokens[0, -1] == 102  # [SEP] kept


def test_sharded_zero3_equals_unsharded(encoder, n_devices):
    graphdef, params, tok, fn = encoder
    texts = ["The cat sat on the mat.", "Numbers: 3.14 and 42.", "Ünïcödé text — ok."]
    single, _ = place(params, graphdef, 1, "dp")
    want = encode(fn, single, tok, texts)
    sharded, mesh = place(params, graphdef, n_devices, "zero3")
    q_kernel = sharded["blocks"]["attn"]["q"]["kernel"]
    assert q_kernel.sharding.spec[1] == "fsdp"  # [layers, embed, heads]: embed split
    assert q_kernel.addressable_shards[0].data.shape == (6, 384 // n_devices, 384)
    got = encode(fn, sharded, tok, texts)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_dp_splits_each_batch_over_the_mesh(encoder, n_devices):
    """embed's dp placement replicates the parameters: the batch must be split, or every
    device computes every batch (what `embed --devices 8` did)."""
    graphdef, params, tok, fn = encoder
    texts = ["The cat sat on the mat.", "Numbers: 3.14 and 42.", "Ünïcödé text — ok."]
    want = encode(fn, params, tok, texts)
    replicated, mesh = place(params, graphdef, n_devices, "dp")
    seen = []

    def spy(p, tokens, mask):
        seen.append(tokens)
        return fn(p, tokens, mask)

    got = encode(spy, replicated, tok, texts, mesh=mesh)
    np.testing.assert_allclose(got, want, atol=1e-5)
    rows = seen[0].shape[0]
    assert rows % n_devices == 0 and len(seen[0].sharding.device_set) == n_devices
    assert {s.data.shape[0] for s in seen[0].addressable_shards} == {rows // n_devices}


def test_convert_to_orbax_round_trip(tmp_path, encoder):
    out = convert(tmp_path / "minilm")
    cfg, params, tok_path = load_converted(out)
    assert cfg == load_pretrained()[0] and tok_path.is_file()
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(encoder[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- loader errors, on a tiny HF-format checkpoint (fast to write) ------------------------------

TINY = {"model_type": "bert", "hidden_act": "gelu", "vocab_size": 40, "hidden_size": 8,
        "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 16,
        "max_position_embeddings": 16, "type_vocab_size": 2, "layer_norm_eps": 1e-12}


def hf_tensors(cfg: BertConfig) -> dict:
    """Random tensors under HF BERT names with HF shapes (Linear weights [out, in])."""
    rng = np.random.default_rng(0)
    shapes = expected_shapes(cfg)
    out = {name: rng.normal(size=shapes[path]).astype(np.float32)
           for name, path in _TOP_MAP.items()}
    for i in range(cfg.n_layers):
        for stem, (module, linear) in _LAYER_MAP.items():
            w = shapes[f"{module}/{'kernel' if linear else 'scale'}"]
            out[f"encoder.layer.{i}.{stem}.weight"] = rng.normal(size=w[::-1]).astype(np.float32)
            out[f"encoder.layer.{i}.{stem}.bias"] = rng.normal(
                size=shapes[f"{module}/bias"]).astype(np.float32)
    out["embeddings.position_ids"] = np.arange(cfg.max_positions)[None]
    out["pooler.dense.weight"] = np.zeros((cfg.d_model, cfg.d_model), np.float32)
    return out


def write_model(folder: Path, tensors: dict, config: dict = TINY) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copyfile(package_model_dir() / "tokenizer.json", folder / "tokenizer.json")
    return folder


def test_tiny_checkpoint_loads_with_transposes(tmp_path):
    from model.hf_bert import config_from_hf

    cfg = config_from_hf(TINY)
    tensors = hf_tensors(cfg)
    _, params = load_pretrained(write_model(tmp_path / "m", tensors))
    np.testing.assert_array_equal(params["blocks"]["mlp"]["up"]["kernel"][1],
                                  tensors["encoder.layer.1.intermediate.dense.weight"].T)
    np.testing.assert_array_equal(params["blocks"]["attn_out_norm"]["scale"][0],
                                  tensors["encoder.layer.0.attention.output.LayerNorm.weight"])


def _broken(kind: str) -> tuple[dict, dict, bytes | None]:
    """(tensors, config, raw file bytes or None) of one broken checkpoint."""
    from model.hf_bert import config_from_hf

    tensors, config = hf_tensors(config_from_hf(TINY)), dict(TINY)
    raw = None
    if kind == "missing":
        del tensors["encoder.layer.1.output.dense.bias"]
    elif kind == "extra":
        tensors["encoder.layer.0.attention.self.rotary.weight"] = np.zeros((8, 8), np.float32)
    elif kind == "shape":
        tensors["encoder.layer.0.attention.self.query.weight"] = np.zeros((8, 6), np.float32)
    elif kind == "config":
        config["num_hidden_layers"] = 3
    elif kind == "corrupt":
        raw = b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\": [1, 2"  # header cut short
    elif kind == "foreign":
        raw = b"PK\x03\x04 this is a zip/pickle, not safetensors" * 4
    return tensors, config, raw


@pytest.mark.parametrize("kind,fragment", [
    ("missing", "missing tensor for blocks/mlp/down/bias (layer 1)"),
    ("extra", "extra tensor 'encoder.layer.0.attention.self.rotary.weight'"),
    ("shape", "has shape [8, 6], config.json implies [8, 8]"),
    ("config", "num_hidden_layers=3 but the weights hold 2 layers"),
    ("corrupt", "not a readable safetensors file"),
    ("foreign", "not a readable safetensors file"),
])
def test_loader_errors_leave_nothing_written(tmp_path, kind, fragment):
    tensors, config, raw = _broken(kind)
    folder = write_model(tmp_path / "bad", tensors, config)
    if raw is not None:
        (folder / "model.safetensors").write_bytes(raw)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as err:
        convert(out, folder)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_convert_cli_one_line_error(tmp_path):
    tensors, config, _ = _broken("missing")
    folder = write_model(tmp_path / "bad", tensors, config)
    proc = cli("convert_minilm", "--out", str(tmp_path / "out"), "--model-dir", str(folder))
    one_line_error(proc, "missing tensor")
    assert not (tmp_path / "out").exists()


def test_unsupported_config_is_refused():
    from model.hf_bert import config_from_hf

    with pytest.raises(CheckpointError, match="hidden_act='relu'"):
        config_from_hf({**TINY, "hidden_act": "relu"})
    with pytest.raises(CheckpointError, match="missing field 'hidden_size'"):
        config_from_hf({k: v for k, v in TINY.items() if k != "hidden_size"})


# --- the CLI as a user runs it ------------------------------------------------------------------

def test_embed_cli_json(encoder):
    _, params, tok, fn = encoder
    texts = ["A man is eating food.", "A man is eating a piece of bread."]
    proc = cli("embed", "--json", "--devices", "1", "--text", texts[0], "--text", texts[1])
    assert proc.returncode == 0, proc.stderr
    emb = np.asarray(json.loads(proc.stdout.strip().splitlines()[-1])["embeddings"])
    assert emb.shape == (2, 384)
    np.testing.assert_allclose(emb, encode(fn, params, tok, texts), atol=1e-5)


def test_embed_cli_bad_input():
    one_line_error(cli("embed", "--text", " "), "text 0: empty")
    one_line_error(cli("embed", "--text", "caf\udcc3"), "text 0: not valid UTF-8 (byte 0xc3")
    one_line_error(cli("embed", "--quant", "w4", "--text", "a"), "quant='w4'")
    one_line_error(cli("embed", "--checkpoint", "/nonexistent/minilm", "--text", "a"),
                   "checkpoint='/nonexistent/minilm': holds no converted encoder")


def test_tokenizer_file_errors(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(CheckpointError, match="not a usable tokenizer.json"):
        Tokenizer(bad)


@pytest.mark.parametrize("module,flag", [("convert_minilm", "--out"), ("embed", "--convert")])
def test_conversion_never_replaces_a_folder_it_did_not_write(tmp_path, module, flag):
    """The conversion replaces its output folder whole, so a folder of other files (a mistyped
    path, a training run) or a file is refused before anything is read, and stays as it was."""
    other = tmp_path / "run"
    other.mkdir()
    (other / "config.json").write_text("{}")
    # The line names the flag the user gave.
    one_line_error(cli(module, flag, str(other)), f"{flag[2:]}=", "holds other files")
    assert [p.name for p in other.iterdir()] == ["config.json"]
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    one_line_error(cli(module, flag, str(a_file)), "is a file")
    assert a_file.read_text() == "keep"


def test_a_conversion_replaces_an_earlier_one(tmp_path):
    from model.hf_bert import config_from_hf

    folder = write_model(tmp_path / "tiny", hf_tensors(config_from_hf(TINY)))
    out = convert(tmp_path / "out", folder)
    (out / "stale").write_text("from the earlier conversion")
    again = convert(out, folder)
    assert again == out and not (out / "stale").exists() and load_converted(out)[0]
    (tmp_path / "empty").mkdir()  # an empty folder is taken too
    assert convert(tmp_path / "empty", folder) == (tmp_path / "empty").absolute()
