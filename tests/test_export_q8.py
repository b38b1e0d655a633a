"""int8 export to GGUF Q8_0 (model/gguf_q8.py, experiments/pretrained/export_q8.py) against
independent readers: the `gguf` package's Q8_0 kernels (a bit-exact port of ggml's) and its own
file reader, and our int8 model quantised again from what our loader reads back. A tiny random
Llama-architecture model (2 blocks, a few hundred KB) stands in for SmolLM2; one test runs
llama.cpp's own llama-perplexity on it when $SHARDQ_LLAMA_CPP names the tools."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from experiments.pretrained import export_q8, exporter, loading, scoring
from model.config import ModelConfig
from model.gguf import GGUFFile
from model.gguf_q8 import Int8Rows, Q8Error, dequantized, pack
from model.llama_export import GGUF_FILE
from model.llama_gguf import expected_shapes, load_gguf, set_path
from model.tokenizer import tokenizer_from_gguf
from quant.modes import DEFAULT_RULES, QuantConfig
from tests import gguf_files
from tests.helpers import launch_in_one_process, llama_cpp_tools

FIXTURES = Path(__file__).parent / "fixtures"
CFG = ModelConfig(vocab_size=gguf_files.VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64, mlp="swiglu", tie_embeddings=True, max_len=256, norm_eps=1e-5)
TEXTS = ["the theme of the thesis", "x = {'a': 1}\nprint(x)"]


def random_rows(rng, rows: int, cols: int, full_blocks: bool = False) -> Int8Rows:
    q = rng.integers(-127, 128, size=(rows, cols)).astype(np.int8)
    if full_blocks:  # every block holds its row's absmax, as absmax quantisation gives a row
        q[:, ::32] = np.where(rng.random((rows, cols // 32)) < 0.5, -127, 127)
    scale = (10.0 ** rng.uniform(-4, 1, size=rows)).astype(np.float32)
    return Int8Rows(q, scale)


def test_q8_0_bytes_are_what_the_gguf_package_reads():
    rng = np.random.default_rng(0)
    rows = random_rows(rng, 6, 96)
    raw = pack(rows)
    assert raw.dtype == np.uint8 and raw.shape == (6, 3 * 34)
    d16 = rows.scale.astype(np.float16).astype(np.float32)
    want = rows.q.astype(np.float32) * d16[:, None]  # exact: int8 times an 11-bit significand
    np.testing.assert_array_equal(dequantized(rows), want)
    np.testing.assert_array_equal(gguf.quants.dequantize(raw, QT.Q8_0), want)
    # the layout by hand: each 34-byte block is fp16 d, then 32 int8 values of one row
    blocks = raw.reshape(6, 3, 34)
    np.testing.assert_array_equal(blocks[..., :2].copy().view("<f2")[..., 0],
                                  np.repeat(rows.scale.astype(np.float16)[:, None], 3, axis=1))
    np.testing.assert_array_equal(blocks[..., 2:].copy().view(np.int8).reshape(6, 96), rows.q)


def test_ggml_quantiser_gives_the_same_bytes_from_our_values():
    # A row quantised by absmax has a +-127 in it; where every block has one, ggml's own Q8_0
    # of the dequantised row (per-block scales) finds exactly our scale and our int8 values.
    rows = random_rows(np.random.default_rng(1), 5, 64, full_blocks=True)
    raw = pack(rows)
    np.testing.assert_array_equal(gguf.quants.quantize(dequantized(rows), QT.Q8_0), raw)


def test_block_scales_become_each_blocks_d():
    """A block-scaled table (quant's int8 embedding) packs each block's own scale as its fp16
    d, and ggml's quantiser, given our values, finds the same bytes; a per-row copy of the
    same values (the control) packs other bytes."""
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, size=(4, 96)).astype(np.int8)
    q[:, ::32] = 127  # each block holds its absmax, as block quantisation gives it
    scale = (10.0 ** rng.uniform(-4, 1, size=(4, 3))).astype(np.float32)
    rows = Int8Rows(q, scale)
    raw = pack(rows)
    want = (q.reshape(4, 3, 32) * scale.astype(np.float16).astype(np.float32)[..., None])
    np.testing.assert_array_equal(dequantized(rows), want.reshape(4, 96))
    np.testing.assert_array_equal(gguf.quants.dequantize(raw, QT.Q8_0), want.reshape(4, 96))
    np.testing.assert_array_equal(gguf.quants.quantize(dequantized(rows), QT.Q8_0), raw)
    assert not np.array_equal(pack(Int8Rows(q, scale[:, 0])), raw)
    with pytest.raises(Q8Error, match="do not fit scales"):
        Int8Rows(q, scale[:, :2])


def test_q8_0_refusals():
    rng = np.random.default_rng(2)
    with pytest.raises(Q8Error, match="rows of 48 values; Q8_0 needs a multiple of 32"):
        pack(random_rows(rng, 2, 48))
    big = Int8Rows(np.ones((1, 32), np.int8), np.array([1e6], np.float32))
    with pytest.raises(Q8Error, match="does not fit fp16"):
        pack(big)


def _tiny_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out: dict = {}
    for path, shape in expected_shapes(CFG).items():
        if path.endswith("/kernel"):
            shape = shape[::-1]  # [in, out]
        lead = (CFG.n_layers,) if path.startswith("blocks/") else ()
        base, std = (1.0, 0.1) if path.endswith("/scale") else (0.0, 0.3)
        set_path(out, path, (base + std * rng.standard_normal(lead + shape)).astype(np.float32))
    return out


def _lookup(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A float Source of the tiny model (tokenizer metadata from a tiny GGUF) and, per mode,
    its int8 source and the exported file."""
    tmp = tmp_path_factory.mktemp("q8")
    meta = GGUFFile(gguf_files.write(tmp / "meta.gguf"))
    params = _tiny_params()
    src = exporter.Source("tiny", CFG, lambda p: np.asarray(_lookup(params, p)), meta)
    out = {}
    for mode, alpha in (("w8", None), ("w8a8", None), ("smoothquant", 0.5)):
        q = export_q8.quantized_source(src, mode, alpha)
        exporter.export(q, "gguf", tmp / mode)
        out[mode] = (q, tmp / mode / GGUF_FILE)
    return src, params, out


def test_file_holds_q8_0_kernels_and_embedding_f32_norms(tiny):
    _, _, out = tiny
    q, path = out["w8a8"]
    g = GGUFFile(path)
    types = {name: QT(t.ggml_type) for name, t in g.tensors.items()}
    assert types["token_embd.weight"] == QT.Q8_0 and types["output_norm.weight"] == QT.F32
    for i in range(CFG.n_layers):
        for stem in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                     "ffn_down"):
            assert types[f"blk.{i}.{stem}.weight"] == QT.Q8_0
        assert types[f"blk.{i}.attn_norm.weight"] == types[f"blk.{i}.ffn_norm.weight"] == QT.F32
    assert g.get_int("general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert q.quant_info["int8_modules"] == sorted(
        ["embed", *(f"blocks/{m}" for m in ("attn/k", "attn/o", "attn/q", "attn/v",
                                            "mlp/down", "mlp/gate", "mlp/up"))])
    # the independent reader dequantises every tensor as ours does
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(g.tensors[t.name].shape)
        np.testing.assert_array_equal(theirs, g.tensor(t.name), err_msg=t.name)
    # w8 and w8a8 share their int8 weights: llama.cpp gets the same file
    assert out["w8"][1].read_bytes() == path.read_bytes()


