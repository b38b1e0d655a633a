"""Our decoder and a peer's timed back to back, in pairs, and the ratio of each pair.

A host's memory bandwidth drifts as other tenants load it, over seconds to minutes; a
benchmark's rounds (all our variants, then the peer's) put minutes between our run of a model
and the peer's. Here each pair is one timed run of ours and one of the peer's, seconds apart,
the order reversed every other pair so that neither side always runs first; the ratio of each
pair, their median and spread say how far a drift moved the rounds' ratio.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping

from experiments.speed.interleaving import round_order

# one side of a pair: a run that returns its tokens per second
Run = Callable[[], float]


def paired_runs(sides: Mapping[str, tuple[Run, Run]], pairs: int) -> list[dict]:
    """For each {label: (ours, peer)}, `pairs` pairs of one run of each, the labels taken in
    turn within every pair index (so the pairs of one label are spread over the whole
    measurement). Returns one row per label: both sides' tokens/s per pair, each pair's ratio
    (ours / peer), and the ratios' median, min and max."""
    if pairs < 1:
        raise ValueError(f"pairs={pairs}: at least 1")
    speeds = {label: {"ours": [], "peer": []} for label in sides}
    for i in range(pairs):
        for label, (ours, peer) in sides.items():
            run = {"ours": ours, "peer": peer}
            for side in round_order(["ours", "peer"], i):  # ours first in even pairs
                speeds[label][side].append(float(run[side]()))
    rows = []
    for label, got in speeds.items():
        ratios = [a / b for a, b in zip(got["ours"], got["peer"], strict=True)]
        rows.append({"label": label, "pairs": pairs,
                     "ours_tokens_per_s": got["ours"], "peer_tokens_per_s": got["peer"],
                     "ratios": ratios, "median_ratio": statistics.median(ratios),
                     "min_ratio": min(ratios), "max_ratio": max(ratios)})
    return rows
