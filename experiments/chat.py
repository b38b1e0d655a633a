"""Talk to a pretrained chat model: the reply streams token by token from the KV cache.

  python -m experiments.chat --model smollm2 --prompt "What is the capital of France?"
  python -m experiments.chat --model smollm2 --quant w8a8 --kv-int8 --prompt "Name a prime."
  python -m experiments.chat --prompt "Tell a story." --temperature 0.7 --top-k 40 --seed 1
  python -m experiments.chat --model smollm2 --interactive      # a conversation, one line a turn
  python -m experiments.chat --model runs/ft --step 12 --prompt "The os module"  # a run's step

The prompt goes through the model's own chat template (SmolLM2's: a default system message, then
the user turn, then `<|im_start|>assistant\\n`), rendered as transformers renders it; a base model
without a chat template (Gemma 3 270M, a run fine-tuned from it) continues the prompt as plain
text. Decoding stops at the model's end tokens (eos, a GGUF's end-of-turn, a folder's
generation_config eos ids) or after --max-new-tokens. Greedy unless --temperature > 0. With --json
the last line is {"reply", "tokens", "new_tokens", "seconds", "tokens_per_s"} (decode speed after
the prompt's prefill). --step N with --model RUN reads that checkpoint of the run.
--interactive reads one user turn per line from stdin (after --prompt, if given) and keeps the
conversation: each turn is the whole history so far in the template plus the new message. An
empty line, `/exit` or the end of input stops it; a conversation that outgrows the context ends
in one line. Ctrl-C stops a reply (exit 130).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from experiments.cli import model_flags, startup
from experiments.cli.config import ConfigError, Parser, check_text, fail
from experiments.pretrained import model_ref
from model.gguf import GGUFError
from quant.modes import QuantError

PROG = "experiments.chat"
LAYOUTS = ("probe", "rule", "scan", "per-layer")
DEFAULT_NEW_TOKENS = 128


def check(args) -> None:
    model_ref.check_step(args.model, args.step)
    model_flags.check_model_flags(args)
    if args.prompt is None and not args.interactive:
        raise ConfigError("prompt: not given; pass --prompt TEXT (or --interactive)")
    if args.prompt is not None:
        check_text("prompt", args.prompt)
    if args.system is not None:
        check_text("system", args.system)
    if args.interactive and args.json:
        raise ConfigError("json: not with --interactive (one reply per run)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={args.max_new_tokens}: must be a positive integer")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"temperature={args.temperature}: must be finite and >= 0 (0: greedy)")
    if args.top_k < 0:
        raise ConfigError(f"top_k={args.top_k}: must be >= 0 (0: no cut)")
    if not 0 <= args.seed < 2**32:
        raise ConfigError(f"seed={args.seed}: must be in 0..{2**32 - 1}")


def user_turns(first: str | None):
    """The user's messages: `first`, then one per stdin line until an empty line, `/exit` or
    the end of input (ConfigError, one line, on a line that is not UTF-8)."""
    if first is not None:
        yield first
    while sys.stdin is not None:  # None: started with stdin closed, which is the end of input
        if sys.stdin.isatty():
            sys.stderr.write("> ")
            sys.stderr.flush()
        try:
            line = sys.stdin.readline()
        except UnicodeDecodeError as e:  # a strict stdin (PYTHONIOENCODING=utf-8:strict)
            raise ConfigError(f"prompt: not valid UTF-8 (byte 0x{e.object[e.start]:02x} on "
                              f"stdin); give UTF-8 text") from None
        text = line.rstrip("\r\n")
        if not line or not text.strip() or text.strip() == "/exit":
            return
        check_text("prompt", text)
        yield text


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags.add_model_flags(p)
    model_ref.add_step_flag(p)
    p.add_argument("--prompt", default=None, help="the user's message")
    p.add_argument("--interactive", action="store_true",
                   help="then read more user turns from stdin, one per line")
    p.add_argument("--system", default=None, help="a system message (default: the model's)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"per reply (default {DEFAULT_NEW_TOKENS}, or what the model's context "
                        f"leaves after the prompt: a run trained on short sequences)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-int8", action="store_true", help="keep the KV cache in int8")
    p.add_argument("--layout", default="probe", choices=LAYOUTS,
                   help="the decode steps' layer layout: probe (the faster of the stacked scan "
                        "and per-layer arrays on this host, timed once per host, model and int8 "
                        "mode and remembered in the cache folder; default), rule "
                        "(model.generate's fixed rule), scan or per-layer")
    p.add_argument("--json", action="store_true", help="print the reply as JSON last")
    args = p.parse_args(argv)
    try:
        check(args)
        loading, chat_stream, decoding, machine = startup.begin(
            "experiments.pretrained.loading", "experiments.pretrained.chat_stream",
            "experiments.pretrained.decoding", "experiments.speed.machine", devices=1)
        pre = loading.for_decoding(loading.load_quantized(
            args.model, args.layers, args.gguf, args.quant, args.alpha, args.step, args.context))
        per_layer = {"rule": None, "scan": False, "per-layer": True}.get(args.layout)
        if args.layout == "probe":
            cpu = machine.describe()
            per_layer = decoding.remembered_layout(
                pre, loading.cache_dir() / "layout_probe.json",
                f"{cpu['host_cpu']['model']} x{cpu['cpus']}")["per_layer"]
        if args.top_k > pre.cfg.vocab_size:
            raise ConfigError(f"top_k={args.top_k}: must be at most the vocabulary "
                              f"({pre.cfg.vocab_size})")
        history: list[dict[str, str]] = []
        row = None
        turns = user_turns(args.prompt) if args.interactive else [args.prompt]
        for i, message in enumerate(turns):
            messages = history + [{"role": "user", "content": message}]
            new_tokens = args.max_new_tokens or max(1, min(
                DEFAULT_NEW_TOKENS,
                pre.cfg.max_len - len(loading.conversation_ids(pre, messages, args.system))))
            row = chat_stream.stream_reply(
                pre, messages, args.system, new_tokens,
                chat_stream.turn_key(args.seed, i), args.temperature, args.top_k, args.kv_int8,
                on_text=None if args.json else echo, per_layer=per_layer)
            history = messages + [{"role": "assistant", "content": row["reply"]}]
    except (ConfigError, GGUFError, QuantError) as e:
        fail(PROG, str(e).splitlines()[0])
    except KeyboardInterrupt:  # Ctrl-C stops the reply: end the line, no traceback
        sys.stdout.write("\n")
        sys.stdout.flush()
        sys.exit(130)  # the shell's code for a process stopped by SIGINT
    if args.json:
        print(json.dumps(row))
    return row


def echo(text: str) -> None:
    """Print streamed reply text as it comes."""
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
