"""Back-to-back pairs of our decoder and the peer's (experiments/speed/paired_runs.py): the
order within a pair alternates and each ratio is its own pair's (the report's table and claim
of them: tests/test_llama_cpp_peer.py)."""

import statistics

import pytest

from experiments.speed import paired_runs


def _recording(calls: list[str], name: str, speeds: list[float]):
    it = iter(speeds)

    def run() -> float:
        calls.append(name)
        return next(it)

    return run


def test_pairs_alternate_order_and_keep_each_pairs_ratio():
    calls: list[str] = []
    sides = {"float / F32": (_recording(calls, "float", [60.0, 90.0, 70.0]),
                             _recording(calls, "F32", [80.0, 75.0, 70.0])),
             "w8a8 / Q8_0": (_recording(calls, "w8a8", [200.0, 210.0, 220.0]),
                             _recording(calls, "Q8_0", [160.0, 175.0, 200.0]))}
    rows = paired_runs.paired_runs(sides, 3)
    # pair 0: ours first; pair 1: the peer's first; pair 2: ours first; labels in turn
    assert calls == ["float", "F32", "w8a8", "Q8_0",
                     "F32", "float", "Q8_0", "w8a8",
                     "float", "F32", "w8a8", "Q8_0"]
    f, q = rows
    assert (f["label"], f["pairs"]) == ("float / F32", 3)
    assert f["ratios"] == [60.0 / 80.0, 90.0 / 75.0, 1.0]
    assert f["median_ratio"] == 1.0 and (f["min_ratio"], f["max_ratio"]) == (0.75, 1.2)
    # the median of ratios is not the ratio of medians (which would be 70 / 75 here)
    assert f["median_ratio"] != statistics.median(f["ours_tokens_per_s"]) / statistics.median(
        f["peer_tokens_per_s"])
    assert q["ratios"] == [200.0 / 160.0, 1.2, 1.1]
    with pytest.raises(ValueError, match="pairs=0"):
        paired_runs.paired_runs(sides, 0)
