"""Write tests/fixtures/hf/llama_spm/: a tiny Llama whose tokenizer is a SentencePiece model, as
Llama 2, TinyLlama and Mistral 7B ship theirs (`tokenizer.model`: BPE pieces with byte
fallback, a dummy space prefix, digits split, no normalisation), made by transformers.

Run with the separate PyTorch interpreter (never imported by the project):

  /work/refvenv/bin/python experiments/reference/make_spm_fixture.py

The SentencePiece model is trained here (the `sentencepiece` library) on standard-library
docstrings; the folder holds it, the `tokenizer.json` transformers converts it to, the model
(LlamaForCausalLM, weights re-drawn as make_hf_fixtures.py draws them) and `reference.json`: per
text the ids SentencePiece itself gives (with BOS first, as Llama's tokenizer adds it), and
transformers' mean NLL over positions 1..n-1 and greedy next token on those ids;
`transformers_tokens` are the ids of transformers' own tokenizer, which differ from SentencePiece's
where a text starts with a space or holds a special token's text (SentencePiece, like llama.cpp's
perplexity, reads it as characters). llama.cpp's converter turns the folder into a GGUF
(make_llama_cpp_ggufs.py), which tests/test_llama_cpp_converted.py reads.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path

import sentencepiece as spm
import torch
import transformers
from make_hf_fixtures import COMMON, TEXTS, corpus, redraw

VOCAB = 400
SEED = 10
# Beyond the fixtures' texts: a leading space, runs of spaces, digits, a character the pieces
# lack (byte fallback) and text around a control token.
EXTRA = [" leading space", "two  spaces and   three", "1234567 + 89", "emoji 😀 and é",
         "a</s>b"]


def train() -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus().splitlines()), model_writer=model, model_type="bpe",
        vocab_size=VOCAB, byte_fallback=True, split_digits=True, add_dummy_prefix=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        allow_whitespace_only_pieces=True, minloglevel=2)
    return model.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/hf/llama_spm"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenizer.model").write_bytes(train())
    sp = spm.SentencePieceProcessor(model_file=str(args.out / "tokenizer.model"))
    assert sp.get_piece_size() == VOCAB
    cfg = transformers.LlamaConfig(**{**COMMON, "vocab_size": VOCAB, "bos_token_id": 1,
                                      "eos_token_id": 2, "max_position_embeddings": 256})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                         dtype=torch.float32)
    redraw(model, SEED)
    model.eval()
    model.save_pretrained(args.out)
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "legacy": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    tok = transformers.AutoTokenizer.from_pretrained(args.out)  # converted from the model
    tok.save_pretrained(args.out)
    rows = []
    for text in TEXTS[:-1] + EXTRA:
        ids = [sp.bos_id()] + sp.encode(text)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        nll = (-logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).tolist()
        rows.append({"text": text, "tokens": ids, "mean_nll": sum(nll) / len(nll),
                     "next_token": int(logits[-1].argmax()),
                     "transformers_tokens": tok(text)["input_ids"]})
    assert all(math.isfinite(r["mean_nll"]) for r in rows)
    (args.out / "reference.json").write_text(json.dumps({
        "model_type": "llama", "tokenizer": "sentencepiece " + spm.__version__,
        "transformers": transformers.__version__, "results": rows}, indent=1) + "\n")
    same = sum(r["tokens"] == r["transformers_tokens"] for r in rows)
    print(f"{len(rows)} texts; transformers' ids equal SentencePiece's for {same}")


if __name__ == "__main__":
    main()
