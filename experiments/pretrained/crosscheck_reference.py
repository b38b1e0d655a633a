"""The transformers side of `experiments.w8a8_crosscheck`: the variants both sides run, and
one run of experiments/reference/torch_w8a8_reference.py under the separate PyTorch interpreter.

No JAX here: the launcher names these before it starts the runtime.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "torch_w8a8_reference.py"
# The reference rounds x / s computed in float64, and again in float32 (as we do): which values
# fall on which side of a rounding boundary differs, and the spread shows what that alone moves.
QUOTIENTS = ["float64", "float32"]

# name -> (our mode, the block Dense groups our rules leave float; the reference's activation
# granularity, the Linear layers it leaves float, whether it rotates the Linear inputs)
VARIANTS = {
    "none": ("none", None, None, [], False),
    "w8a8": ("w8a8", None, "token", [], False),
    "w8a8-tensor": ("w8a8-tensor", None, "tensor", [], False),
    "w8a8, q/k/v float": ("w8a8", "q/k/v", "token", ["q", "k", "v"], False),
    "w8a8-rotated": ("w8a8-rotated", None, "token", [], True),
}


class ReferenceFailed(RuntimeError):
    """The reference run failed or disagrees with ours on what it scored."""


def figures(nll: float, float_nll: float) -> dict:
    """A side's NLL as a row: its perplexity and the change against that side's float model."""
    return {"nll": nll, "perplexity": math.exp(nll),
            "vs_float_pct": 100 * (math.exp(nll - float_nll) - 1)}


def reference(python: str, ids: list[int], window: int, layers: int | None,
              chat: dict) -> dict:
    """The reference's NLL (and greedy replies to chat["prompts"]) per variant, from one run
    of torch_w8a8_reference.py."""
    request = {"ids": ids, "window": window, "layers": layers, "quotients": QUOTIENTS, **chat,
               "variants": [{"name": name, "act": act, "float_groups": floats, "rotate": rotate}
                            for name, (_, _, act, floats, rotate) in VARIANTS.items()]}
    with tempfile.TemporaryDirectory(prefix="shardq-w8a8-ref-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        req.write_text(json.dumps(request))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.Popen([python, str(REFERENCE), "--request", str(req), "--out",
                                 str(out)], stderr=subprocess.PIPE, text=True, env=env)
        last = "no output"
        for line in proc.stderr:  # its progress, shown as it comes; the last line kept
            if line.strip():
                last = line.strip()
                if ": nll " in last:
                    print(f"transformers {last}", file=sys.stderr, flush=True)
        if proc.wait() or not out.is_file():
            raise ReferenceFailed(f"the transformers reference failed (exit {proc.returncode}): "
                                  f"{last}")
        theirs = json.loads(out.read_text())
    by = {}
    for r in theirs["rows"]:
        by.setdefault(r["variant"], {})[r["quotient"]] = r
    theirs["rows"] = by
    return theirs
