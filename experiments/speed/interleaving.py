"""The order of interleaved timed runs: each round the reverse of the last (A B, B A, A B ...),
so that no setting always runs first, right after whatever ran before the round."""

from __future__ import annotations


def round_order(settings: list, round_index: int) -> list:
    """`settings` in order in even rounds, reversed in odd ones."""
    return settings if round_index % 2 == 0 else settings[::-1]