@pytest.mark.parametrize("mode", ["w8a8", "smoothquant"])
def test_read_back_is_our_int8_model(tiny, mode):
    """Our loader's float32 values are our int8 weights times their fp16-rounded scales, the
    norms are the (folded) ones our int8 model uses, and quantising the read-back model again
    gives back every int8 value and the fp16-rounded scales exactly."""
    _, _, out = tiny
    q, path = out[mode]
    cfg, back, _ = load_gguf(path)
    assert cfg == CFG
    for path_ in expected_shapes(CFG):
        got = _lookup(back, path_)
        leaf = q.read(path_)
        if isinstance(leaf, Int8Rows):
            want = dequantized(leaf)  # [.., out, in]: ours is [.., in, out] for a kernel
            want = want if path_ == "embed/embedding" else np.swapaxes(want, -1, -2)
        else:
            want = leaf
        np.testing.assert_array_equal(got, want, err_msg=path_)
    pre = loading.Pretrained("back", cfg, loading.abstract_graphdef(cfg),
                             jax.tree.map(np.asarray, back), None)
    again = loading.quantize(pre, "w8a8", QuantConfig(mode="w8a8", rules=DEFAULT_RULES))
    params = jax.device_get(again.params)
    for module in q.quant_info["int8_modules"]:
        rows, leaf = export_q8.rows_of(params, module), q.read(
            "embed/embedding" if module == "embed" else f"{module}/kernel")
        np.testing.assert_array_equal(rows.q, leaf.q, err_msg=module)
        np.testing.assert_array_equal(rows.scale, leaf.scale.astype(np.float16)
                                      .astype(np.float32), err_msg=module)


