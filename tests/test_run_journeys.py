"""A new user's journeys through train, evaluate and sample (issue 39): a run records what it
trained on and writes its summary and loss plot; a finished run is extended by a new run from its
weights (--init RUN); metrics are named for what the tokens are; a run on a pretrained model's
tokens is sampled with that tokenizer; a split too small for a batch says what would fit."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from experiments.training import lineage
from experiments.training.config import PRESETS, dumps
from tests.helpers import cli, one_line_error


def _last_json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rows(workdir: Path) -> list[dict]:
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


# One worker runs this module and test_quant_cli.py: they read the same finished run, trained
# once per session.
pytestmark = pytest.mark.xdist_group("tiny_byte_run")


@pytest.fixture(scope="module")
def byte_run(tiny_byte_run):
    """A finished tiny byte-level run on a text file: (workdir, its summary)
    (conftest.tiny_byte_run)."""
    return tiny_byte_run


def test_train_writes_its_summary_and_records_its_data(byte_run):
    workdir, summary = byte_run
    assert {"summary.json", "summary.png"} <= set(os.listdir(workdir))
    assert json.loads((workdir / "summary.json").read_text()) == summary
    assert summary["tokens"] == "bytes" and "bits_per_byte" in summary
    train = json.loads((workdir / "config.json").read_text())["train"]
    assert train["corpus"] == "data" and train["data"].endswith("corpus.txt")
    val = [r for r in _rows(workdir) if "val_loss" in r]
    assert val and all(set(r) == {"step", "val_loss", "val_bits_per_byte"} for r in val)


def test_init_from_a_finished_run_starts_a_new_schedule(byte_run, tmp_path):
    source, summary = byte_run
    workdir = tmp_path / "more"
    proc = cli("train", "--workdir", str(workdir), "--init", str(source), "--steps", "2",
               "--lr", "1e-3", "--eval-every", "2", "--no-progress")
    more = _last_json(proc)
    # The source's weights, evaluated on the same validation batches, are step 0 here.
    assert more["val_loss_before"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert "step 0 (the initial weights): val loss" in proc.stdout
    assert more["load"]["init_step"] == 2 and more["tokens"] == "bytes"
    rows = [r for r in _rows(workdir) if "val_loss" in r]
    assert rows[0]["step"] == 0 and all("val_bits_per_byte" in r for r in rows)
    cfg = json.loads((workdir / "config.json").read_text())
    assert cfg["train"]["init"] == str(source.resolve()) and cfg["train"]["steps"] == 2
    assert cfg["model"] == json.loads((source / "config.json").read_text())["model"]


def test_a_bad_init_is_one_line_before_anything_is_written(byte_run, tmp_path):
    source, _ = byte_run
    workdir = tmp_path / "new"
    one_line_error(cli("train", "--workdir", str(workdir), "--init", str(tmp_path / "nope")),
                   f"init={str(tmp_path / 'nope')!r}", "not a run folder", "smollm2")
    one_line_error(cli("train", "--workdir", str(workdir), "--init", str(source), "--d-model",
                       "64"), f"init={str(source)!r}", "d_model=64 differs from the run's 32")
    assert not workdir.exists()


def test_token_runs_follow_their_chain_to_the_pretrained_tokenizer(tmp_path):
    """A run started from a run that started from SmolLM2 has SmolLM2's tokens; a loop of runs
    naming each other is refused."""
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, init in ((first, "smollm2"), (second, str(first))):
        folder.mkdir()
        cfg = PRESETS["smollm2"]
        cfg = type(cfg)(cfg.preset, cfg.model, type(cfg.train)(**{**cfg.train.__dict__,
                                                                   "init": init}))
        (folder / "config.json").write_text(dumps(cfg))
    origin = lineage.origin(str(second))
    assert origin.pretrained == "smollm2" and not origin.byte_tokens
    assert origin.runs == (str(second), str(first))
    assert lineage.origin(None).byte_tokens
    text = (first / "config.json").read_text().replace('"init": "smollm2"',
                                                       f'"init": "{second}"')
    (first / "config.json").write_text(text)
    with pytest.raises(ValueError, match="in a loop"):
        lineage.origin(str(second))


def test_a_validation_split_smaller_than_a_batch_says_what_fits(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text(open(json.__file__).read()[:8000])
    proc = cli("train", "--workdir", str(tmp_path / "run"), "--preset", "tiny", "--data",
               str(small))
    one_line_error(proc, "batch_size=16: larger than the validation split (12 sequences)",
                   "--batch-size 8 ", "--val-percent ")
    assert not (tmp_path / "run").exists()
    vp = re.search(r"--val-percent (\d+)", proc.stderr).group(1)
    assert 5 < int(vp) < 20


def test_help_describes_every_config_flag_with_its_default():
    out = re.sub(r"\s+", " ", cli("train", "--help").stdout)
    assert "--lr LR peak learning rate (default tiny 0.003, small 0.006," in out, out
    assert "--d-model D_MODEL" in out and "width of the residual stream" in out
    assert "--init INIT" in out and "a finished run's folder" in out
