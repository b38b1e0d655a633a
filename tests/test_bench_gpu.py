"""experiments.bench_gpu: on a CPU it skips the GPU parts in one line and writes why; its --tiny
run goes through the same code paths (dp and zero3 train steps, MFU bookkeeping, int8 vs bf16
matmuls with the compiled-HLO check) on tiny shapes."""

from __future__ import annotations

import json

import jax
import pytest

from experiments import accel_bench
from model import MODEL_PRESETS
from model.flops import train_flops_per_token
from tests.test_cli import cli

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu",
                                reason="checks the CPU behaviour of the GPU benchmark")


def test_without_a_gpu_it_skips_in_one_line_and_records_why(tmp_path):
    out = tmp_path / "skip.json"
    proc = cli("bench_gpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and "GPU parts are skipped" in lines[0]
    record = json.loads(out.read_text())
    assert record["skipped"] is True and "backend cpu" in record["reason"]
    assert record["machine"]["backend"] == "cpu" and "load_1min" in record["machine"]


def test_tiny_run_measures_both_strategies_and_both_matmuls(tmp_path):
    out = tmp_path / "tiny.json"
    proc = cli("bench_gpu", "--tiny", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["hlo_keeps_s8"] is True
    d = json.loads(out.read_text())
    assert d["tiny"] is True and d["skipped"] is False
    assert [r["strategy"] for r in d["training"]] == ["dp", "zero3"]
    for r in d["training"]:
        assert r["loss_finite"] and r["step_s"] > 0 and r["mfu"] is None  # no known peak on CPU
        assert r["model_flops_per_token"] == train_flops_per_token(MODEL_PRESETS["tiny"], 32)
    assert [m["n"] for m in d["matmuls"]] == [64, 128]
    assert all(m["int8_ms"] > 0 and m["hlo_converts"] == [] for m in d["matmuls"])
    # Refused: GPU figures' file for a tiny run.
    proc = cli("bench_gpu", "--tiny", "--out", "experiments/results/bench_gpu.json")
    assert proc.returncode == 2 and "bench_gpu.json holds GPU figures" in proc.stderr


def test_peak_table_and_the_widening_check():
    assert accel_bench.peak_flops("NVIDIA H200") == 989e12
    assert accel_bench.peak_flops("cpu") is None
    hlo = ("ENTRY %main (a: s8[4,4], b: s8[4,4]) -> s32[4,4] {\n"
           "  %f = s32[4,4]{1,0} fusion(%a), kind=kLoop, calls=%wrapped_convert_computation\n}")
    assert accel_bench.widened_operands(hlo)
    assert not accel_bench.widened_operands(hlo.replace("wrapped_convert", "wrapped_pad"))
