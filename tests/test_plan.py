"""The planner (experiments/zero/plan_*.py) on the `tiny` shape with the 8 fake devices of
conftest.

References: the ZeRO paper's Table 1 formulas (zero_evidence.paper_bytes at our exact Psi) for
the model-state column, the compiled program for the layout state the pruning relies on, and a
stand-in measurement (no compile) for the search's bookkeeping: what is pruned, skipped and
recommended.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.cli.config import ConfigError
from experiments.zero import plan_estimate, plan_family, plan_request, plan_search
from experiments.zero.evidence import paper_bytes
from experiments.zero.peak_check import (
    PeakSampler,
    _status_bytes,
    anonymous_resident,
    malloc_in_use,
    reset_peak_resident,
)
from model.config import MODEL_PRESETS
from model.flops import param_count
from tests.helpers import ROOT, child_env

TINY = dataclasses.replace(MODEL_PRESETS["tiny"], param_dtype="bfloat16",
                           compute_dtype="bfloat16")
KEYS = {"strategy", "mesh", "remat", "micro_batch", "model_state_gb", "peak_gb",
        "comm_volume_psi", "fits"}


def skip_unless_ci(reason: str) -> None:
    """Skip on a machine without what the test reads; fail when env CI is true, so CI never
    passes by skipping (the pattern of tests.helpers.require_package)."""
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"CI is set and {reason}", pytrace=False)
    pytest.skip(reason)


def _request(**kw) -> plan_request.PlanRequest:
    base = dict(model=TINY, devices=8, device_memory=1e9, seq_len=32, global_batch=16)
    return plan_request.PlanRequest(**{**base, **kw})


@functools.cache
def _compiled_plan() -> dict:
    """Every ZeRO stage compiled once: remat full, one sequence per device per micro-step, two
    micro-steps (so the gradient accumulator is a loop-carried buffer), 1 GB devices."""
    req = _request(strategies=("dp", "zero1", "zero2", "zero3"), remats=("full",),
                   micro_batches=(1,), data_sizes=(1,))
    return plan_search.plan(req, budget_s=600)


def test_model_state_column_is_zero_table_1():
    result = _compiled_plan()
    psi = param_count(TINY)
    rows = {r["strategy"]: r for r in result["candidates"]}
    assert set(rows) == {"dp", "zero1", "zero2", "zero3"}
    for stage, row in rows.items():
        assert row["status"] == "compiled" and row["grads_from"] == "compiled loop carry"
        expected = paper_bytes(stage, psi, 8)
        assert row["model_state_gb"] * plan_request.GB == pytest.approx(expected, rel=0.02), stage
    # And the stages differ as the paper says (not one number passing four times).
    assert rows["dp"]["model_state_gb"] > rows["zero1"]["model_state_gb"] > \
        rows["zero2"]["model_state_gb"] > rows["zero3"]["model_state_gb"]


def test_json_keys_and_recommendation():
    result = _compiled_plan()
    assert json.loads(json.dumps(result)) == result  # what --json prints
    for row in result["candidates"]:
        assert KEYS <= set(row)
        assert row["peak_gb"] >= row["model_state_gb"]
    rec = result["recommended"]
    assert KEYS <= set(rec) and rec["fits"] is True
    fitting = [r for r in result["candidates"] if r["fits"]]
    assert rec["est_step_s"] == min(r["est_step_s"] for r in fitting)


def test_layout_state_is_what_the_compiled_program_holds():
    # Pruning uses the layout (no compile); it must be the compiled program's state exactly.
    for row in _compiled_plan()["candidates"]:
        layout = plan_estimate.layout_state(TINY, row["strategy"], 8)
        assert sum(layout.values()) == pytest.approx(row["model_state_gb"] * plan_request.GB,
                                                     abs=1), row["strategy"]


def _fake_measure(calls, per_sequence=1e6):
    """Stand-in for compiling: state from the layout, peak = state + per_sequence bytes per
    sequence per micro-step, volume from the paper's formulas."""

    def measure(req, cand):
        calls.append(cand)
        state = plan_estimate.layout_state(req.model, cand.strategy, cand.fsdp)
        steps = req.per_device_batch // cand.micro_batch
        return {"params_bytes": state["params"], "optimizer_bytes": state["optimizer"],
                "grads_bytes": state["grads"], "grads_from": "fake",
                "peak_bytes": sum(state.values()) + per_sequence * cand.micro_batch,
                "argument_bytes": 0, "temp_bytes": 0, "compile_s": 0.0,
                "volume_psi": plan_estimate.expected_volume_psi(req.model, cand, steps),
                "layer_gather_psi": 0.0}

    return measure


