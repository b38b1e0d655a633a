"""The ZeRO claims checked on the compiled programs (compile-only, 8 fake devices from conftest).

Reference values: the ZeRO paper's communication (2/2/2/3 Psi) and model-state formulas
(Rajbhandari et al. 2020), and the per-layer bytes a gather-then-release schedule may add.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest
from jax.sharding import PartitionSpec as P

from experiments.training.config import PRESETS, TrainConfig
from experiments.training.optim import make_optimizer
from experiments.zero.evidence import (
    EXPECTED_PSI,
    KEEP_GATHERED,
    ReleaseSetup,
    compile_step,
    fit_growth,
    layer_param_count,
    measure_depth,
    model_config,
    model_state,
    release_report,
    shipped_release,
    volume_report,
)
from model.config import MODEL_PRESETS
from model.flops import param_count
from parallel import hlo, sharded_run
from parallel.rules import sharded_dim
from parallel.state import abstract_model
from parallel.strategies import get_strategy

N = 8
COMM_CFG = model_config("small", remat="full")  # what experiments.comm_volume reports
TINY_MIXED = dataclasses.replace(MODEL_PRESETS["tiny"], param_dtype="bfloat16",
                                 compute_dtype="bfloat16")
OPT_COUNTERS_BYTES = 8  # the Adam and schedule step counters (int32 each), replicated


@functools.cache
def _comm_compiled(strategy: str) -> str:
    compiled, _ = compile_step(COMM_CFG, strategy, N, seq_len=COMM_CFG.max_len, micro_steps=1)
    return compiled.as_text()


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3"])
def test_comm_volume_matches_zero_paper(strategy):
    report = volume_report(_comm_compiled(strategy), COMM_CFG)
    assert report["volume_psi"] == pytest.approx(EXPECTED_PSI[strategy], rel=0.05), report


def test_zero3_volume_is_three_per_layer_param_and_two_per_other_param():
    # Exact decomposition: layer params are gathered, re-gathered and reduce-scattered; the
    # embedding, final norm and head are gathered once per step (kept for the backward pass).
    psi, psi_layers = param_count(COMM_CFG), layer_param_count(COMM_CFG)
    expected = (3 * psi_layers + 2 * (psi - psi_layers)) / psi
    report = volume_report(_comm_compiled("zero3"), COMM_CFG)
    assert report["volume_psi"] == pytest.approx(expected, rel=1e-3)


# The Llama family's options on a tiny shape: grouped-query attention, SwiGLU, tied head.
TINY_GQA = dataclasses.replace(MODEL_PRESETS["tiny"], d_model=64, n_heads=4, n_kv_heads=2,
                               d_ff=96, mlp="swiglu", tie_embeddings=True, n_layers=3,
                               scan_unroll=1, remat="full")


def test_zero3_volume_on_the_gqa_swiglu_shape():
    compiled, _ = compile_step(TINY_GQA, "zero3", N, seq_len=16, micro_steps=1)
    report = volume_report(compiled.as_text(), TINY_GQA)
    psi, psi_layers = param_count(TINY_GQA), layer_param_count(TINY_GQA)
    assert report["volume_psi"] == pytest.approx(
        (3 * psi_layers + 2 * (psi - psi_layers)) / psi, rel=1e-3), report
    assert report["in_layer_loop_psi_layers"] == pytest.approx(3.0, rel=1e-3), report
    assert report["layer_param_gathers"] == pytest.approx(2.0, rel=1e-6)


def test_zero3_model_state_bytes_on_the_gqa_swiglu_shape():
    cfg = dataclasses.replace(TINY_GQA, param_dtype="bfloat16", compute_dtype="bfloat16")
    psi = param_count(cfg)
    compiled, args = compile_step(cfg, "zero3", N, seq_len=16, micro_steps=2)
    parts = model_state(compiled, args, micro_steps=2)
    assert parts == {"params": 2 * psi // N, "grads": 2 * psi // N,
                     "optimizer": 12 * psi // N + OPT_COUNTERS_BYTES}


def test_zero3_all_gathers_sit_inside_the_layer_loop():
    report = volume_report(_comm_compiled("zero3"), COMM_CFG)
    assert report["all_gathers_in_layer_loop"]
    # Forward gather + backward re-gather, each once per layer (trip count = n_layers).
    assert report["layer_param_gathers"] == pytest.approx(2.0, rel=1e-6)
    layer_loop_gathers = [c for c in hlo.collectives(_comm_compiled("zero3"))
                          if c.kind == "all-gather" and c.loops]
    assert {c.loops[-1][1] for c in layer_loop_gathers} == {COMM_CFG.n_layers}


def test_zero3_regathers_in_backward_even_without_remat():
    # remat="none" keeps every activation but, by the zero3 hook's policy, no gathered weight.
    cfg = model_config("small", remat="none")
    compiled, _ = compile_step(cfg, "zero3", N, seq_len=cfg.max_len, micro_steps=1)
    report = volume_report(compiled.as_text(), cfg)
    assert report["layer_param_gathers"] == pytest.approx(2.0, rel=0.01), report


def test_prefetch_moves_what_zero3_moves():
    cfg = model_config("small", remat="full", n_layers=4)  # deep enough for real loops
    reports = {}
    for strategy in ("zero3", "zero3_prefetch"):
        compiled, _ = compile_step(cfg, strategy, N, seq_len=cfg.max_len, micro_steps=1)
        reports[strategy] = volume_report(compiled.as_text(), cfg)
    assert reports["zero3_prefetch"]["volume_psi"] == pytest.approx(
        reports["zero3"]["volume_psi"], rel=1e-6)
    assert reports["zero3_prefetch"]["all_gathers_in_layer_loop"]


def test_zero3_gathers_move_bf16_when_compute_is_bf16():
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], param_dtype="float32",
                              compute_dtype="bfloat16", remat="full")
    lowered, _ = sharded_run.lower_step(cfg, "zero3", N, tx=make_optimizer(TrainConfig()),
                                        seq_len=16, micro_steps=1)
    lowered_text = lowered.as_text(dialect="hlo")
    param_gathers = [c for c in hlo.collectives(lowered_text) if c.kind == "all-gather"]
    # The program JAX hands to XLA: every parameter all-gather is bf16 (cast before the wire).
    assert param_gathers and all(c.dtypes == ("bf16",) for c in param_gathers)
    # XLA:CPU has no bf16 collectives and widens them to f32 (a GPU backend keeps bf16), so in
    # the CPU-compiled program check that what enters each gather was rounded through bf16.
    text = lowered.compile().as_text()
    compiled_gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather" and c.loops]
    assert compiled_gathers
    for gather in compiled_gathers:
        assert gather.dtypes == ("bf16",) or "bf16" in hlo.producer_dtypes(text, gather), gather


@pytest.mark.parametrize("stage", ["dp", "zero1", "zero2", "zero3"])
def test_model_state_bytes_match_zero_formulas_exactly(stage):
    psi = param_count(TINY_MIXED)
    strategy = get_strategy(stage)
    compiled, args = compile_step(TINY_MIXED, stage, N, seq_len=16, micro_steps=2)
    parts = model_state(compiled, args, micro_steps=2)
    assert parts["params"] == 2 * psi // (N if strategy.shards_params else 1)
    assert parts["grads"] == 2 * psi // (N if strategy.shards_grads else 1)
    assert parts["optimizer"] == 12 * psi // (N if strategy.shards_optimizer else 1) + \
        OPT_COUNTERS_BYTES


# Layer weights dominate this shape (the gradient of the stacked layers is most of the model's),
# so what ZeRO-2 saves over ZeRO-1 stands clear of the activations and the embedding.
LAYERED = dataclasses.replace(MODEL_PRESETS["tiny"], d_model=64, d_ff=256, n_heads=2, n_layers=4,
                              param_dtype="float32", compute_dtype="float32", scan_unroll=1)


@functools.cache
def _layered_compiled(stage: str):
    return compile_step(LAYERED, stage, N, seq_len=16, micro_steps=2)


def _layer_loop_carry_shapes(text: str, n_layers: int) -> set[tuple[int, ...]]:
    """Shapes of every carry element a layer loop (any while loop of n_layers trips) updates."""
    module = hlo.parse_module(text)
    shapes = set()
    for computation in module.computations:
        for loop in hlo.while_loops(text, computation):
            if hlo.trip_count(loop) == n_layers:
                shapes |= {dims for e in hlo.loop_updated_carry(text, loop)
                           for _, dims in hlo.array_shapes(e.type_text)}
    return shapes


def test_zero2_backward_layer_scan_carries_gradient_shards_not_whole_gradients():
    # Each layer's gradient is reduce-scattered as the backward scan produces it, so the layer
    # loops build stacked gradient shards; the stacked whole gradient never exists.
    _, axes, abstract_params = abstract_model(LAYERED)
    stacked = {tuple(x.shape) for x in jax.tree.leaves(abstract_params["blocks"])}
    dims = {tuple(x.shape): sharded_dim(a) for x, a in zip(
        jax.tree.leaves(abstract_params["blocks"]),
        jax.tree.leaves(axes["blocks"], is_leaf=lambda x: isinstance(x, P)), strict=True)}
    shards = {tuple(s // N if i == d else s for i, s in enumerate(shape))
              for shape, d in dims.items() if d is not None}
    compiled, _ = _layered_compiled("zero2")
    carried = _layer_loop_carry_shapes(compiled.as_text(), LAYERED.n_layers)
    assert not carried & stacked, sorted(carried & stacked)
    assert shards <= carried, sorted(shards - carried)


def test_zero2_peak_is_below_zero1_by_more_than_the_whole_gradient():
    # zero1 holds a whole accumulator and a whole micro-step gradient; zero2 neither (only their
    # shards and one layer's whole gradient at a time).
    grads = 4 * param_count(LAYERED)
    peaks = {s: hlo.memory_peak(_layered_compiled(s)[0]).peak for s in ("zero1", "zero2")}
    assert peaks["zero1"] - peaks["zero2"] >= grads, (peaks, grads)


RELEASE_SETUP = ReleaseSetup(d_model=64, n_heads=2, d_ff=256, depths=(4, 6), devices=(4, 8),
                             seq_len=16, seqs_per_device=1)


@functools.cache
def _release_row(strategy: str) -> dict:
    setup = RELEASE_SETUP
    peaks = {(layers, n): measure_depth(setup, strategy, layers, n)["peak"]
             for layers in setup.depths for n in setup.devices}
    return release_report(setup, strategy, peaks)


@pytest.mark.parametrize("strategy", ["zero3", "zero3_prefetch"])
def test_zero3_peak_grows_with_depth_by_activations_and_shards_only(strategy):
    report = _release_row(strategy)
    assert report["released"], report
    assert report["kept_gathered_layers"] < 0.25, report


def test_the_release_check_catches_a_step_that_keeps_every_gathered_layer():
    # The control is zero3 whose backward pass saves each gathered layer instead of gathering
    # it again: about one gathered layer (or more, in f32 copies) per layer of depth.
    report = _release_row(KEEP_GATHERED)
    assert not report["released"], report
    assert report["kept_gathered_layers"] >= 0.9, report


def test_the_tiny_preset_as_shipped_releases_and_an_unrolled_one_is_caught(monkeypatch):
    # As zero_release's `shipped` section reads a preset: its own depth, unroll and batch on 8
    # devices. tiny's layer loop gathers each layer again in the backward pass; with the loop
    # unrolled (as `small` ships) XLA merges that re-gather with the forward gather and keeps
    # the weights, which the row must say, beside the releasing scan_unroll=1 alternative.
    tiny = PRESETS["tiny"]
    assert tiny.model.scan_unroll == 1
    row = shipped_release("tiny", N)
    assert row["released"] and row["peak_bytes"] < row["control_peak_bytes"], row
    assert row["layer_param_gathers"] == pytest.approx(2.0, abs=0.05), row
    assert row["control_layer_param_gathers"] == pytest.approx(1.0, abs=0.05), row
    assert row["volume_psi"] == pytest.approx(row["expected_volume_psi"], rel=0.05), row
    assert "unroll1_peak_bytes" not in row
    unrolled = dataclasses.replace(tiny.model, scan_unroll=tiny.model.n_layers)
    monkeypatch.setitem(PRESETS, "tiny_unrolled", dataclasses.replace(tiny, model=unrolled))
    row = shipped_release("tiny_unrolled", N)
    assert not row["released"], row
    assert row["layer_param_gathers"] == pytest.approx(1.0, abs=0.05), row
    assert row["unroll1_layer_param_gathers"] == pytest.approx(2.0, abs=0.05), row


def test_the_release_fit_has_no_negative_part():
    # Growth that falls faster than 1/N alone: a free fit would give a negative unsharded part.
    u, s = fit_growth({4: 360_000, 8: 130_000})
    assert u == 0 and s > 0
    u, s = fit_growth({8: 5_000 + 800_000 / 8, 32: 5_000 + 800_000 / 32})
    assert (u, s) == (pytest.approx(5_000), pytest.approx(800_000))
    u, s = fit_growth({8: 1_000, 32: 2_000})  # growing with N: no sharded part
    assert s == 0 and u == pytest.approx(1_500)


# Backslash-newline joins the long HLO lines (the string is not raw).
SYNTHETIC_HLO = """HloModule synthetic, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner_cond (pc: (s32[], f32[4,32])) -> pred[] {
  %pc = (s32[], f32[4,32]{1,0}) parameter(0)
  %ic = s32[] get-tuple-element(%pc), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%ic, %three), direction=LT
}

