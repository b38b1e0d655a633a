"""`export --model HF_FOLDER`: a Hugging Face folder (tests/fixtures/hf/, made by transformers)
exported to GGUF reads back through our GGUF reader to the folder's parameters, tokenizes as
the folder's tokenizer.json does (the `tokenizers` library) and scores as the folder does; a
re-export to safetensors keeps the first N blocks; what a GGUF cannot hold is refused before
JAX starts, nothing written."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from tokenizers import Tokenizer

from experiments.cli.config import ConfigError
from experiments.pretrained import export_q8, exporter, loading, scoring
from experiments.pretrained.export_checks import check_source
from model.gguf import GGUFFile
from model.hf_decoder import load_hf
from model.llama_export import GGUF_FILE
from model.llama_gguf import load_gguf
from model.tokenizer import PRE_TOKENIZER_REGEXES, SentencePieceTokenizer, tokenizer_from_gguf
from tests.helpers import launch_in_one_process, llama_cpp_tools, nll_as_llama_cpp

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TEXTS = ["The capital of France is", "def add(a, b):\n    return a + b",
         "In 1999, 12345 people paid $3.50 each!", "  two  spaces\tand a tab\n\nnew lines",
         "naïve café — 東京 😀 ok?", "WE'LL SEE: 2024-12-07\r\n\r\n   Done.",
         "it's we'll they're <|im_end|> done"]


def _flat(tree) -> dict:
    return {k: np.asarray(v) for k, v in flatten_dict(tree, sep="/").items()}


def _edited(src: Path, dst: Path, config=None, tokenizer=None) -> Path:
    """A copy of a fixture folder with config.json / tokenizer.json edited in place."""
    shutil.copytree(src, dst)
    for name, edit in (("config.json", config), ("tokenizer.json", tokenizer)):
        if edit is not None:
            data = json.loads((dst / name).read_text())
            edit(data)
            (dst / name).write_text(json.dumps(data))
    return dst


def _digits_first(tok: dict) -> None:
    """SmolLM2's pre-tokenizer: every digit on its own, then GPT-2's byte-level regex (a split
    llama.cpp and our reader both name, smollm)."""
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, tok["pre_tokenizer"]]}


def _conventional(hf: dict) -> None:
    """Gemma 3's conventions, which a GGUF cannot state and its readers assume."""
    n = hf["num_hidden_layers"]
    hf["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                         for i in range(n)]
    hf["query_pre_attn_scalar"] = hf["head_dim"]


def _own_regex(regex: str, ignore_merges: bool = False):
    """Llama 3's and Qwen2's form: a split on the model's own regex, then bytes (Llama 3's BPE
    also takes a piece that is a token whole, `ignore_merges`)."""
    def edit(tok: dict) -> None:
        tok["model"]["ignore_merges"] = ignore_merges
        tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]}
    return edit


