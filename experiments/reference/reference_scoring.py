"""Scoring with a transformers model, for the reference scripts that run in the separate
PyTorch environment (make_smollm2_reference.py, check_export_reference.py): never imported by
the project, which has no torch."""

from __future__ import annotations


def score(model, ids_per_text, tail: int = 0) -> list[dict]:
    """Per text: mean NLL over positions 1..n-1 (None for one token) and the greedy next token;
    with `tail`, also `mean_nll_last` over the last `tail` of those positions (an error at the
    end of a long text is not averaged away)."""
    import torch

    rows = []
    with torch.no_grad():
        for ids in ids_per_text:
            logits = model(torch.tensor([ids])).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            nll = None
            if len(ids) > 1:
                picked = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
                nll = float(-picked.mean())
            row = {"mean_nll": nll, "next_token": int(logits[-1].argmax())}
            if tail:
                row["mean_nll_last"] = float(-picked[-tail:].mean())
            rows.append(row)
    return rows


def greedy_replies(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int) -> list:
    """Per prompt (ChatML token ids): the greedy reply, one token at a time from the KV cache,
    eos included when it comes; the first step's two most likely tokens with their
    probabilities (how close the first choice is); and at every step the gap between the two
    largest logits (`margins`: where it is tiny, another implementation's last bits may pick
    the other token, and the replies part without either being wrong)."""
    import torch

    rows = []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            logits = out.logits[0, -1].double()
            top = torch.topk(torch.softmax(logits, dim=-1), 2)
            tokens, margins = [], []
            while len(tokens) < max_new_tokens:
                two = torch.topk(logits, 2).values
                margins.append(float(two[0] - two[1]))
                tokens.append(int(logits.argmax()))
                if tokens[-1] == eos_id:
                    break
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                            use_cache=True)
                logits = out.logits[0, -1].double()
            rows.append({"tokens": tokens, "margins": margins,
                         "first_top2": {"ids": top.indices.tolist(), "p": top.values.tolist()}})
    return rows