%inner_body (p: (s32[], f32[4,32])) -> (s32[], f32[4,32]) {
  %p = (s32[], f32[4,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[4,32]{1,0} get-tuple-element(%p), index=1
  %ags = (f32[4,32]{1,0}, f32[32,32]{1,0}) all-gather-start(%w), replica_groups=[1,8]<=[8], \
dimensions={0}
  %agd = f32[32,32]{1,0} all-gather-done(%ags)
  %rs = f32[4,32]{1,0} reduce-scatter(%agd), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, \
to_apply=%add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,32]{1,0}) tuple(%next, %w)
}

%outer_body (q: (s32[], f32[4,32])) -> (s32[], f32[4,32]) {
  %q = (s32[], f32[4,32]{1,0}) parameter(0)
  %inner = (s32[], f32[4,32]{1,0}) while(%q), condition=%inner_cond, body=%inner_body, \
backend_config={"known_trip_count":{"n":"3"}}
  %v = f32[16]{0} constant({...})
  %trivial = f32[16]{0} all-reduce(%v), replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, \
to_apply=%add
  %pairs = f32[16]{0} all-reduce(%trivial), replica_groups=[4,2]<=[8], to_apply=%add
  ROOT %r = (s32[], f32[4,32]{1,0}) tuple(%inner)
}

