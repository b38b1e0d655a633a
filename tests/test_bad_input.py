"""Bad input ends in one line that names the field and what is allowed, exit status 2, and
nothing written.

Train's flags run in-process through the config flags and the `prepare` the launcher uses (tests
do not import launchers); one subprocess per launcher proves that its ConfigError becomes
`<prog>: error: <one line>` and exit status 2 with nothing written.
"""

import argparse
import os
import re
from pathlib import Path

import pytest

from experiments.cli.config import (
    ConfigError,
    check_sampling,
)
from experiments.cli.flags import add_override_flags, config_from_args
from experiments.training.config import PRESETS, dumps
from experiments.training.data import load_corpus
from experiments.training.trainer import prepare
from experiments.zero.evidence import ReleaseSetup, release_report
from parallel.mesh import parse_mesh
from tests.helpers import ROOT, cli, launch_in_one_process

_parser = argparse.ArgumentParser()
_parser.add_argument("--preset", default="tiny")
add_override_flags(_parser)

TEXT = "def f(x):\n    return x + 1\n" * 200


@pytest.fixture
def paths(tmp_path):
    """{name}: format fields for the table's argv."""
    files = {"binary": bytes(range(256)) * 40, "nul": TEXT.encode() + b"\0" + TEXT.encode(),
             "latin1": ("caf\u00e9 " * 2000).encode("latin-1"), "empty": b""}
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    (tmp_path / "folder").mkdir()
    return {name: str(tmp_path / name) for name in [*files, "folder", "missing"]}


# argv (on top of --preset tiny), the field the line starts with, what it says is allowed.
TRAIN = [
    (["--lr", "inf"], "lr", "finite number > 0"),
    (["--lr", "nan"], "lr", "finite number > 0"),
    (["--lr=-inf"], "lr", "finite"),
    (["--weight-decay", "nan"], "weight_decay", ">= 0"),
    (["--weight-decay", "-0.1"], "weight_decay", ">= 0"),
    (["--clip-norm", "0"], "clip_norm", "> 0"),
    (["--clip-norm", "-1"], "clip_norm", "> 0"),
    (["--clip-norm", "inf"], "clip_norm", "finite"),
    (["--b1", "1"], "b1", "[0, 1)"),
    (["--b1", "-0.1"], "b1", "[0, 1)"),
    (["--b2", "nan"], "b2", "[0, 1)"),
    (["--min-lr-ratio", "1.5"], "min_lr_ratio", "[0, 1]"),
    (["--min-lr-ratio", "-0.1"], "min_lr_ratio", "[0, 1]"),
    (["--rope-base", "inf"], "rope_base", "finite"),
    (["--norm-eps", "0"], "norm_eps", "> 0"),
    (["--warmup-steps", "-1"], "warmup_steps", "0..steps"),
    (["--warmup-steps", "21"], "warmup_steps", "0..steps (20)"),
    (["--seed", "-1"], "seed", "0..4294967295"),
    (["--seed", str(2**32)], "seed", "0..4294967295"),
    (["--vocab-size", "100"], "vocab_size", ">= 256"),
    (["--mesh", "fsdp=2,fsdp=4"], "mesh", "at most once"),
    (["--mesh", "data=2,,fsdp=4"], "mesh", "positive integers"),
    (["--mesh", "data=two,fsdp=4"], "mesh", "positive integers"),
    (["--mesh", "data=\u00b2,fsdp=4"], "mesh", "positive integers"),
    (["--mesh", "data=0,fsdp=8"], "mesh", "positive integers"),
    (["--mesh", "data=2,fsdp=2"], "mesh", "device count 8"),
    (["--data", "{binary}"], "data", "UTF-8 text file"),
    (["--data", "{nul}"], "data", "NUL byte at offset"),
    (["--data", "{latin1}"], "data", "not UTF-8"),
    (["--data", "{empty}"], "data", "empty"),
    (["--data", "{folder}"], "data", "holds no text"),
    (["--data", "{missing}"], "data", "no such file"),
    (["--data", ""], "data", "default corpus"),
]


@pytest.mark.parametrize("argv,field,allowed", TRAIN, ids=[" ".join(c[0]) for c in TRAIN])
def test_train_refuses_before_writing(tmp_path, paths, argv, field, allowed):
    workdir = tmp_path / "run"
    args = _parser.parse_args([a.format(**paths) for a in argv])
    with pytest.raises(ConfigError) as err:
        prepare(config_from_args(args), workdir)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{field}="), line
    assert allowed in line, line
    assert not workdir.exists()


