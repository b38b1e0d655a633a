"""experiments.bench_gpu: on a CPU it skips the GPU parts in one line and writes why; its --tiny
run goes through the same code paths (dp and zero3 train steps, MFU bookkeeping, int8 vs bf16
matmuls with the compiled-HLO check) on tiny shapes."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from experiments.speed import gpu as accel_bench
from model import MODEL_PRESETS
from model.flops import train_flops_per_token
from model.layers import causal_attention
from tests.helpers import cli, launch_in_one_process

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
    proc = cli("bench_gpu", "--json", "--out", str(out))  # --json: a JSON line last, still
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "skipped": True, "reason": record["reason"], "written": str(out)}


def test_tiny_run_measures_the_variants_it_can_and_both_matmuls(tmp_path, monkeypatch):
    # As a quick reproduction runs it: its own results folder, whose bench_gpu.json a tiny run
    # may write (only the committed one is kept for the full GPU run's figures).
    monkeypatch.setenv("SHARDQ_RESULTS_DIR", str(tmp_path))
    out = tmp_path / "bench_gpu.json"
    variants = "dp/full/xla,zero3/save_dots/xla,dp/full/cudnn"
    proc = cli("bench_gpu", "--tiny", "--json", "--variants", variants, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["hlo_keeps_s8"] is True
    d = json.loads(out.read_text())
    assert d["tiny"] is True and d["skipped"] is False and d["complete"] is True
    assert f"--variants {variants}" in d["command"]
    assert ["/".join((r["strategy"], r["remat"], r["attention"])) for r in d["training"]] == \
        variants.split(",")
    assert d["attention_parity"] == []  # the fused-kernel check needs a GPU: said so
    off_gpu = "attention='cudnn': needs an NVIDIA GPU, the JAX backend is 'cpu'"
    assert d["attention_skipped"].startswith(off_gpu)
    ran = d["training"][:2]
    assert d["training"][2]["skipped"].startswith(off_gpu)
    for r in ran:
        assert r["loss_finite"] and r["step_s"] > 0 and r["mfu"] is None  # no known peak on CPU
        assert r["model_flops_per_token"] == train_flops_per_token(MODEL_PRESETS["tiny"], 32)
    # Strategy and remat change how the step is computed, not what: the same loss before the
    # first update and after the last (the same number of AdamW updates in every variant).
    assert ran[1]["first_loss"] == pytest.approx(ran[0]["first_loss"], abs=1e-5)
    assert ran[0]["updates"] == ran[1]["updates"] == 4
    # bf16 compute: the gradients' sums run in another order and round differently (4e-4 seen),
    # a small fraction of what the 4 updates moved the loss (0.05 seen).
    assert ran[0]["last_loss"] < ran[0]["first_loss"] - 0.02
    assert ran[1]["last_loss"] == pytest.approx(ran[0]["last_loss"], abs=2e-3)
    assert [m["n"] for m in d["matmuls"]] == [64, 128]
    assert all(m["int8_ms"] > 0 and m["hlo_converts"] == [] for m in d["matmuls"])
    # The [out, in] (K-major) kernel computes the same product as quant/'s [in, out] one.
    assert all(m["int8_kmajor_equal"] and m["int8_kmajor_ms"] > 0 for m in d["matmuls"])
    assert "s8[64,64]" in d["matmuls"][0]["entry"]["int8"][0]
    # Prefill in float and in the int8 forms: int8 kernels really stored (fewer bytes).
    inference = {r["mode"]: r for r in d["inference"]}
    assert list(inference) == list(accel_bench.INFERENCE_MODES) == ["none", "w8", "w8a8"]
    assert all(r["logits_finite"] and r["tokens_per_s"] > 0 for r in d["inference"])
    assert inference["w8"]["param_bytes"] == inference["w8a8"]["param_bytes"] < \
        0.6 * inference["none"]["param_bytes"]
    assert summary["prefill_tokens_per_s"].keys() == inference.keys()
    assert out.with_suffix(".png").stat().st_size > 10_000  # the plot, beside the results
    # Drawn again from the file alone; a file that is not a measured run, and flags that are
    # refused, are one line each (all in one process: each start would re-import JAX).
    out.with_suffix(".png").unlink()
    d["matmuls"] = []  # a run of the training part alone, or one cut short: nothing to plot
    (tmp_path / "part.json").write_text(json.dumps(d))
    x = str(tmp_path / "x.json")
    cases = [(["--replot", str(out)], None),
             (["--replot", str(tmp_path / "none.json")], "replot="),
             (["--replot", str(tmp_path / "part.json")], "needs training and matmul rows"),
             (["--tiny", "--out", "experiments/results/bench_gpu.json"],
              "bench_gpu.json holds GPU figures"),
             (["--tiny", "--parts", "training,speed", "--out", x], "parts='training,speed'"),
             (["--tiny", "--parts", "training,,", "--out", x], "each at most once"),
             (["--tiny", "--variants", "dp/full/xla,dp/full/xla", "--out", x], "at most once"),
             (["--tiny", "--variants", "dp/full", "--out", x], "strategy/remat/attention"),
             (["--parts", "matmuls"], "needs --out")]  # not over the whole run's file
    rows = launch_in_one_process([("experiments.bench_gpu", argv) for argv, _ in cases])
    for (argv, said), row in zip(cases, rows, strict=True):
        code, err = row["status"], row["stderr"]
        if said is None:
            assert code == 0, err
        else:
            assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert out.with_suffix(".png").exists() and not (tmp_path / "part.png").exists()
    assert not (tmp_path / "x.json").exists()


def test_the_attention_check_can_fail(monkeypatch):
    # On a GPU `attention_parity` compares the fused kernel with XLA's attention. Here a stand-in
    # for the fused side shows the comparison catches a wrong kernel (no causal mask) and passes
    # a right one (the same attention computed another way).
    def right(q, k, v):  # grouped heads by repeating k and v per query head: another route
        groups = q.shape[2] // k.shape[2]
        return causal_attention(*(q, *(jnp.repeat(a, groups, axis=2) for a in (k, v))))

    def unmasked(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=False, implementation="xla")

    monkeypatch.setattr(accel_bench, "fused_causal_attention", right)
    good = accel_bench.attention_parity(1, 16, 4, 2, 8)["max_rel_diff"]  # grouped heads
    assert 0 < max(good.values()) <= accel_bench.PARITY_TOLERANCE, good
    monkeypatch.setattr(accel_bench, "fused_causal_attention", unmasked)
    bad = accel_bench.attention_parity(1, 16, 4, 4, 8)  # all heads
    assert bad["ok"] is False and bad["max_rel_diff"]["out"] > 0.1, bad


def test_peak_table_and_the_widening_check():
    assert accel_bench.peak_flops("NVIDIA H200") == 989e12
    assert accel_bench.peak_flops("cpu") is None
    hlo = ("ENTRY %main (a: s8[4,4], b: s8[4,4]) -> s32[4,4] {\n"
           "  %f = s32[4,4]{1,0} fusion(%a), kind=kLoop, calls=%wrapped_convert_computation\n}")
    assert accel_bench.widened_operands(hlo)
    assert not accel_bench.widened_operands(hlo.replace("wrapped_convert", "wrapped_pad"))