ENTRY %main (a: f32[4,32], b: f32[10]) -> f32[10] {
  %a = f32[4,32]{1,0} parameter(0)
  %b = f32[10]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,32]{1,0}) tuple(%zero, %a)
  %outer = (s32[], f32[4,32]{1,0}) while(%init), condition=%inner_cond, body=%outer_body, \
backend_config={"known_trip_count":{"n":"2"}}
  ROOT %everyone = f32[10]{0} all-reduce(%b), replica_groups={}, to_apply=%add
}
"""


def test_hlo_reader_on_async_iota_groups_and_nested_loops():
    found = {c.name: c for c in hlo.collectives(SYNTHETIC_HLO)}
    assert set(found) == {"ags", "rs", "pairs", "everyone"}  # the size-1 groups are left out
    gather, scatter = found["ags"], found["rs"]
    assert (gather.kind, gather.asynchronous, gather.group_size) == ("all-gather", True, 8)
    assert (gather.operand_elements, gather.result_elements) == (128, 1024)
    assert [trips for _, trips in gather.loops] == [2, 3] and gather.executions == 6
    assert (scatter.operand_elements, scatter.result_elements, scatter.executions) == (1024, 128, 6)
    assert (found["pairs"].group_size, found["pairs"].executions) == (2, 2)
    assert (found["everyone"].group_size, found["everyone"].in_loop) == (8, False)
    assert hlo.volume_per_step(list(found.values())) == 6 * 1024 + 6 * 1024 + 2 * 2 * 16 + 2 * 10
    outer = hlo.while_loops(SYNTHETIC_HLO)[0]
    assert hlo.trip_count(outer) == 2
    inner = hlo.while_loops(SYNTHETIC_HLO, "outer_body")[0]
    assert [e.index for e in hlo.loop_updated_carry(SYNTHETIC_HLO, inner)] == [0]
