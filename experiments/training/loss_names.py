"""A validation loss under the names that say what it is: bits per byte where the tokens are
bytes, perplexity (and the loss in nats per token) where they are a model's vocabulary. Every
writer of a run's metrics uses these, so a row's keys never depend on who wrote it. Importing
this module does not import JAX.
"""

from __future__ import annotations

import math


def perplexity(val_loss: float) -> float:
    return math.exp(val_loss) if val_loss < 700 else math.inf  # a diverged run still reports


def loss_measures(val_loss: float, byte_tokens: bool, prefix: str = "val_") -> dict:
    """A mean validation loss (nats per token) under its names: bits per byte where the tokens
    are bytes, perplexity where they are a model's vocabulary (bits per byte would be wrong)."""
    if byte_tokens:
        return {f"{prefix}bits_per_byte": val_loss / math.log(2)}
    return {"val_perplexity": perplexity(val_loss)}


def val_row(step: int, val_loss: float, byte_tokens: bool) -> dict:
    """A validation row of metrics.jsonl: the same keys at every step of a run."""
    return {"step": step, "val_loss": val_loss, **loss_measures(val_loss, byte_tokens)}


def describe_loss(val_loss: float, byte_tokens: bool) -> str:
    if byte_tokens:
        return f"val loss {val_loss:.4f}, {val_loss / math.log(2):.3f} bits/byte"
    return f"val loss {val_loss:.4f} nats/token, perplexity {perplexity(val_loss):.3f}"
