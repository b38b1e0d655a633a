"""Export of every family the Hugging Face reader reads (llama, mistral, qwen2, qwen3,
gemma3_text, and phi3 for RoPE on part of each head and LongRoPE) against the tiny models
transformers made (tests/fixtures/hf/, written by experiments/reference/make_hf_fixtures.py): our
safetensors export holds transformers' own tensor names and values (Phi-3's fused ones included)
and our reader reads it back to the same config and bit-identical parameters; Qwen2, Qwen3 and
Gemma 3 GGUFs read back through model/llama_gguf.py; what a format has no place for is refused
in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from experiments.cli.config import ConfigError
from experiments.pretrained import exporter
from model.gguf import GGUFFile
from model.hf_decoder import load_hf
from model.hf_tokenizer import HFTokenizer
from model.llama_export import GGUF_FILE, SAFETENSORS_FILE
from model.llama_gguf import load_gguf
from model.tokenizer import tokenizer_from_gguf
from tests import gguf_files

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3_partial",
         "phi3_longrope")
# config.json keys whose values transformers' own save_pretrained wrote and ours must repeat
SAME_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
             "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
             "tie_word_embeddings", "rope_parameters", "sliding_window", "layer_types",
             "query_pre_attn_scalar", "final_logit_softcapping", "hidden_activation",
             "use_sliding_window", "max_position_embeddings")


def _lookup(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}/")
        else:
            yield prefix + k, np.asarray(v)


def source(cfg, params, label="fixture", gguf=None, hf_folder=None):
    return exporter.Source(label, cfg, lambda p: np.asarray(_lookup(params, p), np.float32),
                           gguf, hf_folder=hf_folder)


@pytest.mark.parametrize("arch", ARCHS)
def test_safetensors_round_trip(arch, tmp_path):
    """(LongRoPE's folder keeps its longest context, which is not the one it runs with by
    default: the folder's own.)"""
    cfg, params = load_hf(FIXTURES / arch)
    summary = exporter.export(source(cfg, params, hf_folder=FIXTURES / arch), "safetensors",
                              tmp_path / "out")
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    theirs = json.loads((FIXTURES / arch / "config.json").read_text())
    longrope = cfg.rope_short_factors is not None
    for key in SAME_KEYS + (("original_max_position_embeddings",) if longrope else ()):
        if key in theirs:  # the type too: transformers' configs check their fields' types
            assert ours.get(key) == theirs[key], (arch, key)
            assert type(ours.get(key)) is type(theirs[key]), (arch, key)
    # transformers' names and values, tensor for tensor (a tied head is not saved)
    want, got = load_file(str(FIXTURES / arch / SAFETENSORS_FILE)), load_file(
        str(tmp_path / "out" / SAFETENSORS_FILE))
    if cfg.tie_embeddings:
        want.pop("lm_head.weight", None)
    assert got.keys() == want.keys() and summary["tensors"] == len(got)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    cfg2, params2 = load_hf(tmp_path / "out")
    assert cfg2 == cfg
    a, b = dict(_flat(params)), dict(_flat(params2))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_longrope_names_its_attention_factor_where_the_context_would_change_it(tmp_path):
    """Exported with a context of 16 (a run's max_len, no folder beside it), transformers would
    derive LongRoPE's attention factor 1 from 16 / 24 positions: the model's own is written
    out, and the folder reads back as the model at that context."""
    cfg, params = load_hf(FIXTURES / "phi3_longrope")
    short = dataclasses.replace(cfg, max_len=16)
    exporter.export(source(short, params), "safetensors", tmp_path / "out")
    rope = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert rope["attention_factor"] == cfg.rope_attention_factor > 1
    assert load_hf(tmp_path / "out")[0] == short


def test_longrope_with_its_own_head_size_is_refused(tmp_path):
    """transformers counts LongRoPE's factors from hidden_size / num_attention_heads: a phi3
    folder of another head size would not load there, so it is refused, nothing written."""
    cfg, params = load_hf(FIXTURES / "phi3_longrope")
    odd = dataclasses.replace(cfg, head_size=8, rotary_dim=6, rope_short_factors=(1.0,) * 3,
                              rope_long_factors=(2.0,) * 3)
    with pytest.raises(ConfigError, match=r"head_size=8: phi3's config.json takes LongRoPE only "
                                          r"with the head size d_model / n_heads \(16\)"):
        exporter.export(source(odd, params), "safetensors", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def _conventional(cfg):
    """The fixture's Gemma with the conventions a GGUF cannot state but its readers assume:
    every sixth layer global, queries scaled by 1/sqrt(head size)."""
    pattern = "".join("g" if (i + 1) % 6 == 0 else "s" for i in range(cfg.n_layers))
    return dataclasses.replace(cfg, layer_pattern=pattern,
                               query_pre_attn_scalar=float(cfg.head_dim))


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    """Tokenizer metadata for a GGUF (a tiny BPE file: the round trips read no text)."""
    return GGUFFile(gguf_files.write(tmp_path_factory.mktemp("meta") / "meta.gguf"))


def test_gemma3_gguf_round_trip(meta, tmp_path):
    cfg, params = load_hf(FIXTURES / "gemma3_text")
    cfg = _conventional(cfg)
    exporter.export(source(cfg, params, gguf=meta), "gguf", tmp_path / "g")
    path = tmp_path / "g" / GGUF_FILE
    g = GGUFFile(path)
    assert g.get_str("general.architecture") == "gemma3"
    assert "blk.0.post_ffw_norm.weight" in g.tensors and "output.weight" not in g.tensors
    # the file holds 1 + w for every norm and Hugging Face's q/k row order
    np.testing.assert_array_equal(g.tensor("blk.1.attn_q_norm.weight"),
                                  params["blocks"]["attn"]["q_norm"]["scale"][1] + 1)
    np.testing.assert_array_equal(g.tensor("blk.0.attn_q.weight"),
                                  params["blocks"]["attn"]["q"]["kernel"][0].T)
    cfg2, back, _ = load_gguf(path)
    assert cfg2 == dataclasses.replace(cfg, max_len=cfg2.max_len)
    a, b = dict(_flat(params)), dict(_flat(back))
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith("norm/scale"):  # (1 + w) - 1 in float32: within an ulp of 1 + w
            np.testing.assert_allclose(b[k], a[k], rtol=0, atol=np.spacing(np.float32(2.0)))
        else:
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    # a model read from a GGUF goes back to the same bytes' values exactly
    exporter.export(source(cfg2, back, gguf=meta), "gguf", tmp_path / "g2")
    _, again, _ = load_gguf(tmp_path / "g2" / GGUF_FILE)
    for k, v in _flat(again):
        np.testing.assert_array_equal(v, b[k], err_msg=k)


@pytest.mark.parametrize("arch, extra", [
    ("qwen2", {"blk.1.attn_q.bias": "blocks/attn/q/bias", "blk.0.attn_k.bias": "blocks/attn/k/bias",
               "blk.1.attn_v.bias": "blocks/attn/v/bias"}),
    ("qwen3", {"blk.1.attn_q_norm.weight": "blocks/attn/q_norm/scale",
               "blk.0.attn_k_norm.weight": "blocks/attn/k_norm/scale"}),
])
def test_qwen_gguf_round_trip(arch, extra, meta, tmp_path):
    """A qwen2 / qwen3 GGUF holds llama.cpp's names for the biases or q/k norms, and the q/k
    rows in Hugging Face's order (llama.cpp rotates them as NeoX does), where a llama GGUF
    interleaves them; it reads back to the same config and bit-identical parameters."""
    cfg, params = load_hf(FIXTURES / arch)
    exporter.export(source(cfg, params, gguf=meta), "gguf", tmp_path / "q")
    g = GGUFFile(tmp_path / "q" / GGUF_FILE)
    assert g.get_str("general.architecture") == arch
    for name, path in extra.items():
        layer = int(name.split(".")[1])
        np.testing.assert_array_equal(g.tensor(name), _lookup(params, path)[layer], err_msg=name)
    q = params["blocks"]["attn"]["q"]["kernel"][0].T
    np.testing.assert_array_equal(g.tensor("blk.0.attn_q.weight"), q)
    exporter.export(source(dataclasses.replace(cfg, qkv_bias=False, qk_norm=False),
                           params, gguf=meta), "gguf", tmp_path / "llama")  # the control
    g_llama = GGUFFile(tmp_path / "llama" / GGUF_FILE)
    assert g_llama.get_str("general.architecture") == "llama"
    assert not np.array_equal(g_llama.tensor("blk.0.attn_q.weight"), q)
    cfg2, back, _ = load_gguf(tmp_path / "q" / GGUF_FILE)
    assert cfg2 == dataclasses.replace(cfg, max_len=cfg2.max_len)
    a, b = dict(_flat(params)), dict(_flat(back))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


@pytest.mark.parametrize("arch, fmt, fragment", [
    ("gemma3_text", "gguf", "layer_pattern='sgsg': a gemma3 GGUF has no place for it"),
    ("mistral", "gguf", "sliding_window=16: format='gguf' has no window for the llama layout"),
    ("phi3", "gguf", "sliding_window=16: format='gguf' has no window for the llama layout"),
])
def test_what_a_format_cannot_hold_is_refused(arch, fmt, fragment, meta, tmp_path):
    cfg, params = load_hf(FIXTURES / arch)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        exporter.export(source(cfg, params, gguf=meta), fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_fields_no_family_holds_are_refused(tmp_path):
    cfg, params = load_hf(FIXTURES / "qwen2")
    odd = dataclasses.replace(cfg, sliding_window=8)  # Qwen2's biases and Mistral's window
    with pytest.raises(ConfigError, match="sliding_window=8: qwen2's config.json has no place"):
        exporter.export(source(odd, params), "safetensors", tmp_path / "out")
    gelu = dataclasses.replace(cfg, mlp="gelu", qkv_bias=False)
    with pytest.raises(ConfigError, match="mlp='gelu': no exported family"):
        exporter.export(source(gelu, params), "safetensors", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def qwen2_run(tmp_path_factory):
    """One zero3 step on 2 devices from the qwen2 fixture folder (q/k/v biases, tied head)."""
    from experiments.training.init_config import pretrained_base
    from experiments.training.trainer import train_and_evaluate

    base = pretrained_base(str(FIXTURES / "qwen2"), None)
    cfg = dataclasses.replace(base, model=dataclasses.replace(
        base.model, max_len=32, param_dtype="float32", compute_dtype="float32", remat="none"),
        train=dataclasses.replace(base.train, steps=1, batch_size=2, warmup_steps=0, lr=1e-3,
                                  eval_every=1, eval_batches=1, ckpt_every=1, devices=2))
    workdir = tmp_path_factory.mktemp("qwen2_run") / "run"
    train_and_evaluate(cfg, workdir, progress=False)
    return workdir


def test_a_run_from_a_hugging_face_folder_exports_as_its_family(qwen2_run, tmp_path):
    """Its trained weights, the folder's tokenizer files as they are, qwen2's config.json; its
    GGUF holds the same weights and the folder's tokenizer."""
    from experiments.training.restore import restore_params

    summary = exporter.export(exporter.pretrained_source(str(qwen2_run)), "safetensors",
                              tmp_path / "out")
    assert summary["model_type"] == "qwen2" and summary["tokenizer"] == "hf"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (FIXTURES / "qwen2" / name).read_bytes()
    cfg, back = load_hf(tmp_path / "out")
    assert cfg.qkv_bias and cfg.max_len == 256  # the folder's context, not the run's 32
    trained = jax.device_get(restore_params(qwen2_run, devices=1).params)
    for k, v in _flat(trained):
        np.testing.assert_array_equal(_lookup(back, k), v, err_msg=k)
    summary = exporter.export(exporter.run_source(qwen2_run), "gguf", tmp_path / "g")
    assert summary["tokenizer"] == "bpe"
    _, from_gguf, g = load_gguf(tmp_path / "g" / GGUF_FILE)
    for k, v in _flat(trained):
        np.testing.assert_array_equal(_lookup(from_gguf, k), v, err_msg=k)
    theirs = HFTokenizer(FIXTURES / "qwen2")
    ours = tokenizer_from_gguf(g)
    for text in ("The capital of France is", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == theirs.encode(text)


def test_a_run_from_a_gguf_file_exports_with_that_files_tokenizer(tmp_path):
    """A run started from a .gguf file (not the packaged SmolLM2) writes a GGUF whose tokenizer
    is that file's, and reads back to its trained weights."""
    from experiments.training.init_config import pretrained_base
    from experiments.training.restore import restore_params
    from experiments.training.trainer import train_and_evaluate

    src = gguf_files.write(tmp_path / "tiny.gguf")
    base = pretrained_base(str(src), None)
    cfg = dataclasses.replace(base, model=dataclasses.replace(
        base.model, max_len=32, param_dtype="float32", compute_dtype="float32", remat="none"),
        train=dataclasses.replace(base.train, steps=1, batch_size=2, warmup_steps=0, lr=1e-3,
                                  eval_every=1, eval_batches=1, ckpt_every=1, devices=2))
    train_and_evaluate(cfg, tmp_path / "run", progress=False)
    summary = exporter.export(exporter.pretrained_source(str(tmp_path / "run")), "gguf",
                              tmp_path / "out")
    assert summary["tokenizer"] == "bpe"
    out = GGUFFile(tmp_path / "out" / GGUF_FILE)
    assert out.get_strings("tokenizer.ggml.tokens") == GGUFFile(src).get_strings(
        "tokenizer.ggml.tokens")
    _, back, _ = load_gguf(tmp_path / "out" / GGUF_FILE)
    trained = jax.device_get(restore_params(tmp_path / "run", devices=1).params)
    for k, v in _flat(trained):
        np.testing.assert_array_equal(_lookup(back, k), v, err_msg=k)
