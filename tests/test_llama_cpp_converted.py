"""GGUF files llama.cpp's own converter made from the transformers-made folders
(tests/fixtures/gguf_converted/, written by experiments/reference/make_llama_cpp_ggufs.py):
shardq's GGUF reader, which did not write them, reads each to the folder's config and
bit-identical parameters (llama's rotary rows put back, Llama 3's scaling recovered from its
`rope_freqs`, Qwen2's biases, Qwen3's q/k norms and head size, Phi-3's fused tensors split,
its window, Phi-4-mini's RoPE on part of each head from `rope.dimension_count` and its LongRoPE
from `rope_factors_*`), tokenizes
as transformers did (the SentencePiece model of llama_spm as SentencePiece itself does: a space
prefix, byte fallback, digits one at a time) and scores within 1e-4 nats of transformers'
reference."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from experiments.pretrained import loading, scoring
from model.hf_decoder import load_hf
from model.llama_gguf import load_gguf
from tests.helpers import launch_in_one_process, nll_as_llama_cpp

HF = Path(__file__).parent / "fixtures" / "hf"
CONVERTED = Path(__file__).parent / "fixtures" / "gguf_converted"
ARCHS = ("llama", "llama3", "qwen2", "qwen3", "llama_spm", "phi3", "phi3_partial",
         "phi3_longrope")
GGUF_ARCH = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "llama_spm": "llama", "phi3": "phi3", "phi3_partial": "phi3",
             "phi3_longrope": "phi3"}


@pytest.mark.parametrize("arch", ARCHS)
def test_reads_the_converters_file_as_the_folder(arch):
    cfg, params = load_hf(HF / arch)
    cfg2, back, g = load_gguf(CONVERTED / f"{arch}.gguf")
    assert g.get_str("general.architecture") == GGUF_ARCH[arch]
    assert ("rope_freqs.weight" in g.tensors) == (arch == "llama3")
    assert cfg2 == dataclasses.replace(cfg, max_len=cfg2.max_len)
    a, b = flatten_dict(params, sep="/"), flatten_dict(back, sep="/")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]), err_msg=k)
    if arch == "llama":  # the converter reorders q/k rows; the file is not the folder's order
        q = np.asarray(params["blocks"]["attn"]["q"]["kernel"][0]).T
        assert not np.array_equal(g.tensor("blk.0.attn_q.weight"), q)


@pytest.mark.parametrize("arch", ARCHS)
def test_scores_the_converters_file_as_transformers(arch):
    rows = json.loads((HF / arch / "reference.json").read_text())["results"]
    pre = loading.load(str(CONVERTED / f"{arch}.gguf"))
    for r in rows:
        # SentencePiece reads a control token's text as characters; we match it whole, as
        # transformers' tokenizer does
        want = r["transformers_tokens"] if "</s>" in r["text"] else r["tokens"]
        assert pre.tokenizer.encode(r["text"]) == want, r["text"]
    if arch == "phi3_longrope":  # the longer texts at a context beyond the original one
        longer = dataclasses.replace(pre.cfg, max_len=256)
        pres = [(pre, [r for r in rows if len(r["tokens"]) <= pre.cfg.max_len]),
                (dataclasses.replace(pre, cfg=longer, graphdef=loading.abstract_graphdef(longer)),
                 [r for r in rows if len(r["tokens"]) > pre.cfg.max_len])]
    else:
        pres = [(pre, rows)]
    for model, texts in pres:
        ours = scoring.score_ids(model, [r["tokens"] for r in texts])
        for r, o in zip(texts, ours, strict=True):
            assert o["next_token"] == r["next_token"], r["text"]
            if r["mean_nll"] is not None:
                assert abs(o["mean_nll"] - r["mean_nll"]) <= 1e-4, r["text"]


def test_bench_decode_runs_a_converted_file_cutting_its_prompt_to_the_context(tmp_path):
    """bench_decode on a file llama.cpp made (qwen2): its 400-character prompt, longer than this
    model's 256-token context allows with the new tokens, is cut to fit."""
    out = tmp_path / "decode.json"
    [row] = launch_in_one_process([("experiments.bench_decode", [
        "--model", str(CONVERTED / "qwen2.gguf"), "--variants", "float", "--new-tokens", "8",
        "--repeats", "1", "--rounds", "1", "--decode-only", "--out", str(out)])],
        drop=("SHARDQ_LLAMA_CPP",))
    assert row["status"] == 0, row["stderr"]
    d = json.loads(out.read_text())
    assert d["prompt_tokens"] == 256 - 8 and d["model"] == str(CONVERTED / "qwen2.gguf")
    assert [v["variant"] for v in d["variants"]] == ["float"]
    assert d["variants"][0]["new_tokens"] == 8 and d["variants"][0]["tokens_per_s"] > 0


