"""PyTorch side of experiments.bench_encoder: all-MiniLM-L6-v2 sentence embeddings with
transformers, float32 and `torch.ao.quantization.quantize_dynamic` int8, on given sentences.

Runs ONLY in the separate reference environment (torch, transformers; never the project's venv,
and it imports neither jax nor the project):

  HF_HUB_OFFLINE=1 REFVENV/bin/python experiments/reference/torch_encoder_reference.py \\
      --model-dir DIR --sentences S.json --batch 32 --repeats 3
  ... --serve     # bench_encoder's mode: one request per stdin line, one JSON reply per line

What a sentence-transformers user gets: texts sorted by length (longest first, as
SentenceTransformer.encode does), batches padded to their longest text, truncated at 256 tokens
(sentence_bert_config.json), mean pooling over the attention mask (1e-9 clamp), L2 normalisation.
Threads = the machine's cores unless --threads. A timed pass is the whole set end to end
(tokenisation included). The last stdout line is JSON: sentences/s per variant, the int8
embeddings' cosine to the float ones (mean/min), versions.

--serve: lines "float" or "int8" each time one pass and reply {"variant", "seconds"}; "quit"
ends. This lets bench_encoder interleave torch passes with its own (A, B, A, B, ...). A line
"kernels M,K,N;M,K,N..." times one Linear layer per shape instead (x [M,K] -> [M,N], float32
and quantize_dynamic int8, median of 30 calls) and replies {"kernels": [{m, k, n,
"float32_ms", "int8_ms"}, ...]}: the per-layer side of the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MAX_SEQ_LENGTH = 256  # sentence-transformers' limit for this model (sentence_bert_config.json)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="experiments/reference/torch_encoder_reference.py",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True,
                   help="folder with config.json, model.safetensors, tokenizer.json")
    p.add_argument("--sentences", required=True, help="JSON file: a list of strings")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="default: os.cpu_count()")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per variant (median)")
    p.add_argument("--serve", action="store_true", help="answer timing requests on stdin")
    return p


class Encoder:
    def __init__(self, model_dir: str, batch: int):
        import torch
        import transformers

        self.torch = torch
        self.batch = batch
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        model = transformers.AutoModel.from_pretrained(model_dir).eval()
        self.models = {"float": model,
                       "int8": torch.ao.quantization.quantize_dynamic(
                           model, {torch.nn.Linear}, dtype=torch.qint8)}

    def encode(self, variant: str, texts: list[str]):
        """[n, D] float32 numpy unit-norm embeddings in the input order."""
        import numpy as np

        torch, model = self.torch, self.models[variant]
        # Sorting by length keeps the padding small, as SentenceTransformer.encode does.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = [None] * len(texts)
        with torch.inference_mode():
            for s in range(0, len(order), self.batch):
                idx = order[s:s + self.batch]
                enc = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                     max_length=MAX_SEQ_LENGTH, return_tensors="pt")
                hidden = model(**enc).last_hidden_state
                m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                emb = torch.nn.functional.normalize(pooled, p=2, dim=1)
                for j, i in enumerate(idx):
                    out[i] = emb[j].numpy()
        return np.stack(out).astype(np.float32)

    def timed(self, variant: str, texts: list[str]) -> float:
        start = time.perf_counter()
        self.encode(variant, texts)
        return time.perf_counter() - start


def kernel_times(shapes: list[tuple[int, int, int]], calls: int = 30) -> list[dict]:
    """Median ms of one nn.Linear(K, N) on x [M, K]: float32, and quantize_dynamic's int8."""
    import torch

    def median_ms(f, x) -> float:
        f(x)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            f(x)
            times.append(time.perf_counter() - start)
        return 1e3 * sorted(times)[len(times) // 2]

    rows = []
    torch.manual_seed(0)
    for m, k, n in shapes:
        linear = torch.nn.Sequential(torch.nn.Linear(k, n)).eval()
        int8 = torch.ao.quantization.quantize_dynamic(linear, {torch.nn.Linear},
                                                      dtype=torch.qint8)
        x = torch.randn(m, k)
        with torch.inference_mode():
            rows.append({"m": m, "k": k, "n": n, "float32_ms": median_ms(linear, x),
                         "int8_ms": median_ms(int8, x)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a hub lookup would be a bug: fail instead
    import numpy as np
    import torch
    import transformers

    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    texts = json.loads(Path(args.sentences).read_text())
    enc = Encoder(args.model_dir, args.batch)
    ref = enc.encode("float", texts)  # warm-up and the fidelity reference
    q = enc.encode("int8", texts)
    cos = np.sum(ref * q, axis=1)
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "threads": threads, "batch": args.batch, "n_sentences": len(texts),
            "int8_cosine_mean": float(cos.mean()), "int8_cosine_min": float(cos.min())}
    if args.serve:
        print(json.dumps({"ready": info}), flush=True)
        for line in sys.stdin:
            variant = line.strip()
            if variant == "quit":
                break
            if variant.startswith("kernels "):
                shapes = [tuple(int(v) for v in spec.split(","))
                          for spec in variant.split(" ", 1)[1].split(";")]
                print(json.dumps({"kernels": kernel_times(shapes)}), flush=True)
                continue
            if variant not in enc.models:
                print(json.dumps({"error": f"unknown request {variant!r}"}), flush=True)
                continue
            print(json.dumps({"variant": variant, "seconds": enc.timed(variant, texts)}),
                  flush=True)
        return info
    for variant in enc.models:
        times = sorted(enc.timed(variant, texts) for _ in range(args.repeats))
        info[f"{variant}_sentences_per_s"] = len(texts) / times[len(times) // 2]
    print(json.dumps(info))
    return info


if __name__ == "__main__":
    main()
