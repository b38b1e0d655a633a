"""The BOS goes where transformers puts it. transformers 5 adds what tokenizer.json's
post-processor says (Llama 2's, Llama 3's and Gemma's BOS live there) and drops
tokenizer_config.json's add_bos_token, so reading a Hugging Face folder, writing its GGUF and
writing a Hugging Face folder all follow the post-processor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from experiments.pretrained import exporter, loading, scoring
from model.gguf import GGUFFile
from model.gguf_tokenizer import TokenizerExportError, tokenizer_metadata
from model.hf_tokenizer import HFTokenizer
from model.tokenizer import tokenizer_from_gguf
from tests import gguf_files

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def _with_config(src: Path, dst: Path, **conf) -> Path:
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **conf}))
    return dst


def _post_processor(folder: Path, post) -> Path:
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["post_processor"] = post
    path.write_text(json.dumps(tok))
    return folder


def _first(token: str, token_id: int) -> dict:
    """Llama 3's form: byte-level offsets, then the BOS before each text."""
    return {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
         "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": token, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": token, "type_id": 0}},
                  {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": token, "type_id": 1}},
                  {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {token: {"id": token, "ids": [token_id], "tokens": [token]}}}]}


def test_a_folder_reads_with_the_bos_its_post_processor_adds(tmp_path):
    """llama_spm, saved by transformers 5 (no add_bos_token; `<s>` in the post-processor):
    its ids are transformers' and its scores the reference's. Control: without the
    post-processor the same folder encodes without the BOS, and its scores miss."""
    rows = json.loads((FIXTURES / "llama_spm" / "reference.json").read_text())["results"]
    tok = HFTokenizer(FIXTURES / "llama_spm")
    assert tok.bos == [1]
    assert all(tok.encode(r["text"]) == r["transformers_tokens"] for r in rows)
    pre = loading.load(str(FIXTURES / "llama_spm"))
    same = [r for r in rows if r["tokens"] == r["transformers_tokens"]]
    got = scoring.score_ids(pre, [tok.encode(r["text"]) for r in same])
    worst = max(abs(g["mean_nll"] - r["mean_nll"]) for g, r in zip(got, same, strict=True))
    assert len(same) >= 8 and worst < 1e-4

    bare = _post_processor(shutil.copytree(FIXTURES / "llama_spm", tmp_path / "bare"), None)
    assert HFTokenizer(bare).encode(same[0]["text"]) == same[0]["tokens"][1:]
    missed = scoring.score_ids(pre, [HFTokenizer(bare).encode(r["text"]) for r in same])
    assert max(abs(g["mean_nll"] - r["mean_nll"])
               for g, r in zip(missed, same, strict=True)) > 100 * worst


def test_the_post_processor_alone_decides(tmp_path):
    """As in transformers 5, which drops add_bos_token beside a tokenizer.json: false does not
    remove a post-processor's BOS, and true adds none where the post-processor puts none."""
    spm = _with_config(FIXTURES / "llama_spm", tmp_path / "spm", add_bos_token=False)
    assert HFTokenizer(spm).bos == [1]
    qwen = _with_config(FIXTURES / "qwen2", tmp_path / "qwen", add_bos_token=True)
    assert HFTokenizer(qwen).bos == []
    bare = _post_processor(_with_config(FIXTURES / "llama_spm", tmp_path / "bare",
                                        add_bos_token=True), None)
    assert HFTokenizer(bare).bos == []


def test_a_gguf_from_a_folder_adds_the_bos_its_post_processor_adds(tmp_path):
    """A Llama 3 folder whose post-processor puts the BOS first: its GGUF says add_bos_token
    and tokenizes as transformers' default call; without that post-processor it says not;
    a post-processor that puts another token first is refused (a GGUF can add only its BOS)."""
    base = FIXTURES / "llama3"
    bos = HFTokenizer(base).token_id("<|endoftext|>")
    vocab = HFTokenizer(base).vocab_size
    folder = _post_processor(shutil.copytree(base, tmp_path / "first"),
                             _first("<|endoftext|>", bos))
    meta = tokenizer_metadata(folder, vocab)
    assert meta["tokenizer.ggml.add_bos_token"][1] is True
    assert meta["tokenizer.ggml.bos_token_id"][1] == bos
    assert tokenizer_metadata(base, vocab)["tokenizer.ggml.add_bos_token"][1] is False
    other = _post_processor(shutil.copytree(base, tmp_path / "other"), _first("<|im_end|>", 2))
    with pytest.raises(TokenizerExportError, match="starts with \\[2\\] where a GGUF can put "
                                                    "only its BOS"):
        tokenizer_metadata(other, vocab)

    summary = exporter.export(exporter.hf_source(folder, layers=1), "gguf", tmp_path / "out")
    ours = tokenizer_from_gguf(GGUFFile(Path(summary["out"]) / "model.gguf"))
    theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in ("The capital of France is", "def add(a, b): return a + b"):
        assert ours.encode(text) == theirs.encode(text).ids
        assert ours.encode(text)[0] == bos


def test_a_folder_written_from_a_gguf_adds_the_bos_the_gguf_adds(tmp_path):
    """A GGUF that adds its BOS, written as a Hugging Face folder: the folder's tokenizer.json
    (what transformers 5 follows) puts the BOS first too, alone and in a pair, and reads back
    as the GGUF encodes. Control: a GGUF without add_bos_token writes a folder without it."""
    texts = ("the cat", "Hello there")
    for bos in (1, None):
        path = gguf_files.write(tmp_path / f"bos{bos}.gguf", bos=bos)
        out = tmp_path / f"out{bos}"
        exporter.export(exporter.pretrained_source(str(path)), "safetensors", out)
        want = tokenizer_from_gguf(GGUFFile(path))
        theirs = Tokenizer.from_file(str(out / "tokenizer.json"))
        for text in texts:
            assert theirs.encode(text).ids == want.encode(text) == HFTokenizer(out).encode(text)
            assert (want.encode(text)[0] == 1) == (bos == 1)
        pair = theirs.encode(*texts).ids
        assert pair == ([1] if bos else []) + want.encode(texts[0], add_bos=False) + (
            [1] if bos else []) + want.encode(texts[1], add_bos=False)
        assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] == (
            bos is not None)
