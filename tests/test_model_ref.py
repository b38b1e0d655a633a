"""`--model REF`: what experiments/pretrained/model_ref.py makes of a REF (JAX-free), and how the
launchers refuse a bad one: one line naming `model`, exit 2, before JAX starts."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from experiments.cli.config import ConfigError
from experiments.pretrained.model_ref import resolve
from tests.helpers import launch_in_one_process

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def test_each_kind_is_recognised(tmp_path):
    assert resolve("smollm2").kind == "name" and resolve("gemma3-270m").kind == "name"
    assert resolve(str(FIXTURES / "qwen2")).kind == "hf"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # contents are the loader's business
    assert resolve(str(gguf)).kind == "gguf"
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    assert resolve(str(run)).kind == "run"


@pytest.mark.parametrize("make, says", [
    (lambda p: "llama3", "not a registered name and no such file or folder"),
    (lambda p: str(p), "a folder without config.json"),
    (lambda p: str(FIXTURES / "qwen2" / "config.json"), "a file that is not a .gguf"),
])
def test_bad_refs_are_one_line_naming_model(tmp_path, make, says):
    ref = make(tmp_path)
    with pytest.raises(ConfigError) as e:
        resolve(ref)
    msg = str(e.value)
    assert msg.startswith(f"model={ref!r}: allowed smollm2, gemma3-270m, a .gguf file")
    assert "\n" not in msg
    assert msg.endswith(f"({says})")
    assert "Hugging Face folder" in msg and "training run" in msg


def test_a_folder_without_its_tokenizer_is_refused(tmp_path):
    folder = tmp_path / "qwen2"
    shutil.copytree(FIXTURES / "qwen2", folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"\(a Hugging Face folder without tokenizer.json\)$"):
        resolve(str(folder))


def test_unsupported_architecture_is_refused_by_model_type(tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(FIXTURES / "llama", folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"model_type='gpt2' is not supported \(allowed: "
                                          r"llama, mistral, qwen2, qwen3, gemma3_text, phi3\)"):
        resolve(str(folder))


def test_resolving_imports_no_jax():
    import subprocess
    code = ("import sys; from experiments.pretrained.model_ref import resolve; "
            f"resolve({str(FIXTURES / 'qwen3')!r}); print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_launchers_refuse_a_bad_ref_before_jax(tmp_path):
    rows = launch_in_one_process([
        ("experiments.score", ["--model", "nope", "--text", "a"]),
        ("experiments.perplexity", ["--model", str(tmp_path)]),
    ])
    for row in rows:
        assert row["status"] == 2 and not row["jax_imported"], row
        lines = row["stderr"].strip().splitlines()
        assert len(lines) == 1 and "model=" in lines[0], row


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """A 2-step tiny run on bytes (from random weights)."""
    import dataclasses

    from experiments.training.trainer import train_and_evaluate
    from tests.helpers import TINY

    tmp = tmp_path_factory.mktemp("byte_run")
    corpus = tmp / "corpus.txt"
    corpus.write_text(open(json.__file__).read() * 4)
    cfg = dataclasses.replace(TINY, train=dataclasses.replace(
        TINY.train, steps=2, ckpt_every=2, eval_every=2, log_every=1, data=str(corpus),
        devices=1))
    train_and_evaluate(cfg, tmp / "run", progress=False)
    return cfg, tmp / "run"


def test_a_run_folder_loads_its_newest_checkpoint_with_its_tokenizer(byte_run, monkeypatch):
    import numpy as np

    from experiments.pretrained import ref_loading
    from experiments.training.restore import restore_params
    from model.hf_tokenizer import HFTokenizer

    cfg, run = byte_run
    ref = resolve(str(run))
    assert ref.kind == "run"
    with pytest.raises(ConfigError, match=r"^model='.*': a run trained on bytes"):
        ref_loading.load_ref(ref)
    # A run with a token vocabulary: the tokenizer is whatever its chain says (stubbed here).
    tok = HFTokenizer(FIXTURES / "qwen2")
    monkeypatch.setattr(ref_loading.run_tokenizer, "tokenizer_for", lambda init: tok)
    loaded = ref_loading.load_ref(ref)
    assert loaded.tokenizer is tok and loaded.step == 2 and loaded.cfg == cfg.model
    want = restore_params(run, cfg).params
    got_leaves, want_leaves = (sorted(_leaves(t)) for t in (loaded.params, want))
    assert [k for k, _ in got_leaves] == [k for k, _ in want_leaves]
    for (_, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    short = ref_loading.load_ref(ref, n_layers=1)
    assert short.cfg.n_layers == 1 and short.params["blocks"]["attn"]["q"]["kernel"].shape[0] == 1


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}/{k}")
    else:
        yield prefix, tree


def test_score_reads_a_hugging_face_folder_as_transformers_does():
    """qwen2 at its own context; phi3_longrope's texts longer than its pretraining context (its
    default one) at `--context 256`, where it takes the long factors as transformers does for
    them."""
    from tests.helpers import launch_in_one_process

    runs = {"qwen2": ([], _reference("qwen2")[:3]),
            "phi3_longrope": (["--context", "256"],
                              [r for r in _reference("phi3_longrope") if len(r["tokens"]) > 24])}
    got = launch_in_one_process(
        [("experiments.score", ["--model", str(FIXTURES / arch), "--json", *flags,
                                *[a for r in rows for a in ("--text", r["text"])]])
         for arch, (flags, rows) in runs.items()], timeout=600)
    for (_, rows), run in zip(runs.values(), got, strict=True):
        assert run["status"] == 0, run["stderr"]
        results = json.loads(run["stdout"].strip().splitlines()[-1])["results"]
        assert len(rows) == len(results) >= 3
        for want, row in zip(rows, results, strict=True):
            assert row["tokens"] == want["tokens"] and row["next_token"] == want["next_token"]
            assert abs(row["mean_nll"] - want["mean_nll"]) <= 1e-4


def _reference(arch: str) -> list[dict]:
    return json.loads((FIXTURES / arch / "reference.json").read_text())["results"]


def test_perplexity_labels_a_gguf_file_and_a_folder_with_their_paths(tmp_path):
    from tests import gguf_files
    from tests.helpers import launch_in_one_process

    gguf = gguf_files.write(tmp_path / "tiny.gguf")
    cases = ((["--gguf", str(gguf)], str(gguf)), (["--model", str(gguf)], str(gguf)),
             (["--model", str(FIXTURES / "qwen3")], str(FIXTURES / "qwen3")))
    # the three runs in one process: the packages load once
    runs = launch_in_one_process(
        [("experiments.perplexity", [*args, "--json", "--tokens", "64", "--window", "32"])
         for args, _ in cases], timeout=600)
    for run, (_, label) in zip(runs, cases, strict=True):
        assert run["status"] == 0, run["stderr"]
        row = json.loads(run["stdout"].strip().splitlines()[-1])
        assert row["model"] == label and row["perplexity"] > 1, row


def test_hugging_face_export_reads_back_bit_identical(tmp_path):
    """Our safetensors export of a GGUF, read by the Hugging Face reader: the same config and
    the same parameters, bit for bit (and so the same scores)."""
    import jax
    import numpy as np

    from experiments.pretrained import exporter
    from model.hf_decoder import load_hf
    from model.hf_tokenizer import HFTokenizer
    from model.llama_gguf import load_gguf
    from model.tokenizer import tokenizer_from_gguf
    from tests import gguf_files

    gguf = gguf_files.write(tmp_path / "tiny.gguf")
    exporter.export(exporter.pretrained_source(str(gguf)), "safetensors", tmp_path / "hf")
    cfg, want, g = load_gguf(gguf)
    got_cfg, got = load_hf(tmp_path / "hf")
    assert got_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, got, want)
    text = "the theme of the thesis"
    assert HFTokenizer(tmp_path / "hf").encode(text) == tokenizer_from_gguf(g).encode(text)
