"""The decode benchmarks' timed calls run with Python's garbage collector paused (a full
collection in a benchmark process can outlast a timed call, and lands in one call at random),
and the collector is as it was afterwards."""

from __future__ import annotations

import gc
import time

import pytest

from experiments.pretrained import decoding
from experiments.pretrained.prefill_speed import PrefillBench
from experiments.speed.gc_pause import gc_paused
from experiments.speed.gpu_decode import preset_model


def test_paused_inside_and_restored_after():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), gc_paused():  # restored when the block raises, too
        raise KeyError("x")
    assert gc.isenabled()
    gc.disable()
    try:  # left off when it was off
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_every_clock_read_of_the_decode_timings_has_the_collector_paused(monkeypatch):
    seen = []
    clock = time.perf_counter

    def watched() -> float:
        seen.append(gc.isenabled())
        return clock()

    pre = preset_model("tiny")
    prompt = [1, 2, 3, 4]
    run = decoding.timed_speed(decoding.DecodeVariant("float", pre), prompt, 4)
    bench = PrefillBench({"float": pre}, prompt * 2)
    monkeypatch.setattr(time, "perf_counter", watched)
    assert run() > 0
    rows = decoding.decode_benchmark([decoding.DecodeVariant("float", pre),
                                      decoding.DecodeVariant("stream", pre, streamed=True)],
                                     prompt, 4, repeats=2)
    bench.time_round(2)
    monkeypatch.undo()
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # two reads per timed call: timed_speed's 1; decode_benchmark's untimed first call and 2
    # timed ones of each of its 2 variants, 6; the prefill's 2 programs twice each, 4
    assert len(seen) == 2 * (1 + 6 + 4) and not any(seen), seen
    assert gc.isenabled()