def test_pruned_by_state_are_never_compiled():
    psi = param_count(TINY)
    # Usable memory between zero2's and zero1's model state at 8 devices: dp and zero1 out.
    memory = (paper_bytes("zero2", psi, 8) + paper_bytes("zero1", psi, 8)) / 2 / 0.9
    calls = []
    req = _request(device_memory=memory, strategies=("dp", "zero1", "zero2"), data_sizes=(1,))
    result = plan_search.plan(req, measure=_fake_measure(calls, per_sequence=100), budget_s=600)
    by_status = {}
    for row in result["candidates"]:
        by_status.setdefault(row["status"], []).append(row)
    pruned = by_status["pruned"]
    by_state = {r["strategy"] for r in pruned if r["reason"].startswith("model state ")
                and "activations" not in r["reason"]}
    assert by_state == {"dp", "zero1"}
    assert all(r["fits"] is False for r in pruned)
    # zero2 rows go only where the activations their remat must keep do not fit either.
    assert all("saved activations" in r["reason"] for r in pruned if r["strategy"] == "zero2")
    assert not any(c.strategy in ("dp", "zero1") for c in calls)
    assert all(r["strategy"] == "zero2" for r in by_status["compiled"])
    assert result["recommended"]["strategy"] == "zero2"


def test_what_needs_more_memory_than_a_failure_is_not_compiled():
    # 1 MB per sequence and 1.5 MB over fsdp=8's state: micro-batch 2 fails on fsdp=8, which
    # rules out micro-batch 2 on data=2,fsdp=4 (more state per device) without compiling it.
    calls = []
    state = sum(plan_estimate.layout_state(TINY, "zero3", 8).values())
    req = _request(device_memory=(state + 1.5e6) / 0.9, strategies=("zero3",),
                   remats=("full",), data_sizes=(1, 2))
    result = plan_search.plan(req, measure=_fake_measure(calls), budget_s=600)
    rows = {(r["mesh"], r["micro_batch"]): r for r in result["candidates"]}
    assert rows[("data=1,fsdp=8", 2)]["status"] == "compiled"
    assert rows[("data=1,fsdp=8", 2)]["fits"] is False
    implied = rows[("data=2,fsdp=4", 2)]
    assert implied["status"] == "implied" and implied["fits"] is False
    assert (2, 2) not in {(c.data, c.micro_batch) for c in calls}
    assert len(calls) == len(set(calls)) == 3  # the other three, each once
    assert result["recommended"]["mesh"] == "data=1,fsdp=8"
    assert result["recommended"]["micro_batch"] == 1


def test_memory_order_of_candidates():
    c = plan_request.Candidate("zero3", 1, 8, "full", 1)
    assert plan_request.Candidate("zero3", 2, 4, "full", 1).needs_at_least_as_much_as(c)
    assert plan_request.Candidate("zero3", 1, 8, "none", 2).needs_at_least_as_much_as(c)
    assert not plan_request.Candidate("zero3", 1, 8, "full", 1).needs_at_least_as_much_as(
        plan_request.Candidate("zero3", 1, 8, "none", 1))
    assert not plan_request.Candidate("zero2", 1, 8, "none", 2).needs_at_least_as_much_as(c)


def test_compile_cache_answers_the_second_plan(tmp_path):
    calls = []
    req = _request(strategies=("zero3",), remats=("full",), data_sizes=(1,))
    first = plan_search.plan(req, cache=plan_estimate.CompileCache(tmp_path),
                             measure=_fake_measure(calls))
    n = len(calls)
    again = plan_search.plan(req, cache=plan_estimate.CompileCache(tmp_path),
                             measure=_fake_measure(calls))
    assert n > 0 and len(calls) == n
    assert {r["status"] for r in again["candidates"] if r["peak_gb"] is not None} == {"cached"}
    assert again["recommended"]["peak_gb"] == first["recommended"]["peak_gb"]


def test_a_cache_entry_of_another_shape_is_a_miss(tmp_path):
    # Valid JSON that is not a compile result (a list, a dict without the keys, a wrong type)
    # is compiled again and rewritten, never read as a result.
    calls = []
    req = _request(strategies=("zero3",), remats=("full",), micro_batches=(2,), data_sizes=(1,))
    key = plan_estimate.cache_key(req, plan_request.Candidate("zero3", 1, 8, "full", 2))
    good = _fake_measure([])(req, plan_request.Candidate("zero3", 1, 8, "full", 2))
    for bad in ([1, 2], {"peak_bytes": 1}, {**good, "peak_bytes": "big"}, "text", None):
        (tmp_path / f"{key}.json").write_text(json.dumps(bad))
        result = plan_search.plan(req, cache=plan_estimate.CompileCache(tmp_path),
                                  measure=_fake_measure(calls))
        assert result["candidates"][0]["status"] == "compiled", bad
        assert json.loads((tmp_path / f"{key}.json").read_text()) == good
    assert len(calls) == 5