def test_the_tiny_preset_and_a_text_file_pass(tmp_path, paths):
    """The table's refusals come from its one bad field: the same run with good values checks."""
    (tmp_path / "good.txt").write_text(TEXT * 10)
    args = _parser.parse_args(["--data", str(tmp_path / "good.txt"), "--warmup-steps", "20",
                               "--seed", str(2**32 - 1), "--mesh", "data=2,fsdp=4",
                               "--min-lr-ratio", "1", "--b1", "0", "--weight-decay", "0"])
    run = prepare(config_from_args(args), tmp_path / "run")
    assert run.mesh.shape == {"data": 2, "fsdp": 4}
    assert not (tmp_path / "run").exists()


def one_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture
def trained_config(tmp_path):
    """A work dir holding only a run's config.json: enough for the checks made before a
    checkpoint is read."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(dumps(PRESETS["tiny"]))
    return workdir


# One subprocess per launcher: module, argv ({workdir}, {out} filled in), field of the line.
LAUNCHERS = [
    ("train", ["--workdir", "{fresh}", "--preset", "tiny", "--seed", "-1"], "seed"),
    ("sample", ["--workdir", "{workdir}", "--top-k", "300"], "top_k"),
    ("evaluate", ["--workdir", "{workdir}", "--eval-batches", "0"], "eval_batches"),
    ("zero_release", ["--depths", "4", "4", "--out", "{out}"], "depths"),
    ("equivalence", ["--strategies", "dp,zero4", "--out", "{out}"], "strategies"),
    ("equivalence", ["--model", "smollm2-truncated", "--precisions", "float32,bfloat16",
                     "--out", "{out}"], "precisions"),
    ("fault_injection", ["--scenarios", "crash_and_resume,crash_and_resume", "--out", "{out}"],
     "scenarios"),
]


@pytest.mark.parametrize("module,argv,field", LAUNCHERS, ids=[c[0] for c in LAUNCHERS])
def test_launcher_prints_one_line_exits_2_writes_nothing(tmp_path, trained_config, module, argv,
                                                         field):
    fresh, out = tmp_path / "fresh", tmp_path / "out.json"
    proc = cli(module, *[a.format(workdir=trained_config, fresh=fresh, out=out) for a in argv])
    line = one_line(proc)
    assert line.startswith(f"experiments.{module}: error: {field}="), line
    assert not fresh.exists() and not out.exists()
    assert os.listdir(trained_config) == ["config.json"]


SAMPLING = [  # check_sampling keywords on the tiny model (vocab 256, context 32)
    (dict(top_k=257), "top_k=257: must be in 0..256"),
    (dict(top_k=-1), "top_k=-1: must be in 0..256"),
    (dict(temperature=-0.5), "temperature=-0.5: must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature=float("inf")), "temperature=inf"),
    (dict(max_new_tokens=0), "max_new_tokens=0: must be a positive integer"),
    (dict(seed=-1), "seed=-1"),
    (dict(prompt_len=0), "prompt: must not be empty"),
    (dict(prompt_len=40), "prompt: 40 bytes; must be shorter than the context of 32"),
    (dict(prompt_len=4, max_new_tokens=29), "max_new_tokens=29: prompt (4 bytes)"),
]


@pytest.mark.parametrize("bad,message", SAMPLING, ids=[m.split(":")[0] for _, m in SAMPLING])
def test_sampling_settings_are_checked_against_the_model(bad, message):
    good = dict(prompt_len=4, max_new_tokens=28, temperature=0.8, top_k=256, seed=2**32 - 1)
    check_sampling(PRESETS["tiny"].model, **good)
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check_sampling(PRESETS["tiny"].model, **(good | bad))


def test_mesh_parser():
    assert parse_mesh("data=2, fsdp=4", 8) == {"data": 2, "fsdp": 4}
    assert parse_mesh("fsdp=8", 8) == {"data": 1, "fsdp": 8}
    assert parse_mesh(None, 8) == {"data": 1, "fsdp": 8}
    for spec in ("fsdp=2,fsdp=4", "data=1,data=1,fsdp=8", "data=2,", "fsdp", "fsdp=-8",
                 "fsdp=8.0", "model=8"):
        with pytest.raises(ValueError, match=r"^mesh="):
            parse_mesh(spec, 8)


def test_data_checks_single_files_only(tmp_path):
    """A folder is read as bytes: the default corpus itself holds files in other encodings."""
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_bytes(("caf\u00e9 " * 100).encode("latin-1"))
    train, val = load_corpus(str(tmp_path), val_percent=50)
    assert b"\xe9" in train.tobytes() and len(val) > 0
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_corpus(str(tmp_path / "a.txt"))


@pytest.mark.parametrize("field,value", [("depths", (4, 4)), ("devices", (8, 8)),
                                         ("devices", (0, 8)), ("depths", (0, 4))])
def test_zero_release_needs_two_different_values(field, value):
    setup = ReleaseSetup(d_model=64, n_heads=2, d_ff=128, seq_len=8, **{field: value})
    with pytest.raises(ConfigError, match=f"^{field}=.*two different positive integers"):
        setup.validate()
    peaks = {(depth, n): 1000 for depth in setup.depths for n in setup.devices}
    with pytest.raises(ConfigError, match=f"^{field}="):  # not a ZeroDivisionError
        release_report(setup, "zero3", peaks)


# A flag that can be judged on its own is refused before JAX is imported (0.2 s, not 2.5).
EARLY_REFUSALS = [
    ("train", ["--workdir", "{fresh}", "--preset", "tiny", "--steps", "0"]),
    ("train", ["--workdir", "", "--preset", "tiny"]),  # "" would be the current folder
    ("train", ["--workdir", "{fresh}", "--preset", "tiny", "--devices", "1000000000000"]),
    ("bench_decode", ["--out", "/tmp"]),  # a folder
    ("quantize", ["--workdir", "{fresh}", "--mode", "w8a8", "--calib-batches", "1000000000000"]),
    ("quantize", ["--workdir", "{fresh}", "--mode", "w8a8", "--embed-block=-1"]),
    ("evaluate", ["--workdir", "{fresh}", "--eval-batches", "0"]),
    ("evaluate", ["--workdir", "{fresh}"]),  # no config.json there
    ("sample", ["--workdir", "{fresh}", "--quant", "w4"]),
    ("sample", ["--workdir", "{fresh}"]),
    ("score", ["--quant", "w4", "--text", "a"]),
    ("perplexity", ["--tokens", "1"]),
    ("perplexity", ["--window", "64", "--tokens", "63"]),
    ("perplexity", ["--window", "1"]),
    ("chat", ["--prompt", " "]),
    ("chat_replies", ["--modes", "w4", "--out", "{out}"]),
    ("llm_quant_table", ["--layers", "0", "--out", "{out}"]),
    ("bench_decode", ["--repeats", "0", "--out", "{out}"]),
    ("bench_decode", ["--long-prompt-tokens", "-1", "--out", "{out}"]),
    ("bench_decode", ["--pairs", "0", "--out", "{out}"]),
    ("quantize", ["--workdir", "{fresh}", "--mode", "w4"]),
    ("quantize", ["--workdir", "{fresh}", "--mode", "w8a8"]),  # no config.json there
    ("embed", ["--quant", "w4", "--text", "a"]),
    ("embed", ["--text", " "]),
    ("bench_encoder", ["--rounds", "0", "--out", "{out}"]),
]


def test_flag_refusals_come_before_jax_is_imported(tmp_path):
    cases = [(f"experiments.{m}", [a.format(fresh=tmp_path / "fresh", out=tmp_path / "o.json")
                                   for a in argv]) for m, argv in EARLY_REFUSALS]
    rows = launch_in_one_process(cases, timeout=120)
    for (module, _), row in zip(cases, rows, strict=True):
        assert row["status"] == 2, (module, row)
        assert not row["jax_imported"], module + " imported JAX before refusing"
    assert sum(r["stderr"].count(": error: ") for r in rows) == len(EARLY_REFUSALS), rows
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "o.json").exists()


def test_a_value_that_looks_like_a_flag_is_explained(capsys):
    """argparse takes "-x" after --text for another flag; the one line says how to pass it."""
    from experiments.cli.config import Parser

    p = Parser(prog="experiments.score")
    p.add_argument("--text")
    with pytest.raises(SystemExit) as exit_:
        p.parse_args(["--text", "-x"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert "argument --text: expected one argument; a value that starts with '-' is given as " \
           "--flag=VALUE (see --help)" in err
    assert p.parse_args(["--text=-x"]).text == "-x"


def test_check_text_names_the_bad_byte_or_code_point():
    from experiments.cli.config import check_text

    check_text("t", "caf\u00e9")
    check_text("t", " ", blank_ok=True)
    for text, fragment in (("", "t: empty; give at least one non-blank character"),
                           (" \n", "t: empty"), ("ab\udcc3", "byte 0xc3 at character 2"),
                           ("a\ud800", "lone surrogate U+D800 at character 1")):
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            check_text("t", text)


def test_output_paths_are_checked_before_any_work(tmp_path):
    """Where a command will write is checked up front: an empty path, a folder where a file
    goes (and the reverse), a path under a file or where nothing can be written are one line,
    and a good path passes without anything being made."""
    from experiments.cli.config import check_output_file, check_output_folder

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for check, path, fragment in (
            (check_output_file, "", "out: empty; give a file path"),
            (check_output_file, tmp_path, "is a folder; give a file path"),
            (check_output_file, a_file / "r.json", "is a file; give a path"),
            (check_output_file, "/proc/shardq-test/r.json", "cannot write in '/proc'"),
            (check_output_folder, "", "out: empty; give a folder path"),
            (check_output_folder, a_file, "is a file; give a folder"),
            (check_output_folder, a_file / "run", "is a file; give a path"),
            (check_output_folder, "/proc/shardq-test", "cannot write in '/proc'")):
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            check(*(("out", path, "it") if check is check_output_folder else ("out", path)))
    before = sorted(os.listdir(tmp_path))
    check_output_file("out", tmp_path / "new" / "deeper" / "r.json")
    check_output_file("out", a_file)  # an existing file is replaced
    check_output_folder("out", tmp_path / "new" / "run", "a run")
    assert sorted(os.listdir(tmp_path)) == before  # nothing made, no probe left behind


def test_a_failed_results_write_leaves_no_stray_file(tmp_path):
    from experiments.reporting.results_io import write_result

    (tmp_path / "r.json").mkdir()
    with pytest.raises(IsADirectoryError):
        write_result(tmp_path / "r.json", {"a": 1})
    assert os.listdir(tmp_path) == ["r.json"] and not os.listdir(tmp_path / "r.json")


@pytest.mark.parametrize("content,fragment", [
    (b"\xff\xfe", "codec can't decode"),
    (b"[1]", "list indices"),
    (dumps(PRESETS["tiny"]).replace('"d_model": 32', '"d_model": "big"').encode(),
     "d_model='big' is not an int"),
    (dumps(PRESETS["tiny"]).replace('"steps": 20', '"steps": true').encode(),
     "steps=True is not an int"),
])
def test_a_run_config_that_is_not_one_is_refused(tmp_path, content, fragment):
    from experiments.training.config import load_config

    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(tmp_path)


# Launchers run with the reference interpreter (torch, transformers), not the project's.
REFERENCE_SIDE = {"check_export_reference", "make_minilm_reference", "make_smollm2_reference",
                  "torch_encoder_reference", "torch_train_reference", "torch_w8a8_reference"}


def test_every_launcher_refuses_an_unknown_flag_in_one_line():
    launchers = sorted(p.stem for p in (Path(ROOT) / "experiments").glob("*.py")
                       if 'if __name__ == "__main__"' in p.read_text()
                       and p.stem not in REFERENCE_SIDE)
    assert len(launchers) > 30
    rows = launch_in_one_process([(f"experiments.{name}", ["--no-such-flag"])
                                  for name in launchers], timeout=180)
    for name, row in zip(launchers, rows, strict=True):
        lines = row["stderr"].splitlines()
        assert row["status"] == 2 and len(lines) == 1, (name, row)
        assert "--no-such-flag" in lines[0] or "are required" in lines[0], (name, lines)
        assert lines[0].startswith(f"experiments.{name}: error: "), (name, lines)


# The compile-only ZeRO launchers: each refusal names its field, before JAX is imported.
ZERO_REFUSALS = [
    ("zero_memory", ["--devices", "0"], "devices"),
    ("zero_memory", ["--devices", "4", "-2"], "devices"),
    ("zero_memory", ["--seq-len", "0"], "seq_len"),
    ("zero_memory", ["--out", "{folder}"], "out"),
    ("zero_release", ["--devices", "3", "8"], "devices"),
    ("zero_release", ["--out", "{folder}"], "out"),
]


def test_zero_launchers_refuse_in_one_line_before_compiling(tmp_path):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    out = tmp_path / "o.json"
    cases = [(f"experiments.{m}", [a.format(folder=folder) for a in argv] + (
        [] if "--out" in argv else ["--out", str(out)])) for m, argv, _ in ZERO_REFUSALS]
    rows = launch_in_one_process(cases, timeout=120)
    for (module, argv, field), row in zip(ZERO_REFUSALS, rows, strict=True):
        assert row["status"] == 2, (module, argv, row)
        assert not row["jax_imported"], (module, argv)
        lines = row["stderr"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"experiments.{module}: error: {field}="), (module, argv, lines)
    assert not out.exists() and os.listdir(folder) == []
