"""Our side of `experiments.w8a8_crosscheck`: SmolLM2's perplexity and greedy chat replies per
int8 variant, set beside the transformers reference's (crosscheck_reference) row by row.
"""

from __future__ import annotations

import re
import sys

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments.pretrained import loading, reply_stability, scoring
from experiments.pretrained.chat_prompts import PROMPTS
from experiments.pretrained.crosscheck_reference import (
    VARIANTS,
    ReferenceFailed,
    figures,
    reference,
)
from experiments.speed.machine import describe
from model.generate import prefill
from quant.convert import QuantConfig


def crosscheck(torch_python: str, layers: int | None, tokens: int, window: int,
               new_tokens: int) -> dict:
    """Both sides' perplexity (and, with `new_tokens`, greedy replies) per variant, on the first
    `tokens` validation tokens in windows of `window`, the model truncated to `layers`."""
    pre = loading.load("smollm2", layers)
    ids = scoring.validation_ids(pre, tokens, window)  # refuses bad sizes first
    prompts = [loading.chat_ids(pre, p.text) for p in PROMPTS] if new_tokens else []
    theirs = reference(torch_python, ids.tolist(), window, layers,
                       {"prompts": prompts, "max_new_tokens": new_tokens,
                        "eos_id": pre.tokenizer.eos_id})
    ours = {}
    for name, (mode, float_group, *_) in tqdm(VARIANTS.items(), desc="ours", file=sys.stderr):
        # The blocks' Dense layers alone, as the reference quantises its block Linear layers
        # (its tied head stays float).
        rules = loading.rules_without(float_group) if float_group else ("blocks/*",)
        qcfg = QuantConfig(mode=mode, rules=rules)
        model = loading.quantize(pre, mode, qcfg)
        ours[name] = scoring.perplexity(model, tokens, window)
        ours[name]["replies"] = our_replies(model, prompts, new_tokens)
    rows = []
    float_theirs = theirs["rows"]["none"]["float64"]["nll"]
    for name in VARIANTS:
        o = ours[name]
        row = {"variant": name, "ours": figures(o["nll"], ours["none"]["nll"])}
        replies = {"ours": _judged(pre, o["replies"])}
        for quotient, t in theirs["rows"][name].items():
            if t["scored"] != o["scored"]:
                raise ReferenceFailed(f"the reference scored {t['scored']} positions, we "
                                      f"scored {o['scored']}: not the same windows")
            key = "transformers" if quotient == "float64" else f"transformers_{quotient}_quotient"
            row[key] = figures(t["nll"], float_theirs)
            replies[key] = _judged(pre, t["replies"])
        row["transformers_int8_linears"] = t["int8_linears"]  # the same for every quotient
        if prompts:
            row["replies"] = replies
        rows.append(row)
    out = {"model": pre.name, "layers": pre.cfg.n_layers, "tokens": len(ids),
           "window": window, "scored": ours["none"]["scored"], "rows": rows,
           "reference": {k: v for k, v in theirs.items() if k != "rows"},
           "machine": describe()}
    if prompts:
        out["prompts"] = [{"text": p.text, "answer": p.answer} for p in PROMPTS]
        out["new_tokens"] = new_tokens
    return out


def our_replies(model, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """What the reference writes per prompt, from our model: the greedy reply as `chat`
    streams it, and the first step's two most likely tokens, from the prefill that reply
    starts from (`first_top2`) and from `score`'s whole-prompt pass (`first_top2_forward`).
    In float the two agree to rounding; an int8 model rounds the last-bit differences between
    them (attention summed block by block over the cache, or at once)."""
    out = []
    for ids in prompts:
        tokens = np.asarray([ids], np.int32)
        logits, _, _ = prefill(nnx.merge(model.graphdef, model.params), tokens, new_tokens)
        forward = scoring.make_logprob_fn(model.graphdef)(model.params, tokens)[-1]
        out.append({"tokens": reply_stability.greedy_reply_ids(model, ids, new_tokens),
                    "first_top2": _top2(jax.nn.log_softmax(logits[0])),
                    "first_top2_forward": _top2(forward)})
    return out


def _top2(logp) -> dict:
    logp = np.asarray(logp)
    top = np.argsort(-logp)[:2]
    return {"ids": top.tolist(), "p": np.exp(logp[top]).tolist()}


def _judged(pre, replies: list[dict]) -> list[dict]:
    """Each reply decoded (by our tokenizer, for both sides) and checked for the answer."""
    out = []
    for p, r in zip(PROMPTS, replies, strict=True):
        text = pre.tokenizer.decode(r["tokens"], skip_special=True)
        named = {k: {**v, "texts": [pre.tokenizer.decode([i]) for i in v["ids"]]}
                 for k, v in r.items() if k.startswith("first_top2")}
        out.append({**r, **named, "reply": text,
                    "correct": re.search(p.answer, text, re.IGNORECASE) is not None})
    return out