def test_llama_cpp_runs_the_phi3_files_as_we_read_them(tmp_path):
    """llama.cpp runs its own Phi-3 files (RoPE on three quarters of each head; and LongRoPE,
    whose long factors it takes: its context, rounded up to whole blocks of 256 positions, is
    beyond the fixture's original 24) and its perplexity is ours, at a context that takes the
    same factors, on the windows it tokenized (where its tools are named). Control: the
    LongRoPE model without its attention factor misses it."""
    from experiments.speed import llama_cpp
    from tests.helpers import llama_cpp_tools

    tools = llama_cpp_tools(need=(llama_cpp.PERPLEXITY,))
    if tools is None:
        return
    text = tmp_path / "text.txt"
    rows = json.loads((HF / "phi3" / "reference.json").read_text())["results"]
    text.write_bytes((" ".join(r["text"] for r in rows) * 20).encode())
    for arch, context in (("phi3_partial", None), ("phi3_longrope", 256)):
        base = tmp_path / f"{arch}.kld"
        got = llama_cpp.perplexity(tools, CONVERTED / f"{arch}.gguf", 1, base, text=text,
                                   ctx=48, chunks=2)
        windows = llama_cpp.base_tokens(base)
        theirs = float(np.log(got["perplexity"]))
        pre = loading.load(str(CONVERTED / f"{arch}.gguf"))
        if context is not None:
            pre = loading.with_context(pre, context)

        # these peaky models' NLLs run to tens of nats, summed in float32 in two orders
        assert abs(nll_as_llama_cpp(pre, windows) - theirs) < 5e-4 * theirs, arch
        if context is not None:
            plain = loading.with_context(dataclasses.replace(
                pre, cfg=dataclasses.replace(pre.cfg, rope_attention_factor=1.0)), context)
            assert abs(nll_as_llama_cpp(plain, windows) - theirs) > 5e-3 * theirs



# llama.cpp's sources ship real vocabularies with test texts and the ids Hugging Face's
# tokenizers give them (models/ggml-vocab-NAME.gguf, .inp, .out)
VOCABS = ("llama-spm", "llama-bpe", "qwen2", "gpt-2", "phi-3")


@pytest.mark.parametrize("name", VOCABS)
def test_reads_llama_cpps_vocabularies_as_hugging_face_tokenizes(name):
    """Our GGUF reader gives the recorded ids for every test text of Llama 2's SentencePiece
    vocabulary (its runs of spaces score lowest, so they join last), Llama 3's, Qwen2's,
    GPT-2's and Phi-3's (where llama.cpp's tools are named; their sources sit above them)."""
    from model.gguf import GGUFFile
    from model.tokenizer import tokenizer_from_gguf
    from tests.helpers import llama_cpp_tools

    tools = llama_cpp_tools()
    if tools is None:
        return
    models = next((p / "models" for p in tools.quantize.parents
                   if (p / "models" / f"ggml-vocab-{name}.gguf.out").is_file()), None)
    if models is None:
        pytest.skip(f"no models/ggml-vocab-{name}.gguf above {tools.quantize}")
    tok = tokenizer_from_gguf(GGUFFile(models / f"ggml-vocab-{name}.gguf"))
    texts = (models / f"ggml-vocab-{name}.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    ids = (models / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    assert len(texts) > 40
    for text, want in zip(texts, ids, strict=False):
        assert tok.encode(text, add_bos=False) == [int(i) for i in want.split()], repr(text)


def test_a_file_with_half_of_longrope_or_longrope_outside_phi3_is_refused_in_one_line():
    """LongRoPE's two factor sets and its original context come together; a file with one set
    is refused by name, not read as plain RoPE, and so is a llama file with both (llama.cpp's
    llama graph would apply them; our reader takes them for Phi-3 alone)."""
    from model.gguf import GGUFError, GGUFFile
    from model.llama_gguf import config_from_gguf, load_params

    llama = GGUFFile(CONVERTED / "llama.gguf")
    factors = GGUFFile(CONVERTED / "phi3_longrope.gguf").tensors
    for name in ("rope_factors_short.weight", "rope_factors_long.weight"):
        llama.tensors[name] = factors[name]
    with pytest.raises(GGUFError, match="extra tensor 'rope_factors_short.weight' that a llama "
                                        "decoder does not have"):
        load_params(llama, config_from_gguf(llama))

    g = GGUFFile(CONVERTED / "phi3_longrope.gguf")
    assert config_from_gguf(g).rope_original_max_len == 24
    del g.tensors["rope_factors_short.weight"]
    with pytest.raises(GGUFError, match="LongRoPE needs rope_factors_short.weight and "
                                        "rope_factors_long.weight and "
                                        "phi3.rope.scaling.original_context_length"):
        config_from_gguf(g)
