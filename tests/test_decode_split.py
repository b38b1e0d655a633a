"""Decoding levers of experiments.bench_decode on the tiny model: a step split over two devices
(parallel/decode_split.py) against one device, the per-operation breakdown of a decode call
(experiments/speed/decode_profile.py), and the timed layout probe."""

from __future__ import annotations

import functools

import jax
import numpy as np

from experiments.pretrained import decoding
from experiments.pretrained.loading import Pretrained
from experiments.reporting.registry.speed import split_int8_agrees
from experiments.speed import xla_flag_runs
from experiments.speed.decode_profile import GROUPS, decode_breakdown
from parallel.decode_split import split_params
from quant.modes import QuantConfig
from quant.pipeline import quantize
from tests.quant_models import CFG, calibration_batches, tiny_float_model

PROMPT = [3, 17, 42, 99, 5, 61, 7, 200]
NEW = 6


@functools.cache
def models() -> dict[str, Pretrained]:
    graphdef, params = tiny_float_model()
    qdef, qparams, _, _ = quantize(graphdef, params,
                                   QuantConfig(mode="w8a8", rules=("blocks/*", "embed")),
                                   calibration_batches()[:1])
    w8def, w8params, _, _ = quantize(graphdef, params, QuantConfig(mode="w8"),
                                     calibration_batches()[:1])
    return {"none": Pretrained("tiny", CFG, graphdef, params, None),
            "w8a8": Pretrained("tiny", CFG, qdef, qparams, None, quant="w8a8"),
            "w8": Pretrained("tiny", CFG, w8def, w8params, None, quant="w8")}


def test_split_decoding_writes_the_same_tokens_as_one_device():
    # int8 products sum in int32, exactly, however the devices split them: the same tokens.
    pre = models()["w8a8"]
    rows = decoding.decode_benchmark(
        [decoding.DecodeVariant("one", pre), decoding.DecodeVariant("split", pre, devices=2)],
        PROMPT, NEW, repeats=1)
    assert [r["devices"] for r in rows] == [1, 2]
    assert rows[0]["tokens"] == rows[1]["tokens"]
    assert all(r["cores_busy"] > 0 for r in rows)


