"""Orbax checkpoints: round trip, exact resume, restore onto other device counts and strategies."""

import dataclasses
import json

import pytest

from experiments.cli.config import ConfigError
from experiments.training import checkpoint as ckpt
from experiments.training.config import Config, load_config
from experiments.training.guards import Preemption
from experiments.training.restore import restore_params
from experiments.training.trainer import train_and_evaluate
from parallel.state import logical_shardings
from tests.helpers import TINY, max_tree_diff


def tiny(tmp_path, **train):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():  # a small real-text corpus keeps these runs quick
        corpus.write_text(open(json.__file__).read() * 4)
    base = dict(steps=6, ckpt_every=3, eval_every=3, log_every=1, data=str(corpus), devices=8)
    return dataclasses.replace(TINY, train=dataclasses.replace(TINY.train, **(base | train)))


def losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def stop_after(monkeypatch, n):
    """Preempt the next run after n steps, as a SIGTERM would (it checkpoints that step)."""
    calls = iter(range(1, 1 << 30))
    monkeypatch.setattr(Preemption, "requested", lambda self: next(calls) >= n)


def test_resume_continues_exactly(tmp_path, monkeypatch):
    # 6 steps with warm-up 2, stopped after 4: the resumed steps are on the cosine's decay.
    cfg = tiny(tmp_path)
    full = train_and_evaluate(cfg, tmp_path / "full", progress=False)
    stop_after(monkeypatch, 4)
    assert train_and_evaluate(cfg, tmp_path / "split", progress=False)["preempted"]
    monkeypatch.undo()
    resumed = train_and_evaluate(cfg, tmp_path / "split", resume=True, progress=False)
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    assert resumed["val_loss"] == full["val_loss"]
    mngr = ckpt.manager(tmp_path / "split", read_only=True)
    assert ckpt.read_meta(mngr, 6)["data_position"] == 6 * cfg.train.batch_size
    a = restore_params(tmp_path / "full", cfg).params
    b = restore_params(tmp_path / "split", cfg).params
    assert max_tree_diff(a, b) == 0.0


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """A 3-step zero3 run on 8 devices and its parameters restored as written."""
    tmp = tmp_path_factory.mktemp("zero3_run")
    cfg = tiny(tmp, steps=3, strategy="zero3")
    train_and_evaluate(cfg, tmp / "run", progress=False)
    return cfg, tmp / "run", restore_params(tmp / "run", cfg).params


@pytest.mark.parametrize("strategy,devices", [("zero3", 4), ("zero1", 2), ("dp", 1),
                                              ("zero3_auto", 8)])
def test_checkpoint_restores_on_other_meshes(zero3_run, strategy, devices):
    cfg, workdir, ref = zero3_run
    model = restore_params(workdir, cfg, strategy=strategy, devices=devices)
    params, step = model.params, model.step
    assert step == 3
    assert max_tree_diff(params, ref) == 0.0
    leaf = params["blocks"]["mlp"]["up"]["kernel"]
    assert len(leaf.sharding.device_set) == devices
    expected = logical_shardings(model.axes, model.mesh, model.strategy.shards_params)
    assert leaf.sharding == expected["blocks"]["mlp"]["up"]["kernel"]


def test_keeps_only_the_last_n(tmp_path):
    cfg = tiny(tmp_path, steps=9, ckpt_every=3, keep_ckpts=2)
    train_and_evaluate(cfg, tmp_path / "run", progress=False)
    assert ckpt.manager(tmp_path / "run", read_only=True).all_steps() == [6, 9]


def test_resume_refuses_an_incompatible_model(tmp_path):
    cfg = tiny(tmp_path, steps=3)
    train_and_evaluate(cfg, tmp_path / "run", progress=False)
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=64))
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(ConfigError, match=r"^resume: d_model=64 differs from the run's 32; "):
        train_and_evaluate(wider, tmp_path / "run", resume=True, progress=False)
    with pytest.raises(ConfigError, match="already holds a run"):
        train_and_evaluate(cfg, tmp_path / "run", progress=False)
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_resume_refuses_another_schedule_length(tmp_path):
    """`steps` is the cosine schedule's length: resuming with another would change every
    learning rate still to come, so it is refused (one line, nothing written)."""
    cfg = tiny(tmp_path, steps=3)
    train_and_evaluate(cfg, tmp_path / "run", progress=False)
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=6))
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    with pytest.raises(ConfigError, match=r"^resume: steps=6 differs from the run's 3 \(the "
                                          r"learning-rate schedule's length; .* --init "):
        train_and_evaluate(longer, tmp_path / "run", resume=True, progress=False)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before


def test_config_json_round_trips(tmp_path):
    cfg = tiny(tmp_path)
    assert Config.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_resume_under_another_strategy_and_device_count(tmp_path, monkeypatch):
    """Written by zero3 on 8 devices, continued by zero2 on 4 with another remat policy: same
    losses as one dp run."""
    cfg = tiny(tmp_path)
    train_and_evaluate(cfg, tmp_path / "ref", progress=False)
    first = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, strategy="zero3"))
    stop_after(monkeypatch, 3)
    train_and_evaluate(first, tmp_path / "mixed", progress=False)
    monkeypatch.undo()
    rest = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, strategy="zero2",
                                                              devices=4),
                               model=dataclasses.replace(cfg.model, remat="full"))
    assert cfg.model.remat != "full"
    train_and_evaluate(rest, tmp_path / "mixed", resume=True, progress=False)
    assert load_config(tmp_path / "mixed").model.remat == "full"  # the config it continued with
    ref, mixed = losses(tmp_path / "ref"), losses(tmp_path / "mixed")
    assert ref.keys() == mixed.keys()
    assert max(abs(ref[k] - mixed[k]) for k in ref) <= 1e-5
