"""Faults injected into training: non-finite values and preemption lose nothing."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import checkpoint as ckpt
from experiments import trainer
from experiments.guards import NonFiniteError
from experiments.restore import restore_params
from experiments.trainer import init_sharded_state, prepare, train_and_evaluate
from tests.helpers import TINY, max_tree_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(tmp_path, **train):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(open(json.__file__).read() * 4)
    base = dict(steps=4, ckpt_every=2, eval_every=2, log_every=1, data=str(corpus), devices=8)
    return dataclasses.replace(TINY, train=dataclasses.replace(TINY.train, **(base | train)))


def poisoned(run):
    """A state whose embedding overflows the forward pass to inf/NaN on every step."""
    state = init_sharded_state(run)
    table = state["params"]["embed"]["embedding"]
    state["params"]["embed"]["embedding"] = table.at[:, 0].set(jnp.inf)  # every token
    return state


@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_a_nonfinite_step_leaves_the_state_untouched(tmp_path, strategy):
    run = prepare(tiny(tmp_path, strategy=strategy))
    state = poisoned(run)
    before = jax.device_get(state)
    batch = trainer.global_batch(run, run.sampler.next_batch)
    after, metrics = run.step_fn(state, batch)
    assert not bool(metrics["finite"])
    assert int(after["step"]) == 1  # the data position still advances
    assert max_tree_diff(jax.device_get(after["opt"]), before["opt"]) == 0.0
    a, b = jax.device_get(after["params"]), before["params"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_nonfinite_stops_the_run_naming_the_step_and_saves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "init_sharded_state", poisoned)
    with pytest.raises(NonFiniteError, match="step 1: loss .* is not finite"):
        train_and_evaluate(tiny(tmp_path), tmp_path / "run", progress=False)
    assert ckpt.manager(tmp_path / "run", read_only=True).all_steps() == []


def test_nonfinite_steps_can_be_skipped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "init_sharded_state", poisoned)
    summary = train_and_evaluate(tiny(tmp_path, on_nonfinite="skip"), tmp_path / "run",
                                 progress=False)
    assert summary["skipped_steps"] == 4
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [0, 1, 2, 3]  # one step behind
    mngr = ckpt.manager(tmp_path / "run", read_only=True)
    assert mngr.all_steps() == [2, 4]


def test_sigterm_checkpoints_and_exits_cleanly_then_resumes(tmp_path):
    cfg = tiny(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    workdir = tmp_path / "run"
    args = [sys.executable, "-m", "experiments.train", "--workdir", str(workdir), "--preset",
            "tiny", "--data", cfg.train.data, "--ckpt-every", "100000", "--eval-every", "100000",
            "--no-progress"]
    proc = subprocess.Popen([*args, "--steps", "100000"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.time() < deadline and proc.poll() is None, "training never started"
        time.sleep(0.2)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert time.time() - sent < 30
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["preempted"] and summary["step"] >= 3
    stopped = summary["step"]
    assert ckpt.manager(workdir, read_only=True).all_steps() == [stopped]
    resumed = subprocess.run([*args, "--steps", str(stopped + 2), "--resume"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, stopped + 3))  # nothing trained twice, nothing skipped


def _losses(workdir):
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _files(workdir, step):
    return sorted(p for p in (workdir / "checkpoints" / str(step)).rglob("*") if p.is_file()
                  and p.stat().st_size > 0)


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _unseal(workdir, step):
    (workdir / "checkpoints.sha256" / f"{step}.json").unlink()


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A finished 6-step run with checkpoints 3 and 6: the reference, and the run to damage."""
    tmp = tmp_path_factory.mktemp("six_steps")
    cfg = tiny(tmp, steps=6, ckpt_every=3, keep_ckpts=3)
    train_and_evaluate(cfg, tmp / "ref", progress=False)
    return cfg, tmp / "ref"


@pytest.mark.parametrize("damage", ["truncate", "flip", "unsealed"])
def test_a_damaged_checkpoint_is_skipped_with_a_warning(tmp_path, capfd, six_steps, damage):
    """The newest checkpoint is truncated, altered or was never sealed: resume falls back to
    the one before and trains the rest again with the same batches."""
    cfg, ref = six_steps
    workdir = tmp_path / "run"
    shutil.copytree(ref, workdir)  # training is deterministic: the same run, step for step
    if damage == "unsealed":
        _unseal(workdir, 6)
    else:
        biggest = max(_files(workdir, 6), key=lambda p: p.stat().st_size)
        (_truncate if damage == "truncate" else _flip)(biggest)
    capfd.readouterr()
    train_and_evaluate(cfg, workdir, resume=True, progress=False)
    err = capfd.readouterr().err
    assert "skipping checkpoint 6" in err
    # Resumed from step 3: steps 4..6 replayed with the same batches, same losses.
    assert _losses(workdir) == _losses(ref)
    a = restore_params(workdir, cfg).params
    b = restore_params(ref, cfg).params
    assert max_tree_diff(a, b) == 0.0


def test_no_intact_checkpoint_stops_with_an_error(tmp_path):
    cfg = tiny(tmp_path, steps=3, ckpt_every=3)
    workdir = tmp_path / "run"
    train_and_evaluate(cfg, workdir, progress=False)
    _flip(max(_files(workdir, 3), key=lambda p: p.stat().st_size))
    with pytest.raises(trainer.ConfigError, match="none is intact .*3: .* changed"):
        train_and_evaluate(cfg, workdir, resume=True, progress=False)


def test_sigkill_at_a_random_point_then_resume_is_bit_identical(tmp_path):
    cfg = tiny(tmp_path, steps=12, ckpt_every=2, eval_every=100)
    train_and_evaluate(cfg, tmp_path / "ref", progress=False)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    workdir = tmp_path / "run"
    args = [sys.executable, "-m", "experiments.train", "--workdir", str(workdir), "--preset",
            "tiny", "--data", cfg.train.data, "--steps", "12", "--ckpt-every", "2",
            "--eval-every", "100", "--no-progress"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = workdir / "metrics.jsonl"
    kill_after = np.random.default_rng().integers(3, 9)  # a random step count
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after):
        assert time.time() < deadline and proc.poll() is None, "training never got there"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    resumed = subprocess.run([*args, "--resume"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _losses(workdir) == _losses(tmp_path / "ref")
    a = restore_params(workdir, cfg).params
    b = restore_params(tmp_path / "ref", cfg).params
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_unwritable_workdir_or_full_disk_is_refused_before_training(tmp_path, monkeypatch):
    cfg = tiny(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(trainer.ConfigError, match="is not a writable folder"):
        train_and_evaluate(cfg, blocker / "run", progress=False)

    class Usage:
        free = 1000

    monkeypatch.setattr(trainer.shutil, "disk_usage", lambda _: Usage)
    with pytest.raises(trainer.ConfigError, match=r"GB free, checkpoints need about"):
        train_and_evaluate(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_same_seed_and_config_give_identical_losses(tmp_path):
    # zero3 (collectives in the layer loop); dp runs are compared bit for bit by the resume
    # tests above.
    cfg = tiny(tmp_path, strategy="zero3")
    train_and_evaluate(cfg, tmp_path / "a", progress=False)
    train_and_evaluate(cfg, tmp_path / "b", progress=False)
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=1))
    train_and_evaluate(other, tmp_path / "c", progress=False)
    assert _losses(tmp_path / "c") != _losses(tmp_path / "a")  # the check can fail
