"""Write tests/fixtures/hf/<arch>/: tiny Hugging Face decoders made by transformers itself.

Run with the separate PyTorch interpreter (never imported by the project):

  /work/refvenv/bin/python experiments/reference/make_hf_fixtures.py [--out tests/fixtures/hf]

One folder per architecture the reader `model/hf_decoder.py` supports: llama, llama3 (a llama with
Llama 3's RoPE scaling), mistral (a sliding window shorter than the longest text), qwen2 (q/k/v
biases), qwen3 (q/k RMSNorm and a head size other than d_model / n_heads), gemma3_text (four
layers, sliding and global ones interleaved, a window shorter than the longest text, a query scale
other than the head size's and a final soft-cap), phi3 (q/k/v and gate/up each in one fused tensor,
a window shorter than the longest text), phi3_partial (Phi-4-mini's RoPE on three quarters of
each head) and phi3_longrope (phi3_partial with Phi-4-mini's LongRoPE, its pretraining context
between the lengths of the texts, so that transformers scores the shorter texts with the short
factors and the longer ones with the long). Each holds what `save_pretrained` writes in
float32 (config.json, model.safetensors), one byte-level BPE `tokenizer.json` trained here with the
`tokenizers` library on standard-library docstrings (the same for every folder), a
`tokenizer_config.json`, and `reference.json`: per text transformers' mean NLL in nats over
positions 1..n-1 of the text tokenised without BOS (what `experiments.score --json` reports) and
its greedy next token after the whole text, and `chat`: transformers' rendering of a few
conversations in the folder's chat template (ChatML; Llama 3's format for llama3, Gemma's for
gemma3_text), with the ids, or the template's refusal.

The weights are re-drawn larger than transformers' init (which makes every distribution nearly
uniform, where a wrong reader would still score close) so that the next-token distributions
are peaky; norms and biases are drawn away from their neutral 1 and 0 for the same reason.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 320
SLIDING_WINDOW = 16  # Mistral's fixture: shorter than the longest texts below
LONGROPE_ORIGINAL = 24  # phi3_longrope's pretraining context: three texts below are shorter
TEXTS = [
    "The capital of France is",
    "def add(a, b):\n    return a + b",
    "Return the number of items in a container.",
    "import os\nprint(os.path.join('a', 'b'))",
    "A list is a mutable sequence, typically used to store collections of homogeneous items.",
    "Open file and return a stream. Raise OSError upon failure. The file is either a text or "
    "binary file, and its encoding and buffering are chosen from the arguments given here.",
    "x",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                 "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama 3's chat format and Gemma's (written here, in their shapes): header tokens around each
# role, and turns that must alternate (a template that refuses a conversation). Indented over
# several lines, so that rendering them checks Jinja's block trimming as transformers sets it.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
GEMMA_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {% endif %}
    {% set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<start_of_turn>model\n' }}
{% endif %}
"""
TEMPLATES = {"llama3": LLAMA3_TEMPLATE, "gemma3_text": GEMMA_TEMPLATE}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": " Hi "},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "naïve café 😀"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
ARCHS = {
    "llama": (transformers.LlamaConfig,
              dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "mistral": (transformers.MistralConfig,
                dict(sliding_window=SLIDING_WINDOW, head_dim=16,
                     rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    "qwen2": (transformers.Qwen2Config,
              dict(tie_word_embeddings=True, use_sliding_window=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen3": (transformers.Qwen3Config,
              dict(head_dim=24, use_sliding_window=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "gemma3_text": (transformers.Gemma3TextConfig,
                    dict(num_hidden_layers=4, head_dim=16, sliding_window=SLIDING_WINDOW,
                         layer_types=["sliding_attention", "full_attention",
                                      "sliding_attention", "full_attention"],
                         query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                         tie_word_embeddings=True, pad_token_id=1,
                         rope_parameters={
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default",
                                                "rope_theta": 1000000.0}})),
    # Last, so the folders above keep their seeds. Llama 3's RoPE scaling, its original context
    # short enough that the fixture's head size has frequencies in each of the three bands
    # (kept, blended, divided).
    "llama3": (transformers.LlamaConfig,
               dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64})),
    # Phi-3: q/k/v in one fused tensor and gate/up in another, and a sliding window as
    # Phi-3-mini's.
    "phi3": (transformers.Phi3Config,
             dict(sliding_window=SLIDING_WINDOW, pad_token_id=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Phi-4-mini's form of Phi-3: RoPE on three quarters of each head, a tied head, no window.
    "phi3_partial": (transformers.Phi3Config,
                     dict(pad_token_id=1, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75})),
    # Phi-4-mini's LongRoPE on phi3_partial: one factor per rotary frequency (12 of each head's
    # 16 dimensions: 6), growing with the wavelength as the published ones do; the attention
    # factor is transformers' default for max_position_embeddings / 24.
    "phi3_longrope": (transformers.Phi3Config,
                      dict(pad_token_id=1, tie_word_embeddings=True,
                           original_max_position_embeddings=LONGROPE_ORIGINAL,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75,
                                            "short_factor": [1.0, 1.05, 1.3, 1.9, 2.6, 3.1],
                                            "long_factor": [1.0, 1.4, 3.5, 9.0, 21.0, 40.0]})),
}


def corpus() -> str:
    """Standard-library docstrings: a deterministic text every Python has."""
    import collections
    import json as json_module
    import os
    import pathlib
    import textwrap
    parts = []
    for mod in (os, pathlib, textwrap, json_module, collections):
        for name in sorted(dir(mod)):
            doc = getattr(getattr(mod, name), "__doc__", None)
            if isinstance(doc, str):
                parts.append(doc)
    return "\n".join(parts)


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus()], trainer=trainer)
    return tok


def redraw(model: torch.nn.Module, seed: int, plus_one: bool = False) -> None:
    """Large weights; norm scales away from neutral (Gemma's (1 + w) scales around 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                std = 1.0 if "embed" in name else 0.35
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:  # norm scales
                p.copy_((0.0 if plus_one else 1.0) + torch.randn(p.shape, generator=gen) * 0.2)


def reference(model, tok: Tokenizer) -> list[dict]:
    rows = []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        nll = (-logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).tolist()
        rows.append({"text": text, "tokens": ids,
                     "mean_nll": sum(nll) / len(nll) if nll else None,
                     "next_token": int(logits[-1].argmax())})
    return rows


def chats(folder: Path) -> list[dict]:
    """transformers' rendering of each conversation in the folder's chat template, with its
    token ids, or that the template refused it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rows = []
    for messages in CONVERSATIONS:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as e:  # transformers raises jinja's TemplateError for a refusal
            rows.append({"messages": messages, "refused": str(e)})
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append({"messages": messages, "text": text, "ids": ids})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="tests/fixtures/hf")
    p.add_argument("--only", choices=list(ARCHS), help="write this architecture's folder only")
    args = p.parse_args()
    tok = train_tokenizer()
    torch.manual_seed(0)
    for seed, (arch, (cls, extra)) in enumerate(ARCHS.items()):
        if args.only not in (None, arch):
            continue
        cfg = cls(**{**COMMON, **extra})
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="eager", dtype=torch.float32)
        redraw(model, seed, plus_one=arch.startswith("gemma"))
        model.eval()
        folder = Path(args.out) / arch
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>", "add_bos_token": False,
            "chat_template": TEMPLATES.get(arch, CHAT_TEMPLATE),
            "model_max_length": cfg.max_position_embeddings}, indent=1) + "\n")
        rows = reference(model, tok)
        assert all(r["mean_nll"] is None or math.isfinite(r["mean_nll"]) for r in rows)
        longest = max(len(r["tokens"]) for r in rows)
        (folder / "reference.json").write_text(json.dumps({
            "model_type": cfg.model_type, "transformers": transformers.__version__,
            "longest_text_tokens": longest, "results": rows, "chat": chats(folder)},
            indent=1) + "\n")
        print(arch, "longest", longest, [round(r["mean_nll"] or 0, 3) for r in rows])


if __name__ == "__main__":
    main()
