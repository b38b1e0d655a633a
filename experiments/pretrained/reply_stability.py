"""How an int8 chat model's greedy replies compare with float's, and how stable they are.

Two measurements of a pretrained chat model (SmolLM2) per quantisation mode:

- `greedy_replies`: the reply `experiments.chat` prints for each of a few factual prompts
  (`experiments.pretrained.chat_prompts.PROMPTS`, the same ChatML prompt and the same token-by-token
  `model.generate.stream`), at one or more --max-new-tokens (only the cache length differs
  between those runs, and the shorter reply must begin the longer one), whether it mentions the
  expected answer, and how many of its first tokens equal float's.
- `first_token_spread`: the probability of float's first reply token, and the argmax, when the
  embedding table (tied to the head) is multiplied by (1 + rel * N(0, 1)) under several seeds:
  a float table elementwise, an int8 table through its float scales (each block's or row's).
  rel = 1e-6 is a last-bit change for float32: a model whose reply moves with it is sensitive
  to its own rounding, not to anything a user could see in the weights.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cli.config import ConfigError
from experiments.pretrained.chat_prompts import Prompt
from experiments.pretrained.loading import Pretrained, chat_ids
from experiments.pretrained.scoring import make_logprob_fn
from model.generate import stream


def greedy_reply(pre: Pretrained, prompt: str, max_new_tokens: int) -> list[int]:
    """The tokens `python -m experiments.chat --prompt PROMPT` writes (greedy), end-of-turn
    token included when it comes."""
    return greedy_reply_ids(pre, chat_ids(pre, prompt), max_new_tokens)


def greedy_reply_ids(pre: Pretrained, ids: list[int], max_new_tokens: int) -> list[int]:
    """greedy_reply after prompt token ids that are already in the chat template."""
    return list(stream(pre.graphdef, pre.params, np.asarray([ids], np.int32), max_new_tokens,
                       jax.random.key(0), stop_ids=pre.tokenizer.stop_ids))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two replies share."""
    n = 0
    for x, y in zip(a, b, strict=False):  # replies of different lengths
        if x != y:
            break
        n += 1
    return n


def against_reference(ours: list[int], ref: dict, near_tie: float) -> dict:
    """Our greedy reply against another implementation's ({"tokens", "margins"}: its reply and,
    per step, the gap between its two largest logits). Two correct implementations can part
    only where that gap is within their rounding (`near_tie`, in logits); elsewhere a parting
    is a disagreement."""
    n = common_prefix(ours, ref["tokens"])
    identical = ours == ref["tokens"]
    gap = ref["margins"][n] if not identical and n < len(ref["margins"]) else None
    return {"identical": identical, "common_prefix": n, "reference_tokens": len(ref["tokens"]),
            "margin_where_parted": gap,
            "parted_at_near_tie": gap is not None and gap < near_tie}


def greedy_replies(pre: Pretrained, prompts: tuple[Prompt, ...], lengths: tuple[int, ...],
                   float_tokens: dict | None = None) -> list[dict]:
    """One row per (prompt, length): the reply, whether it matches the prompt's answer, and
    (given float's tokens, keyed by (prompt, length)) the leading tokens it shares with float's.
    """
    rows = []
    for p in prompts:
        for n in lengths:
            toks = greedy_reply(pre, p.text, n)
            reply = pre.tokenizer.decode(toks, skip_special=True)
            row = {"quant": pre.quant, "prompt": p.text, "max_new_tokens": n, "reply": reply,
                   "tokens": toks, "answer": p.answer,
                   "correct": re.search(p.answer, reply, re.IGNORECASE) is not None}
            if float_tokens is not None:
                ref = float_tokens[(p.text, n)]
                row["same_as_float_prefix"] = common_prefix(toks, ref)
                row["float_reply_tokens"] = len(ref)
            rows.append(row)
    return rows


def embedding_path(params: dict) -> tuple[str, str]:
    """Where the embedding table's float values are: the table itself, or an int8 table's
    scales (per block or per row); ConfigError for a model without an embedding table."""
    embed = params.get("embed", {})
    for name in ("embedding", "block_scale", "row_scale"):
        if name in embed and jnp.issubdtype(embed[name].dtype, jnp.floating):
            return ("embed", name)
    raise ConfigError("quant: the model has no embedding table with float values or scales "
                      "to perturb")


def perturbed(params: dict, seed: int, rel: float) -> dict:
    """params with the embedding table's float values (`embedding_path`) multiplied by
    (1 + rel * N(0, 1)), elementwise. Scales stored in float16 (an int8 table's blocks) are
    perturbed as float32, which the model reads as well: float16 would round rel away."""
    group, name = embedding_path(params)
    table = params[group][name]
    if name != "embedding":
        table = table.astype(jnp.promote_types(table.dtype, jnp.float32))
    noise = jax.random.normal(jax.random.key(seed), table.shape, table.dtype)
    return {**params, group: {**params[group], name: table * (1 + rel * noise)}}


def next_token_probs(pre: Pretrained, params: dict, ids: list[int]) -> np.ndarray:
    """p(next token | the whole unpadded prompt) [vocab], float64."""
    logp = make_logprob_fn(pre.graphdef)(params, jnp.asarray([ids], jnp.int32))
    return np.exp(np.asarray(logp[-1], np.float64))


def first_token_spread(pre: Pretrained, prompt: str, seeds: int, rel: float,
                       reference_token: int | None = None) -> dict:
    """P(reference_token) and the argmax after the chat prompt (one full forward pass of the
    unpadded prompt), unperturbed and under `seeds` perturbations of the embedding table (see
    the module docstring); also the two likeliest tokens unperturbed: how close the call is.
    reference_token None: this model's own unperturbed argmax (float's run gives the token the
    int8 runs are then read against)."""
    ids = chat_ids(pre, prompt)
    base = next_token_probs(pre, pre.params, ids)
    if reference_token is None:
        reference_token = int(np.argmax(base))
    p_ref, argmax = [], []
    for seed in range(seeds):
        probs = next_token_probs(pre, perturbed(pre.params, seed, rel), ids)
        p_ref.append(float(probs[reference_token]))
        argmax.append(int(np.argmax(probs)))
    top = [{"token": int(t), "text": pre.tokenizer.decode([int(t)]), "p": float(base[t])}
           for t in np.argsort(-base)[:2]]
    return {"quant": pre.quant, "prompt": prompt, "rel": rel, "seeds": seeds,
            "reference_token": reference_token, "p_unperturbed": float(base[reference_token]),
            "argmax_unperturbed": int(np.argmax(base)), "top2_unperturbed": top,
            "p_reference": p_ref,
            "p_min": min(p_ref), "p_max": max(p_ref), "argmax": argmax,
            "argmax_not_reference": sum(a != reference_token for a in argmax)}


def chat_parity(pre: Pretrained, chat: dict, key: str, near_tie: float) -> dict:
    """Our chat template and greedy KV-cache decoding against a parity fixture's `chat` entry
    (its replies under `key`): per prompt, the prompt ids and the reply compared
    (`against_reference`)."""
    prompts = []
    for text, ids, ref in zip(chat["prompts"], chat["tokens"], chat[key], strict=True):
        ours = greedy_reply(pre, text, chat["max_new_tokens"])
        prompts.append({"prompt": text, "template_identical": chat_ids(pre, text)
                        == ids, "reply": pre.tokenizer.decode(ours, skip_special=True),
                        **against_reference(ours, ref, near_tie)})
    return {"max_new_tokens": chat["max_new_tokens"], "near_tie": near_tie,
            "prompts": prompts}
