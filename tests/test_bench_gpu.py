"""experiments.bench_gpu: on a CPU it skips the GPU parts in one line and writes why; its --tiny
run goes through the same code paths (dp and zero3 train steps, MFU bookkeeping, int8 vs bf16
matmuls with the compiled-HLO check) on tiny shapes."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.cli.config import ConfigError
from experiments.pretrained import decoding
from experiments.reporting.tables import speed as speed_tables
from experiments.speed import gpu as accel_bench
from experiments.speed import gpu_decode
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
    # Batch-1 decoding and prefill of SmolLM2 (2 layers) and the tiny preset, bf16 and int8,
    # through the CPU tables' decode path.
    decode = {(r["model"], r["form"]): r for r in d["decode"]}
    assert list(decode) == [(m, f) for m in ("smollm2", "tiny") for f in gpu_decode.FORMS]
    assert d["decode_skipped"] == {} and summary["decode_tokens_per_s"].keys() == {
        f"{m}/{f}" for m, f in decode}
    for r in d["decode"]:
        assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
        assert r["prefill_last_tokens_per_s"] > 0 and r["tokens_agree_between_runs"]
        assert (r["prompt_tokens"], r["new_tokens"], r["prefill_window"]) == (8, 8, 16)
        assert r["weights"] == ("pretrained" if r["model"] == "smollm2" else "random")
    # int8 stored (the tied table too), against bf16's two bytes a weight; greedy tokens of the
    # real weights mostly unchanged by int8
    smol = {f: decode["smollm2", f] for f in gpu_decode.FORMS}
    assert smol["w8"]["param_bytes"] == smol["w8a8"]["param_bytes"] < \
        0.6 * smol["bf16"]["param_bytes"]
    assert smol["bf16"]["tokens_as_bf16"] == 8
    assert min(smol[f]["tokens_as_bf16"] for f in ("w8", "w8a8")) >= 4
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


def test_decode_forms_and_a_model_not_installed():
    # The bf16 form stores and computes in bf16; the int8 forms compute in bf16 from int8
    # kernels. A pretrained model that cannot be loaded is a reason, and the preset still runs.
    tiny = gpu_decode.preset_model("tiny")
    forms = gpu_decode.forms(tiny)
    assert list(forms) == list(gpu_decode.FORMS)
    bf16 = forms["bf16"]
    assert (bf16.cfg.param_dtype, bf16.cfg.compute_dtype) == ("bfloat16", "bfloat16")
    assert {a.dtype for a in jax.tree.leaves(bf16.params)} == {jnp.dtype(jnp.bfloat16)}
    for mode in ("w8", "w8a8"):
        m = forms[mode]
        assert m.quant == mode and m.cfg.compute_dtype == "bfloat16"
        assert jnp.dtype(jnp.int8) in {a.dtype for a in jax.tree.leaves(m.params)}
    got = list(gpu_decode.decode_models({"decode_pretrained": "no-such-model",
                                         "decode_preset": "tiny"}))
    assert [(name, weights) for name, _, weights in got] == [("no-such-model", ""),
                                                             ("tiny", "random")]
    assert isinstance(got[0][1], str) and "no-such-model" in got[0][1]
    assert got[1][1].cfg == tiny.cfg


def test_a_pretrained_model_not_installed_runs_as_its_shapes(monkeypatch):
    # On an accelerator's host without SmolLM2's package, its preset's shapes (random weights)
    # are timed in its place, and the rows and the table say so.
    def not_installed(name, n_layers=None):
        raise ConfigError(f"model={name!r}: its package is not installed")

    monkeypatch.setattr(gpu_decode.loading, "load", not_installed)
    (name, model, weights), _ = gpu_decode.decode_models(
        {"decode_pretrained": "smollm2", "decode_layers": 2, "decode_preset": "tiny"})
    assert name == "smollm2" and weights.startswith("random (ConfigError: model='smollm2'")
    assert model.cfg == dataclasses.replace(MODEL_PRESETS["smollm2"], n_layers=2)
    row = {"model": "smollm2", "weights": weights, "form": "bf16", "layers": 2,
           "param_bytes": 1, "decode_tokens_per_s": 2.0, "weight_gb_per_s": 1.0,
           "tokens_as_bf16": 8, "prefill_tokens_per_s": 3.0,
           "prefill_last_tokens_per_s": 4.0, "new_tokens": 8, "prompt_tokens": 8,
           "prefill_window": 16}
    table = "\n".join(speed_tables._gpu_decode_rows([row], {}))
    assert "| smollm2 (2 layers, random weights) | bf16 |" in table and "| 8 of 8 |" in table
    assert gpu_decode.leading_agreement(np.array([5, 6, 7, 8]), np.array([5, 6, 0, 8])) == 2
    assert "smollm2: random weights of its shapes, since ConfigError" in table


def test_the_decode_programs_lower_for_a_gpu_without_the_cpu_kernels():
    # The decode path picks shardq's CPU kernels per platform; lowered for CUDA (no GPU needed
    # to lower), none of them is left in the program, where the CPU lowering holds them.
    pre = gpu_decode.forms(gpu_decode.preset_model("tiny"))["w8a8"]
    fn, args = decoding.decode_programs(decoding.DecodeVariant("w8a8", pre), [1, 2, 3, 4], 4)

    def targets(text):
        calls = re.findall(r'custom_call @(\w+)|call_target_name = "(\w+)"', text)
        return {name for pair in calls for name in pair if name.startswith("shardq_")}

    assert targets(fn.lower(*args).as_text())  # this (CPU) backend's program
    assert not targets(jax.export.export(fn, platforms=["cuda"])(*args).mlir_module())