def _llama_form(tok: dict) -> None:
    """Llama 2's tokenizer.json as published: a U+2581 put before the text, then spaces
    respelled (the fixture, saved by transformers 5, has a Metaspace instead)."""
    tok["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    tok["pre_tokenizer"] = None


# The GGUF pre-tokenizer name each folder's tokenizer is exported as.
PRE = {"llama": "smollm", "llama3": "llama-bpe", "qwen2": "qwen2", "qwen3": "gpt-2",
       "gemma3_text": "smollm"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_src")
    own = {name: _own_regex(PRE_TOKENIZER_REGEXES[name], name == "llama-bpe")
           for name in ("qwen2", "llama-bpe")}
    return {"llama": _edited(FIXTURES / "llama", root / "llama", tokenizer=_digits_first),
            "qwen2": _edited(FIXTURES / "qwen2", root / "qwen2", tokenizer=own["qwen2"]),
            "llama3": _edited(FIXTURES / "llama3", root / "llama3", tokenizer=own["llama-bpe"]),
            "qwen3": _edited(FIXTURES / "qwen3", root / "qwen3"),
            "gemma3_text": _edited(FIXTURES / "gemma3_text", root / "gemma3",
                                   config=_conventional, tokenizer=_digits_first),
            "llama_spm": _edited(FIXTURES / "llama_spm", root / "llama_spm",
                                 tokenizer=_llama_form)}


@pytest.fixture(scope="module")
def exported(folders, tmp_path_factory):
    """Each folder exported to GGUF as the launcher does (its checks first)."""
    out = {}
    for arch, folder in folders.items():
        dst = tmp_path_factory.mktemp("gguf") / arch
        check_source(str(folder), None, fmt="gguf")
        summary = exporter.export(exporter.pretrained_source(str(folder)), "gguf", dst)
        assert summary["source"] == str(folder)
        assert summary["tokenizer"] == ("sentencepiece" if arch == "llama_spm" else "bpe")
        out[arch] = dst / GGUF_FILE
    return out


ALL = ["llama", "llama3", "qwen2", "qwen3", "gemma3_text", "llama_spm"]


@pytest.mark.parametrize("arch", ALL)
def test_gguf_reads_back_to_the_folders_parameters(arch, folders, exported):
    cfg, params = load_hf(folders[arch])
    cfg2, back, g = load_gguf(exported[arch])
    assert g.get_str("general.architecture") == {"gemma3_text": "gemma3", "llama3": "llama",
                                                 "llama_spm": "llama"}.get(arch, arch)
    assert ("rope_freqs.weight" in g.tensors) == (arch == "llama3")
    assert cfg2 == cfg
    a, b = _flat(params), _flat(back)
    assert a.keys() == b.keys()
    for k in a:
        if cfg.norm_plus_one and k.endswith("norm/scale"):  # (1 + w) - 1: within an ulp of 1 + w
            np.testing.assert_allclose(b[k], a[k], rtol=0, atol=np.spacing(np.float32(2.0)))
        else:
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "gemma3_text"])
def test_gguf_tokenizer_gives_the_folders_ids(arch, folders, exported):
    g = GGUFFile(exported[arch])
    ours = tokenizer_from_gguf(g)
    theirs = Tokenizer.from_file(str(folders[arch] / "tokenizer.json"))
    for text in TEXTS:
        want = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == want, text
        assert ours.decode(want) == theirs.decode(want, skip_special_tokens=False)
    assert ours.eos_id == theirs.token_to_id("<|im_end|>") and ours.bos == []
    assert g.get_str("tokenizer.ggml.pre") == PRE[arch]
    assert g.get_int("tokenizer.ggml.bos_token_id") == theirs.token_to_id("<|endoftext|>")
    # the folder's chat template, rendered from the GGUF as transformers rendered it
    for row in json.loads((folders[arch] / "reference.json").read_text())["chat"]:
        if "text" in row:
            assert ours.chat_prompt(row["messages"]) == row["text"]


@pytest.mark.parametrize("arch", ALL)
def test_gguf_scores_as_the_folder(arch, folders, exported):
    want = scoring.score_texts(loading.load(str(folders[arch])), TEXTS)
    got = scoring.score_texts(loading.load(str(exported[arch])), TEXTS)
    for w, r in zip(want, got, strict=True):
        assert r["tokens"] == w["tokens"] and r["next_token"] == w["next_token"]
        assert abs(r["mean_nll"] - w["mean_nll"]) <= 1e-6


def test_a_sentencepiece_folder_writes_a_sentencepiece_vocabulary(exported, tmp_path):
    """Llama 2's form (byte fallback, U+2581 for a space) becomes `tokenizer.ggml.model`
    llama: no merges, scores that rank pieces by id as the folder's merges do, byte, unknown
    and control types, a space before the text. Its ids are SentencePiece's own (the fixture's
    reference, made by the sentencepiece library) on every text but one that names `</s>`,
    which SentencePiece reads as characters. The fixture as transformers 5 saved it (a
    Metaspace, which adds no second U+2581 before a text that starts with a space) writes the
    same vocabulary, and so does the Metaspace transformers 5 saves for Llama (a U+2581 before
    the first stretch of text only)."""
    g = GGUFFile(exported["llama_spm"])
    theirs = Tokenizer.from_file(str(FIXTURES / "llama_spm" / "tokenizer.json"))
    types = g.get_ints("tokenizer.ggml.token_type")
    assert g.get_str("tokenizer.ggml.model") == "llama"
    assert "tokenizer.ggml.merges" not in g.metadata
    assert g.get_bool("tokenizer.ggml.add_space_prefix", default=False)
    assert g.get_bool("tokenizer.ggml.add_bos_token", default=False)
    assert [types[theirs.token_to_id(t)] for t in ("<unk>", "<s>", "<0x41>", "\u2581t")] == [
        2, 3, 6, 1]
    scores = np.asarray(g.metadata["tokenizer.ggml.scores"][1], np.float32)
    made = [theirs.token_to_id(a + b) for a, b in
            json.loads((FIXTURES / "llama_spm" / "tokenizer.json").read_text())["model"]["merges"]]
    assert np.all(np.diff(scores[list(dict.fromkeys(made))]) < 0)  # in the merges' order
    assert np.all(scores[types != 1] == 0)
    ours = tokenizer_from_gguf(g)
    rows = json.loads((FIXTURES / "llama_spm" / "reference.json").read_text())["results"]
    plain = [r for r in rows if "</s>" not in r["text"]]
    assert len(plain) == len(rows) - 1 and any(r["text"].startswith(" ") for r in plain)
    for r in plain:
        assert ours.encode(r["text"]) == r["tokens"], r["text"]
    def first_only(tok: dict) -> None:  # as transformers 5 saves a Llama folder
        tok["pre_tokenizer"]["prepend_scheme"] = "first"
    for name, folder in (("always", FIXTURES / "llama_spm"),
                         ("first", _edited(FIXTURES / "llama_spm", tmp_path / "first_src",
                                           tokenizer=first_only))):
        exporter.export(exporter.pretrained_source(str(folder)), "gguf", tmp_path / name)
        v5 = GGUFFile(tmp_path / name / GGUF_FILE)
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores", "tokenizer.ggml.add_space_prefix"):
            assert np.array_equal(np.asarray(v5.metadata[key][1]),
                                  np.asarray(g.metadata[key][1])), (name, key)