def test_split_places_mlp_and_vocabulary_halves_on_each_device():
    pre = models()["w8a8"]
    placed = split_params(pre.graphdef, pre.params, 2)
    up = placed["blocks"]["mlp"]["up"]["kernel_q"]  # [layers, mlp, embed]
    q = placed["blocks"]["attn"]["q"]["kernel_q"]
    table = placed["embed"]["embedding_q"]  # [vocab, embed]
    assert {s.data.shape for s in up.addressable_shards} == {
        (CFG.n_layers, CFG.d_ff // 2, CFG.d_model)}
    assert {s.data.shape for s in table.addressable_shards} == {
        (CFG.vocab_size // 2, CFG.d_model)}
    # Attention stays whole on both devices (its head counts need not divide the devices).
    assert {s.data.shape for s in q.addressable_shards} == {q.shape}
    assert len(up.sharding.device_set) == 2


def test_breakdown_puts_int8_products_in_their_group_and_float_ones_in_theirs():
    out = {}
    for quant, pre in list(models().items())[:2]:
        fn, args = decoding.decode_programs(decoding.DecodeVariant(quant, pre), PROMPT, NEW)
        out[quant] = decode_breakdown(fn, args, NEW)
    for b in out.values():
        assert set(b["ms_per_token"]) == set(GROUPS)
        assert b["ops_per_token"] > 0 and b["wall_ms_per_token"] > 0
        assert b["between_ops_ms_per_token"] >= 0
    assert out["w8a8"]["ms_per_token"]["int8_products"] > 0
    assert out["none"]["ms_per_token"]["int8_products"] == 0  # the control: no int8 product
    assert out["none"]["ms_per_token"]["float_products"] > 0


def test_layout_probe_picks_the_faster_layout_it_measured():
    probe = decoding.probe_layout(models()["w8a8"], PROMPT, new_tokens=4, repeats=1)
    speeds = probe["tokens_per_s"]
    assert set(speeds) == {"per_layer", "layer_scan"}
    assert probe["per_layer"] == (speeds["per_layer"] > speeds["layer_scan"])
    assert np.isfinite(list(speeds.values())).all()
    assert jax.devices()  # the session's devices are untouched by the probe


def test_registry_claim_fails_when_a_split_int8_variant_writes_other_tokens():
    rows = [{"variant": "w8a8", "quant": "w8a8", "devices": 1, "tokens": [1, 2, 3]},
            {"variant": "w8a8-split2", "quant": "w8a8", "devices": 2, "tokens": [1, 2, 3]},
            {"variant": "float-split2", "quant": "none", "devices": 2, "tokens": [9]}]
    assert split_int8_agrees({"variants": rows})
    rows[1] = {**rows[1], "tokens": [1, 2, 4]}
    assert not split_int8_agrees({"variants": rows})


def test_flag_rows_alternate_children_take_medians_and_time_a_control(monkeypatch):
    calls = []
    # the baseline and the control share their (empty) flags: their runs come in turn
    speeds = {"": [10.0, 13.0, 12.0, 11.0], "--a": [15.0, 21.0]}

    def fake_child(argv, flags):
        calls.append(flags)
        return speeds[flags][sum(1 for c in calls if c == flags) - 1]

    monkeypatch.setattr(xla_flag_runs, "child_speed", fake_child)
    control, row = xla_flag_runs.flag_rows(["--variants", "w8a8"], rounds=2,
                                           flag_sets={"a": "--a"})
    # baseline, control, flag set; then reversed: none always first
    assert calls == ["", "", "--a", "--a", "", ""]
    assert control["control"] and not row["control"]
    assert control["change"] == xla_flag_runs.CONTROL and control["xla_flags"] == ""
    assert control["baseline_runs_tokens_per_s"] == [10.0, 11.0]  # rounds 1 and 2: first, last
    assert control["runs_tokens_per_s"] == [13.0, 12.0]
    assert row["baseline_tokens_per_s"] == 10.5 and row["tokens_per_s"] == 18.0
    assert row["speedup"] == 18.0 / 10.5 and control["speedup"] == 12.5 / 10.5


def test_layout_probe_is_remembered_per_host_and_model(tmp_path):
    pre = models()["w8a8"]
    cache = tmp_path / "shardq" / "layout_probe.json"
    first = decoding.remembered_layout(pre, cache, "host A")
    assert not first["remembered"] and isinstance(first["per_layer"], bool)
    again = decoding.remembered_layout(pre, cache, "host A")
    assert again["remembered"] and again["per_layer"] == first["per_layer"]
    # Another host probes anew; a damaged file is probed over, not trusted.
    assert not decoding.remembered_layout(pre, cache, "host B")["remembered"]
    cache.write_text("{not json")
    assert not decoding.remembered_layout(pre, cache, "host A")["remembered"]
    assert decoding.remembered_layout(pre, cache, "host A")["remembered"]


def _calls(text: str, target: str) -> bool:
    """Whether a lowered program calls the custom call `target` itself (not one whose name
    starts with it, as the grouped entries' names do)."""
    return f"@{target}(" in text


def test_shardq_kernels_decode_the_same_tokens_as_xla_products():
    # The int8 kernel's products equal XLA's (bit for bit for w8a8; XLA's program then fuses the
    # dequantisation into the following add, a last-bit difference): on the tiny model greedy
    # decoding writes the same tokens. The compiled steps show which products each runs.
    # (The weight-only and float kernels sum in another order: equal to rounding, the same
    # tokens here.)
    from model import native_argmax, native_attention, native_float
    from quant import native_int8

    for quant, kernel in (("w8a8", native_int8), ("w8", native_int8), ("none", native_float)):
        target = kernel.TARGET_W8 if quant == "w8" else kernel.TARGET
        pre = models()[quant]
        variants = [decoding.DecodeVariant("kernel", pre),
                    decoding.DecodeVariant("xla", pre, kernels=False)]
        rows = decoding.decode_benchmark(variants, PROMPT, NEW, repeats=1)
        assert rows[0]["tokens"] == rows[1]["tokens"], quant
        texts = [fn.lower(*args).as_text()
                 for fn, args in (decoding.decode_programs(v, PROMPT, NEW) for v in variants)]
        assert not _calls(texts[1], target)
        assert _calls(texts[0], target) == kernel.status()["available"]
        # the greedy pick goes with the kernels: shardq's where they run, XLA's argmax not
        assert not _calls(texts[1], native_argmax.TARGET)
        assert _calls(texts[0], native_argmax.TARGET) == native_argmax.status()["available"]
        # attention over the float cache: shardq's kernel by default, XLA's when asked
        assert _calls(texts[0], native_attention.TARGET) == native_attention.status()["available"]
        xla_attention = decoding.DecodeVariant("xla-attention", pre, attention_kernel=False)
        fn, args = decoding.decode_programs(xla_attention, PROMPT, NEW)
        text = fn.lower(*args).as_text()
        assert not _calls(text, native_attention.TARGET) and _calls(text, target) == (
            kernel.status()["available"])
        assert decoding.decode_benchmark([xla_attention], PROMPT, NEW, repeats=1)[0][
            "tokens"] == rows[0]["tokens"]


def test_timed_calls_write_a_fresh_copy_of_the_cache_in_place():
    """The benchmark's scan program takes its cache donated, as chat's loops do (a cache copied
    inside the timed call is a whole-cache copy no chat step makes); each call gets its own copy
    of the prefilled cache, so calls repeat exactly and the prefilled one stays."""
    for v in (decoding.DecodeVariant("w8a8", models()["w8a8"]),
              decoding.DecodeVariant("split", models()["w8a8"], devices=2)):
        fn, args = decoding.decode_programs(v, PROMPT, NEW)
        assert "input_output_alias" in fn.lower(*args).compile().as_text()
        runs = []
        for _ in range(2):
            fresh = decoding.fresh_args(args)
            runs.append(np.asarray(fn(*fresh)[0]))
            assert all(a.is_deleted() for a in jax.tree.leaves(fresh[2]))
        assert not any(a.is_deleted() for a in jax.tree.leaves(args[2]))
        np.testing.assert_array_equal(runs[0], runs[1])
    rows = decoding.decode_benchmark([v], PROMPT, NEW, repeats=2)
    assert rows[0]["tokens_agree"]


def test_benchmark_turns_reverse_and_a_timed_speed_is_one_call(monkeypatch):
    calls: list[str] = []
    real = decoding.decode_programs
    shared = []

    def recording(v, prompt, new_tokens, made=None):
        fn, args = real(v, prompt, new_tokens, made)
        shared.append((made, args[0]))

        def run(*call_args):
            calls.append(v.name)
            return fn(*call_args)

        return run, args

    monkeypatch.setattr(decoding, "decode_programs", recording)
    pre = models()["none"]
    variants = [decoding.DecodeVariant("a", pre), decoding.DecodeVariant("b", pre)]
    decoding.decode_benchmark(variants, PROMPT, NEW, repeats=2, rounds=2)
    # one untimed call each (the tokens), then the timed turns: A B, B A, A B, B A
    assert calls == ["a", "b"] + ["a", "b", "b", "a"] * 2
    # two variants of one model read one copy of its kernels stored for decoding
    (made_a, params_a), (made_b, params_b) = shared
    assert made_a is made_b and len(made_a) == 1 and params_a is params_b
    calls.clear()
    run = decoding.timed_speed(variants[0], PROMPT, NEW)  # compiled by one untimed call
    assert calls == ["a"] and run() > 0 and calls == ["a", "a"]
