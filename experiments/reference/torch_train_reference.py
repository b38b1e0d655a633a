"""PyTorch eager reference of the `small` training step: the speed our JAX step is compared with.

  REFVENV/bin/python experiments/reference/torch_train_reference.py --d-model 128 --n-layers 3 \
      --n-heads 4 --d-ff 512 --vocab 256 --seq-len 128 --batch 32 --steps 20

Run ONLY with the reference interpreter (torch lives there, never in the project's
dependencies); it imports neither JAX nor the project, so every model dimension arrives as a
flag (`experiments.bench_train --torch-python PATH` passes them). The model is the project's
decoder: pre-norm RMSNorm blocks, rotary attention (rotate-half), tanh-GELU MLP, no biases, a
final norm and a head (tied to the embedding with --tie); AdamW with weight decay on the matmul
weights only and global-norm clipping, fp32, `torch.set_num_threads(cores)`. Prints one JSON
line: the parameter count (the caller checks it against model/flops.py) and tokens/s (median
of the timed steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, eps: float):
        super().__init__()
        self.heads, self.eps = heads, eps
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.up, self.down = nn.Linear(d, ff, bias=False), nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        h = F.rms_norm(x, (D,), self.attn_norm, self.eps)
        split = lambda y: y.view(B, T, self.heads, -1).transpose(1, 2)  # B,N,T,H
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        h = F.rms_norm(x, (D,), self.mlp_norm, self.eps)
        return x + self.down(F.gelu(self.up(h), approximate="tanh"))


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DecoderLM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.eps, self.tie = a.norm_eps, a.tie
        self.embed = nn.Embedding(a.vocab, a.d_model)
        self.blocks = nn.ModuleList(Block(a.d_model, a.n_heads, a.d_ff, a.norm_eps)
                                    for _ in range(a.n_layers))
        self.final_norm = nn.Parameter(torch.ones(a.d_model))
        self.head = None if a.tie else nn.Linear(a.d_model, a.vocab, bias=False)
        half = a.d_model // a.n_heads // 2
        freqs = a.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.arange(a.seq_len, dtype=torch.float32)[:, None] * freqs[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, self.cos, self.sin)
        x = F.rms_norm(x, (x.shape[-1],), self.final_norm, self.eps)
        return x @ self.embed.weight.T if self.tie else self.head(x)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("vocab", 256), ("d-model", 128), ("n-layers", 3), ("n-heads", 4),
                          ("d-ff", 512), ("seq-len", 128), ("batch", 32), ("steps", 20),
                          ("warmup", 3), ("threads", os.cpu_count() or 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--tie", action="store_true", help="head tied to the input embedding")
    p.add_argument("--rope-base", type=float, default=10_000.0)
    p.add_argument("--norm-eps", type=float, default=1e-6)
    p.add_argument("--lr", type=float, default=6e-3)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = DecoderLM(a)
    decay = [q for n, q in model.named_parameters() if q.dim() == 2 and "embed" not in n]
    rest = [q for n, q in model.named_parameters() if not (q.dim() == 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=gen)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    times, losses = [], []
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))  # the host sees every loss, as our benchmark does
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    out = {"torch_version": torch.__version__, "threads": torch.get_num_threads(),
           "params": sum(q.numel() for q in model.parameters()), "median_step_s": med,
           "tokens_per_s": a.batch * a.seq_len / med, "first_loss": losses[0],
           "last_loss": losses[-1]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
