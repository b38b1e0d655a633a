"""An exported Hugging Face folder of a non-Llama family, loaded by transformers beside the
folder it came from.

Runs in the separate PyTorch environment (never the project's venv), on a folder our exporter
wrote (`experiments.pretrained.exporter.export(..., "safetensors", DIR)`) from the parameters
of one of the tiny models transformers made (tests/fixtures/hf/<arch>/, read with
`model.hf_decoder.load_hf`; tests/test_export_families.py writes such folders):

  HF_HUB_OFFLINE=1 REFVENV/bin/python experiments/reference/check_export_family.py \\
      --export /tmp/gemma3_text --fixture tests/fixtures/hf/gemma3_text

transformers reads both folders with `AutoModelForCausalLM.from_pretrained` in float32 (our
config.json must pass its strict config classes) and runs every text of the fixture's
reference.json through both. Prints one JSON line: the class loaded, the largest absolute
logit difference between the two (float rounding at most: the tensors are the same values, but
torch's kernels may sum in another order when a file's data lies at another alignment), the
largest |mean NLL - the fixture's reference| and how many greedy next tokens agree with it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="the folder our exporter wrote")
    p.add_argument("--fixture", required=True, help="the transformers-made folder it came from")
    args = p.parse_args()
    rows = json.loads((Path(args.fixture) / "reference.json").read_text())["results"]
    ours = AutoModelForCausalLM.from_pretrained(args.export, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(args.fixture, dtype=torch.float32).eval()
    logit_diff = nll_diff = 0.0
    agree = 0
    for r in rows:
        ids = torch.tensor([r["tokens"]])
        with torch.no_grad():
            a, b = ours(ids).logits[0], theirs(ids).logits[0]
        logit_diff = max(logit_diff, (a - b).abs().max().item())
        agree += int(a[-1].argmax().item() == r["next_token"])
        if r["mean_nll"] is not None:
            logp = torch.log_softmax(a.double(), -1)
            nll = -logp[torch.arange(len(r["tokens"]) - 1), ids[0, 1:]].mean().item()
            nll_diff = max(nll_diff, abs(nll - r["mean_nll"]))
    print(json.dumps({"loaded_as": type(ours).__name__, "texts": len(rows),
                      "max_abs_logit_diff": logit_diff, "max_abs_nll_diff": nll_diff,
                      "next_identical": agree}))


if __name__ == "__main__":
    main()
