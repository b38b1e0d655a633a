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