def _spaces_last(tok: dict) -> None:
    """Llama's order: SentencePiece scores its runs of spaces lowest of all, so the folder
    merges `▁ ▁` last although `▁▁` has a low id."""
    merges = tok["model"]["merges"]
    merges.append(merges.pop(0))


def test_merges_out_of_token_order_are_scored_as_the_folder_ranks_them(tmp_path):
    """A folder that joins two spaces last (as Llama 2's and TinyLlama's do): the GGUF's
    scores put that merge last, and our reader, which ranks a Llama file's merges by score,
    tokenizes as the folder, here where two spaces meet a word. A gemma3 file is read by token
    order, which cannot state that order: refused."""
    from model.gguf_tokenizer import TokenizerExportError, tokenizer_metadata

    folder = _edited(FIXTURES / "llama_spm", tmp_path / "src",
                     tokenizer=lambda t: (_llama_form(t), _spaces_last(t)))
    exporter.export(exporter.pretrained_source(str(folder)), "gguf", tmp_path / "g")
    ours = tokenizer_from_gguf(GGUFFile(tmp_path / "g" / GGUF_FILE))
    theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = TEXTS + [" leading space", "a  b   c"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text).ids, text
    g = GGUFFile(tmp_path / "g" / GGUF_FILE)  # control: the same file ranked by token order
    tokens = g.get_strings("tokenizer.ggml.tokens")
    by_order = SentencePieceTokenizer(
        tokens, g.get_ints("tokenizer.ggml.token_type").tolist(), eos_id=2, unk="<unk>",
        add_bos=True, bos_id=1, add_space_prefix=True)
    differ = [t for t in texts if by_order.encode(t) != theirs.encode(t).ids]
    assert "a  b   c" in differ and all("  " in t for t in differ)  # where spaces meet
    with pytest.raises(TokenizerExportError, match="an order the token order cannot state"):
        tokenizer_metadata(folder, load_hf(folder)[0].vocab_size, by_position=True)


