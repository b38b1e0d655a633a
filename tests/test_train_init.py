"""`train --init REF` from a Hugging Face folder of a non-Llama family (the tiny gemma3_text
fixture transformers made): its architecture and tokenizer recorded by the run, its weights
placed into zero3 shards; `--model RUN` (and `--step`) reads the run back as scoring its
weights directly does; bad REFs and steps are refused in one line before JAX."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments.pretrained import registered
from experiments.training.config import FINETUNE, PRETRAINED_INITS, load_config
from experiments.training.init_config import pretrained_base
from model.hf_decoder import config_from_hf, load_hf, read_config
from model.hf_tokenizer import HFTokenizer
from tests.helpers import cli, launch_in_one_process

# One worker trains the module's run once (under --dist=loadgroup), not each worker.
pytestmark = pytest.mark.xdist_group("train_init_run")

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "gemma3_text"
TEXTS = ["def main():\n    return 0", "The os module provides"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two zero3 steps on 4 devices from the fixture's weights (float32, a short context)."""
    from experiments.training.trainer import train_and_evaluate

    base = pretrained_base(str(FIXTURE), None)
    cfg = dataclasses.replace(base, model=dataclasses.replace(
        base.model, max_len=32, param_dtype="float32", compute_dtype="float32", remat="none"),
        train=dataclasses.replace(base.train, steps=2, batch_size=4, warmup_steps=1, lr=1e-3,
                                  eval_every=2, eval_batches=1, ckpt_every=2, devices=4))
    workdir = tmp_path_factory.mktemp("init_hf") / "run"
    summary = train_and_evaluate(cfg, workdir, progress=False)
    return cfg, workdir, summary


def test_the_module_keeps_to_one_worker(request):
    """Its tests share one worker, so the run above trains once: under --dist=loadgroup xdist
    tags each node id with its group, which a pytest that keeps node ids elsewhere defeats
    (pyproject.toml pins pytest below that)."""
    if not hasattr(request.config, "workerinput"):
        pytest.skip("not run under pytest-xdist")
    assert request.node.nodeid.endswith("@train_init_run"), request.node.nodeid


def test_the_run_records_the_models_architecture_and_tokenizer(run):
    cfg, workdir, summary = run
    written = load_config(workdir)
    own = config_from_hf(read_config(FIXTURE))
    assert written.preset == FINETUNE and written.train.strategy == "zero3"
    assert written.model == dataclasses.replace(own, max_len=32, param_dtype="float32",
                                                compute_dtype="float32", remat="none")
    assert written.train.init == str(FIXTURE.resolve()) and written.train.init in PRETRAINED_INITS
    assert summary["tokens"] == str(FIXTURE.resolve())  # token ids of the folder's tokenizer
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_score_on_the_run_equals_scoring_its_weights_directly(run):
    from experiments.pretrained import scoring
    from experiments.pretrained.loading import Pretrained, abstract_graphdef
    from experiments.training.restore import restore_params

    cfg, workdir, _ = run
    proc = cli("score", "--model", str(workdir), "--step", "2", "--json",
               *[a for t in TEXTS for a in ("--text", t)], timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])["results"]

    restored = restore_params(workdir, step=2, devices=1, strategy="dp")
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), jax.device_get(restored.params))
    _, pretrained = load_hf(FIXTURE)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params,
                                         pretrained))
    assert max(moved) > 0  # the steps changed the weights
    direct = Pretrained("direct", restored.cfg.model, abstract_graphdef(restored.cfg.model),
                        params, HFTokenizer(FIXTURE))
    want = scoring.score_texts(direct, TEXTS)
    for w, g, text in zip(want, got, TEXTS, strict=True):
        assert g["tokens"] == w["tokens"] == HFTokenizer(FIXTURE).encode(text)
        assert g["next_token"] == w["next_token"]
        assert abs(g["mean_nll"] - w["mean_nll"]) <= 1e-5


def test_bad_init_and_step_are_one_line_before_jax(run, tmp_path):
    _, workdir, _ = run
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(FIXTURE, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    damaged = tmp_path / "damaged"
    shutil.copytree(workdir, damaged)
    meta = next(p for p in (damaged / "checkpoints" / "2").rglob("*") if p.is_file())
    meta.write_bytes(meta.read_bytes() + b" ")
    cases = [
        (("experiments.train", ["--workdir", str(tmp_path / "a"), "--init", "llama9"]),
         "init='llama9': not a run folder (no config.json) nor one of smollm2, gemma3-270m, "
         "a .gguf file, a Hugging Face folder"),
        (("experiments.train", ["--workdir", str(tmp_path / "b"), "--init", str(no_tokenizer)]),
         "(a Hugging Face folder without tokenizer.json)"),
        (("experiments.score", ["--model", str(workdir), "--step", "7", "--text", "a"]),
         f"step=7: no such checkpoint (steps in {str(workdir)!r}: 2)"),
        (("experiments.perplexity", ["--model", str(FIXTURE), "--step", "2"]),
         "step=2: only a training run's folder has steps"),
        (("experiments.chat", ["--model", str(damaged), "--step", "2", "--prompt", "a"]),
         "step=2: checkpoint is not intact"),
    ]
    rows = launch_in_one_process([case for case, _ in cases])
    for row, (case, says) in zip(rows, cases, strict=True):
        lines = row["stderr"].strip().splitlines()
        assert row["status"] == 2 and not row["jax_imported"], (case, row)
        assert len(lines) == 1 and says in lines[0], (case, lines)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_stale_built_tokenizer_is_rebuilt(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" * 8)
    built = gguf.with_name(registered.BUILT_TOKENIZER)
    built.write_text("{}")  # built by code that left no key: stale
    assert registered.built_tokenizer(gguf) == built and not built.exists()
    built.write_text("{}")
    registered.seal_built(gguf)  # as the builder does after writing it
    assert registered.built_tokenizer(gguf).exists()
    key = gguf.with_name(registered.BUILT_KEY)
    key.write_text("another builder\n")
    assert not registered.built_tokenizer(gguf).exists() and not key.exists()


class _Codec:
    """A tokenizer stub that spells a text as its code points; `chatml`: ChatML's tokens are in
    its vocabulary."""
    chat_template = None

    def __init__(self, chatml: bool):
        self.tok = self
        self.chatml = chatml

    def token_to_id(self, token: str):
        return 5 if self.chatml else None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_a_base_model_chats_by_plain_continuation():
    from experiments.pretrained.loading import Pretrained, conversation_ids, has_chat_template

    assert has_chat_template(HFTokenizer(FIXTURE))  # its own (ChatML) template
    turn = [{"role": "user", "content": "Once upon"}]
    base = Pretrained("base", None, None, None, _Codec(chatml=False))
    assert not has_chat_template(base.tokenizer)
    assert conversation_ids(base, turn) == base.tokenizer.encode("Once upon")
    assert conversation_ids(base, turn, "Long ago") == base.tokenizer.encode("Long ago\nOnce upon")
    chat = Pretrained("chat", None, None, None, _Codec(chatml=True))
    text = "".join(map(chr, conversation_ids(chat, turn)))
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nOnce upon<|im_end|>\n<|im_start|>assistant\n")