def test_read_back_scores_as_the_int8_model_with_fp16_scales(tiny):
    """Weight-only: the float model read back from the file against our w8 int8 model with
    its scales rounded to fp16 (the only change the file makes): the same products summed in
    another order, so the mean NLLs agree to float rounding."""
    src, _, out = tiny
    q, path = out["w8"]
    tok = tokenizer_from_gguf(src.gguf)
    cfg, back, _ = load_gguf(path)
    read_back = loading.Pretrained("back", cfg, loading.abstract_graphdef(cfg),
                                   jax.tree.map(np.asarray, back), tok)
    int8, _ = export_q8.quantized_params(src, "w8")
    params = jax.device_get(int8.params)
    for module in q.quant_info["int8_modules"]:
        node = _lookup(params, module)
        key = "block_scale" if module == "embed" else "kernel_scale"
        node[key] = np.asarray(node[key]).astype(np.float16).astype(np.float32)
    int8 = dataclasses.replace(int8, params=params, tokenizer=tok)
    a, b = scoring.score_texts(read_back, TEXTS), scoring.score_texts(int8, TEXTS)
    for x, y in zip(a, b, strict=True):
        assert x["next_token"] == y["next_token"]
        assert abs(x["mean_nll"] - y["mean_nll"]) <= 1e-5


def test_bad_quant_refused_in_one_line(tmp_path):
    out = str(tmp_path / "out")
    rows = launch_in_one_process([
        ("experiments.export", ["--model", "smollm2", "--quant", "w8a8-rotated", "--format",
                                "gguf", "--out", out]),
        ("experiments.export", ["--model", "smollm2", "--quant", "w8a8", "--out", out]),
        ("experiments.export", ["--model", "smollm2", "--step", "3", "--out", out]),
        ("experiments.llama_cpp_int8", ["--modes", "w8,auto", "--out", out + ".json"]),
        ("experiments.llama_cpp_int8", ["--llama-cpp", str(tmp_path), "--out", out + ".json"]),
    ])
    said = [r["stderr"].strip() for r in rows]
    assert all(r["status"] == 2 and not r["jax_imported"] for r in rows), said
    assert all(len(s.splitlines()) == 1 for s in said), said
    assert "quant='w8a8-rotated': allowed none, w8, w8a8, smoothquant" in said[0]
    assert "Hadamard rotation" in said[0]
    assert "quant='w8a8': only with --format gguf" in said[1]
    assert "step=3: only for a training run" in said[2]
    assert "modes='w8,auto': allowed" in said[3]
    assert "holds no executable llama-quantize and llama-perplexity" in said[4]
    assert not os.path.exists(out) and not os.path.exists(out + ".json")


def test_llama_perplexity_report_is_read():
    """The figures of llama-perplexity's two reports as recorded (the tiny model below, its
    float32 export saving the logits, then its w8a8 Q8_0 against them)."""
    from experiments.speed import llama_cpp

    base = llama_cpp.parse_perplexity((FIXTURES / "llama_perplexity_base.txt").read_text(),
                                      kl=False)
    assert base == {"perplexity": 1082.61, "perplexity_uncertainty": 198.47651, "chunks": 2,
                    "ctx": 128}
    kl = llama_cpp.parse_perplexity((FIXTURES / "llama_perplexity_kl.txt").read_text(), kl=True)
    assert kl == {"perplexity": 1075.242076, "perplexity_uncertainty": 198.694899,
                  "kl_mean": 0.003539, "kl_median": 0.002683, "kl_p99": 0.016661,
                  "kl_max": 0.023877, "top1_agree": pytest.approx(0.92063), "chunks": 2,
                  "ctx": 128}
    with pytest.raises(llama_cpp.PeerError, match="printed no kl_mean"):
        llama_cpp.parse_perplexity((FIXTURES / "llama_perplexity_base.txt").read_text()
                                   .replace("Final estimate", "x") + "Mean PPL(Q) : 1 ± 1",
                                   kl=True)


def test_llama_perplexity_reads_our_q8_0(request, tmp_path):
    """llama.cpp's own perplexity tool on the tiny model's float32 export and on our w8a8 Q8_0:
    both run, and the KL divergence it reports between them is small and non-negative. Without
    the tools (CI has none) the locator's absent line is what this checks; outside CI the test
    is skipped with that reason."""
    from experiments.speed import llama_cpp

    tools = llama_cpp_tools(need=("llama-quantize", llama_cpp.PERPLEXITY))
    if tools is None:
        return
    src, _, out = request.getfixturevalue("tiny")  # made only when the tools are there
    exporter.export(src, "gguf", tmp_path / "f32")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(TEXTS) * 200)
    base = tmp_path / "base.kld"
    kw = dict(ctx=128, chunks=2)  # llama.cpp prints no statistics under 100 positions
    f32 = llama_cpp.perplexity(tools, tmp_path / "f32" / GGUF_FILE, 1, base, text=text, **kw)
    q8 = llama_cpp.perplexity(tools, out["w8a8"][1], 1, base, text=None, **kw)
    assert f32["chunks"] == q8["chunks"] == 2 and np.isfinite(f32["perplexity"])
    assert 0 <= q8["kl_mean"] < 0.1 and 0.5 < q8["top1_agree"] <= 1