def test_units_and_family():
    assert plan_request.parse_bytes("80GB") == 80e9
    assert plan_request.parse_bytes("24GiB") == 24 * 2**30
    assert plan_request.parse_count("70B") == 70e9
    for bad in ("80 apples", "-1GB", "GB", "80XB", "0GB"):
        with pytest.raises(ConfigError, match="device-memory"):
            plan_request.parse_bytes(bad)
    for name in plan_family.FAMILY_PRESETS:  # every GPT-style preset is a member of the family
        preset = MODEL_PRESETS[name]
        assert plan_family.family_shape(preset.d_model).n_layers == preset.n_layers
    member = plan_family.family_shape(plan_family.family_width_for(70e9))
    assert param_count(member) == pytest.approx(70e9, rel=0.02)


def test_bad_request_names_the_field():
    with pytest.raises(ConfigError, match="global-batch=12"):
        _request(global_batch=12).validate()
    with pytest.raises(ConfigError, match="n_kv_heads=3"):
        _request(model=dataclasses.replace(TINY, n_kv_heads=3)).validate()


def test_launcher_bad_input_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.plan", "--preset", "tiny", "--devices", "8",
         "--device-memory", "lots", "--cache", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("experiments.plan: error: device-memory=")
    assert not (tmp_path / "cache").exists()


def _in_a_fresh_process(check: str) -> None:
    """Run this module's `check` in a new interpreter. The memory instruments read process-wide
    counters, and a long-lived test worker's allocator state decides where a 64 MB block comes
    from: a worker that has run many tests may serve it from memory the process already holds,
    so that the checks below see no growth at all."""
    code = f"import tests.test_plan as t; t.{check}()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_peak_samplers_see_a_known_allocation_in_the_right_half():
    """plan_accuracy's instruments (experiments/zero/peak_check.py) against allocations of known
    size made inside the block: 64 MB in one array (one mmapped block: the large half of glibc's
    count, and the resident set once written) and 16 MB in 16,000 one-KB buffers (the small
    half), both gone again after."""
    if malloc_in_use() is None:
        skip_unless_ci("no glibc mallinfo2 here")
    _in_a_fresh_process("check_peak_samplers")


def check_peak_samplers() -> None:
    base_rss, (base_large, base_small) = anonymous_resident(), malloc_in_use()
    with PeakSampler() as rss, PeakSampler(malloc_in_use) as in_use:
        big = np.ones(64 << 20, np.uint8)
        small = [bytearray(1024) for _ in range(16_000)]
        time.sleep(0.05)  # a few samples while both are held
        del big, small
    large, small_bytes = in_use.peak
    assert 64 << 20 <= large - base_large < (64 << 20) + (4 << 20), (large, base_large)
    assert 16_000 * 1024 <= small_bytes - base_small < 16_000 * 1024 + (8 << 20)
    assert rss.peak - base_rss >= 64 << 20
    after_large, _ = malloc_in_use()
    assert after_large - base_large < 4 << 20


def test_the_kernel_high_water_mark_keeps_a_peak_that_is_gone():
    """The check on plan_accuracy's sampling: after a reset, the kernel's high-water mark of the
    resident set holds a 64 MB allocation made and freed between two reads, which no sampler
    saw, and a second reset forgets it."""
    if not reset_peak_resident():
        skip_unless_ci("/proc/self/clear_refs is not writable here")
    _in_a_fresh_process("check_high_water_mark")


def check_high_water_mark() -> None:
    assert reset_peak_resident()
    before = _status_bytes("VmRSS")["VmRSS"]
    big = np.ones(64 << 20, np.uint8)  # written, so resident
    del big
    # >= 60 of the 64 MiB: the kernel folds each thread's page counts into the process's in
    # batches, so both of its figures may lag by a few hundred KB.
    assert _status_bytes("VmHWM")["VmHWM"] - before >= 60 << 20
    assert _status_bytes("VmRSS")["VmRSS"] - before < 16 << 20  # freed: an mmapped block
    assert reset_peak_resident()
    assert _status_bytes("VmHWM")["VmHWM"] - before < 16 << 20