@pytest.mark.parametrize("normalizer, pre, prefix", [
    ({"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}, None, True),
    (None, {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
            "split": False}, True),
    ({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}, None, False),
    (None, {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never",
            "split": False}, False),
    (None, {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
            "split": False}, True),
    (None, {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
            "split": True}, None),
    ({"type": "Lowercase"}, None, None),
])
def test_the_space_before_the_text(normalizer, pre, prefix):
    """Llama's forms put a U+2581 before the text (add_space_prefix: llama.cpp puts one after
    every special token too, whichever form the folder has), Gemma's put none; a Metaspace
    that splits the text at spaces, or another normalizer, has no GGUF form."""
    from model import gguf_spm_vocab

    tok = {"normalizer": normalizer, "pre_tokenizer": pre}
    if prefix is None:
        with pytest.raises(gguf_spm_vocab.VocabError, match="a GGUF SentencePiece vocabulary"):
            gguf_spm_vocab.space_prefix(tok)
    else:
        assert gguf_spm_vocab.space_prefix(tok) is prefix


def test_a_non_special_added_token_exports_as_user_defined(tmp_path):
    """An added token that is not special (Qwen2.5's <tool_call>, say) is a user-defined token
    in the GGUF, which our reader, like llama.cpp and the folder's tokenizer, matches whole."""
    def plain_im_start(tok: dict) -> None:
        for added in tok["added_tokens"]:
            if added["content"] == "<|im_start|>":
                added["special"] = False
    folder = _edited(FIXTURES / "llama", tmp_path / "src", tokenizer=plain_im_start)
    exporter.export(exporter.pretrained_source(str(folder)), "gguf", tmp_path / "g")
    g = GGUFFile(tmp_path / "g" / GGUF_FILE)
    theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
    types = g.get_ints("tokenizer.ggml.token_type")
    assert types[theirs.token_to_id("<|im_start|>")] == 4
    assert types[theirs.token_to_id("<|im_end|>")] == 3
    ours = tokenizer_from_gguf(g)
    text = "a<|im_start|>user\nhi<|im_end|> b"
    want = theirs.encode(text, add_special_tokens=False).ids
    assert ours.encode(text) == want and theirs.token_to_id("<|im_start|>") in want
    assert ours.decode(want) == theirs.decode(want, skip_special_tokens=False)


def test_a_template_in_its_own_file_goes_into_the_gguf(tmp_path):
    """transformers 5 saves the chat template as chat_template.jinja, not in
    tokenizer_config.json: the GGUF's tokenizer.chat_template is that file's; a folder with
    neither writes none."""
    from model.gguf_tokenizer import tokenizer_metadata

    folder = shutil.copytree(FIXTURES / "llama", tmp_path / "jinja")
    conf = json.loads((folder / "tokenizer_config.json").read_text())
    template = conf.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(conf))
    vocab = load_hf(folder)[0].vocab_size
    assert "tokenizer.chat_template" not in tokenizer_metadata(folder, vocab)
    (folder / "chat_template.jinja").write_text(template)
    assert tokenizer_metadata(folder, vocab)["tokenizer.chat_template"][1] == template


def test_qwens_nfc_is_left_out_as_llama_cpp_leaves_it(tmp_path):
    """Qwen's tokenizer.json normalizes to NFC first; the GGUF, like llama.cpp's own Qwen
    files, has no place for that: its ids are the folder's on text in NFC, and a text that is
    not (an accent as a separate combining mark) tokenizes as written."""
    def nfc(tok: dict) -> None:
        _own_regex(PRE_TOKENIZER_REGEXES["qwen2"])(tok)
        tok["normalizer"] = {"type": "NFC"}
    folder = _edited(FIXTURES / "qwen2", tmp_path / "src", tokenizer=nfc)
    exporter.export(exporter.pretrained_source(str(folder)), "gguf", tmp_path / "g")
    ours = tokenizer_from_gguf(GGUFFile(tmp_path / "g" / GGUF_FILE))
    theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text
    decomposed = "cafe\u0301"
    assert theirs.encode(decomposed).ids == theirs.encode("caf\u00e9").ids
    assert ours.encode(decomposed) != ours.encode("caf\u00e9")


def test_plain_gpt2_split_exports_as_gpt_2(tmp_path):
    """The fixture as transformers wrote it (GPT-2's byte-level regex alone) is written as
    llama.cpp's gpt-2 pre-tokenizer, which our reader splits the same way."""
    check_source(str(FIXTURES / "llama"), None, fmt="gguf")
    exporter.export(exporter.pretrained_source(str(FIXTURES / "llama")), "gguf", tmp_path / "g")
    g = GGUFFile(tmp_path / "g" / GGUF_FILE)
    assert g.get_str("tokenizer.ggml.pre") == "gpt-2"
    ours = tokenizer_from_gguf(g)
    theirs = Tokenizer.from_file(str(FIXTURES / "llama" / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text


def test_w8_gguf_from_a_folder(folders, tmp_path):
    """--quant w8: the folder's int8 model as Q8_0, with the folder's tokenizer keys."""
    source = export_q8.quantized_source(exporter.pretrained_source(str(folders["llama"])), "w8")
    summary = exporter.export(source, "gguf", tmp_path / "q")
    assert summary["quant"] == "w8" and summary["q8_0_tensors"] > 0
    g = GGUFFile(tmp_path / "q" / GGUF_FILE)
    assert g.get_str("tokenizer.ggml.model") == "gpt2"
    cfg, _, _ = load_gguf(tmp_path / "q" / GGUF_FILE)
    assert cfg == load_hf(folders["llama"])[0]


def test_safetensors_re_export_keeps_the_first_blocks(tmp_path):
    summary = exporter.export(exporter.pretrained_source(str(FIXTURES / "qwen2"), layers=1),
                              "safetensors", tmp_path / "out")
    assert summary["model_type"] == "qwen2" and summary["layers"] == 1
    cfg, params = load_hf(FIXTURES / "qwen2", n_layers=1)
    cfg2, back = load_hf(tmp_path / "out")
    assert cfg2 == cfg
    b = _flat(back)
    for k, v in _flat(params).items():
        np.testing.assert_array_equal(b[k], v, err_msg=k)
    assert ((tmp_path / "out" / "tokenizer.json").read_bytes()
            == (FIXTURES / "qwen2" / "tokenizer.json").read_bytes())


def _metaspace(tok: dict) -> None:
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                            "prepend_scheme": "always", "split": True}


def _digit_runs(tok: dict) -> None:
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": False}, tok["pre_tokenizer"]]}


def _unigram(tok: dict) -> None:
    tok["model"] = {"type": "Unigram", "unk_id": 0, "vocab": [["a", -1.0]]}


def _lowercase(tok: dict) -> None:
    tok["normalizer"] = {"type": "Lowercase"}


def _merges_interleaved(tok: dict) -> None:
    """`e r` between the two merges that make `▁in`: no score per token ranks them so."""
    merges = tok["model"]["merges"]
    at = merges.index(["e", "r"])
    merges.insert(merges.index(["\u2581i", "n"]) - 1, merges.pop(at))


def _split_missing(tok: dict) -> None:
    tok["model"]["merges"].remove(["\u2581", "in"])


def _normalized_added(tok: dict) -> None:
    tok["added_tokens"][1]["normalized"] = True


def _metaspace_split(tok: dict) -> None:
    tok["pre_tokenizer"] = {**tok["pre_tokenizer"], "split": True}


def _ignore_merges(tok: dict) -> None:
    tok["model"]["ignore_merges"] = True  # with GPT-2's split: llama.cpp would not ignore them


REFUSALS = [
    (_ignore_merges, "llama", "BPE ignore_merges=True with pre-tokenizer gpt-2"),
    (None, "mistral", "sliding_window=16: format='gguf' has no window for the llama layout"),
    (_metaspace, "llama", "pre_tokenizer Metaspace: no GGUF pre-tokenizer name"),
    (_digit_runs, "llama", "pre_tokenizer Sequence[Digits, ByteLevel]: no GGUF pre-tokenizer"),
    (_unigram, "llama", "model 'Unigram' is not a byte-level BPE"),
    (_lowercase, "llama", "normalizer Lowercase has no GGUF form"),
    (_merges_interleaved, "llama_spm", "an order a score per token cannot state"),
    (_split_missing, "llama_spm", "not every split of a token into two tokens (e.g. '\u2581'"),
    (_normalized_added, "llama_spm", "added token '<s>' is matched after normalizing"),
    (_metaspace_split, "llama_spm", "pre_tokenizer Metaspace(split): a GGUF SentencePiece"),
    (None, "gemma3_text", "layer_pattern='sgsg': a gemma3 GGUF has no place for it"),
]


def test_refused_before_jax_nothing_written(tmp_path):
    """Each in one line, exit 2, before JAX is imported, no --out written."""
    cases = []
    for i, (edit, arch, _) in enumerate(REFUSALS):
        folder = (FIXTURES / arch if edit is None else
                  _edited(FIXTURES / arch, tmp_path / f"src{i}", tokenizer=edit))
        cases.append(("experiments.export", ["--model", str(folder), "--format", "gguf",
                                             "--out", str(tmp_path / f"out{i}")]))
    cases.append(("experiments.export", ["--model", str(FIXTURES / "llama"), "--layers", "3",
                                         "--out", str(tmp_path / "out_layers")]))
    rows = launch_in_one_process(cases)
    fragments = [f for _, _, f in REFUSALS] + ["layers=3: must be in 1..2 (the model's layers)"]
    for (_, argv), row, fragment in zip(cases, rows, fragments, strict=True):
        lines = [ln for ln in row["stderr"].splitlines() if ln.strip()]
        assert row["status"] == 2 and len(lines) == 1 and fragment in lines[0], row["stderr"]
        assert not row["jax_imported"]
        assert not Path(argv[-1]).exists()


def test_step_refused_for_a_folder():
    with pytest.raises(ConfigError, match="step=3: only for a training run"):
        exporter.pretrained_source(str(FIXTURES / "llama"), step=3)


def test_llama_cpp_scores_the_folders_gguf_as_we_do(folders, exported, tmp_path):
    """llama.cpp, an independent implementation, runs each exported file on the same text and
    its perplexity is ours on the windows it tokenized (where its tools are named by
    $SHARDQ_LLAMA_CPP; under CI=true their absence is asserted, not skipped). Controls: the
    Qwen2 model without its q/k/v biases, and the Llama 3 one without its RoPE scaling, score
    far from llama.cpp's."""
    from experiments.speed import llama_cpp

    tools = llama_cpp_tools(need=(llama_cpp.PERPLEXITY,))
    if tools is None:
        return
    text = tmp_path / "text.txt"
    # llama-perplexity reads a special token's text as plain characters; our encode as the token
    words = " ".join(t for t in TEXTS if "<|" not in t) * 100
    text.write_bytes(words.encode())  # as it is: a text-mode read would turn \r\n into \n
    for arch, path in exported.items():
        base = tmp_path / f"{arch}.kld"
        got = llama_cpp.perplexity(tools, path, 1, base, text=text, ctx=128, chunks=2)
        windows = llama_cpp.base_tokens(base)
        assert got["chunks"] == len(windows) == 2 and got["ctx"] == len(windows[0]) == 128
        pre = loading.load(str(folders[arch]))
        assert pre.tokenizer.encode(words)[:256] == windows[0] + windows[1], arch
        # Both sum in float32 in their own orders, and these peaky models' NLLs run to tens of
        # nats: within 5e-4 of llama.cpp's, relative; Gemma's queries scaled by 1/sqrt(256)
        # instead of llama.cpp's 1/sqrt(head size) would be off by three times that.
        theirs = np.log(got["perplexity"])
        assert abs(nll_as_llama_cpp(pre, windows) - theirs) < 5e-4 * theirs, arch
        if arch == "qwen2":  # the controls: the reader without the q/k/v biases ...
            blocks = pre.params["blocks"]["attn"]
            for x in "qkv":
                blocks[x]["bias"] = jnp.zeros_like(blocks[x]["bias"])
            assert abs(nll_as_llama_cpp(pre, windows) - theirs) > 1e-2 * theirs
        if arch == "llama3":  # ... or without Llama 3's RoPE scaling
            cfg = dataclasses.replace(pre.cfg, rope_scale_factor=0.0, rope_low_freq_factor=0.0,
                                      rope_high_freq_factor=0.0, rope_original_max_len=0)
            pre = dataclasses.replace(pre, cfg=cfg, graphdef=loading.abstract_graphdef(cfg))
            assert abs(nll_as_llama_cpp(pre, windows) - theirs) > 5e-3 * theirs


def test_llama_cpp_tokenizes_a_gemma_folders_gguf_as_we_do(tmp_path, monkeypatch):
    """Gemma 3's vocabulary of 262,144 pieces, written as a Hugging Face folder from the
    packaged GGUF (one block) and from that folder back to GGUF: llama.cpp tokenizes a text
    (BOS first) as the folder does. Control: the same file with every score 0, where
    llama.cpp joins pairs left to right, tokenizes it otherwise."""
    from experiments.pretrained import export_checks
    from experiments.speed import llama_cpp
    from model import gguf_spm_vocab
    from model.hf_tokenizer import HFTokenizer

    tools = llama_cpp_tools(need=(llama_cpp.PERPLEXITY,))
    if tools is None:
        return
    folder = tmp_path / "hf"
    exporter.export(exporter.pretrained_source("gemma3-270m", 1), "safetensors", folder)
    text = tmp_path / "text.txt"
    words = (json.__doc__ + " ".join(t for t in TEXTS if "<|" not in t)) * 4
    text.write_bytes(words.encode())
    want = HFTokenizer(folder).encode(words)[:512]
    assert want[0] == HFTokenizer(folder).token_id("<bos>")

    def tokens_of(out: Path) -> list[int]:
        exporter.export(exporter.pretrained_source(str(folder)), "gguf", out)
        base = out / "run.kld"
        llama_cpp.perplexity(tools, out / GGUF_FILE, 2, base, text=text, ctx=256, chunks=2)
        windows = llama_cpp.base_tokens(base)
        return windows[0] + windows[1]

    assert tokens_of(tmp_path / "g") == want
    monkeypatch.setattr(gguf_spm_vocab, "_tie_scores",
                        lambda ids, types, merges: np.zeros(len(types), np.float32))
    export_checks._converted.cache_clear()  # the folder's conversion is kept per folder state
    assert tokens_of(tmp_path / "zero") != want
