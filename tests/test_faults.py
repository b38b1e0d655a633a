"""Faults injected into training: non-finite values, preemption, kills, damaged checkpoints and
a disk that fills up mid-save lose nothing."""

import dataclasses
import json
import resource
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.cli.config import ConfigError
from experiments.training import checkpoint as ckpt
from experiments.training import faults, integrity, trainer
from experiments.training.config import load_config
from experiments.training.guards import NonFiniteError
from experiments.training.optim import make_optimizer
from experiments.training.restore import restore_params
from experiments.training.trainer import init_sharded_state, prepare, train_and_evaluate
from parallel.sharded_run import build
from parallel.strategies import get_strategy
from tests.helpers import ROOT, TINY, child_env, max_tree_diff


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


def infinite_lr(train):
    """The run's optimizer with lr=inf, past the config's validation: the loss and the
    gradient norm stay finite, the updated parameters do not (the warm-up's 0 * inf is NaN)."""
    return make_optimizer(dataclasses.replace(train, lr=float("inf")))


# dp (the default strategy) is covered by the run-level test below.
@pytest.mark.parametrize("strategy", ["zero1", "zero3", "zero3_auto"])
def test_a_step_whose_update_is_not_finite_leaves_the_state_untouched(tmp_path, strategy):
    run = prepare(tiny(tmp_path, strategy=strategy))
    sharded = build(run.cfg.model, get_strategy(strategy), run.mesh, infinite_lr(run.cfg.train),
                    run.sharded.step_cfg)
    state = sharded.init(run.cfg.train.seed)
    before = jax.device_get(state)
    after, metrics = sharded.step(state, trainer.global_batch(run, run.sampler.next_batch))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert not bool(metrics["params_finite"]) and not bool(metrics["finite"])
    assert int(after["step"]) == 1
    assert max_tree_diff(jax.device_get(after["params"]), before["params"]) == 0.0
    assert max_tree_diff(jax.device_get(after["opt"]), before["opt"]) == 0.0


def test_a_nonfinite_update_stops_or_is_skipped_like_a_nonfinite_loss(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "make_optimizer", infinite_lr)
    with pytest.raises(NonFiniteError, match="step 1: the update made the parameters "
                                             "non-finite"):
        train_and_evaluate(tiny(tmp_path), tmp_path / "stop", progress=False)
    assert ckpt.manager(tmp_path / "stop", read_only=True).all_steps() == []
    cfg = tiny(tmp_path, on_nonfinite="skip")
    assert train_and_evaluate(cfg, tmp_path / "skip", progress=False)["skipped_steps"] == 4
    saved = restore_params(tmp_path / "skip", cfg).params
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(saved))


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


def _train_cli(workdir, data, *extra):
    return [sys.executable, "-m", "experiments.train", "--workdir", str(workdir), "--preset",
            "tiny", "--data", data, "--no-progress", *extra]


ENV = child_env()


def _logged_steps(metrics):
    return [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"loss"' in x]


def _sigterm_after(proc, metrics, rows):
    """SIGTERM once `rows` training rows are logged; the run's JSON summary."""
    deadline = time.time() + 120
    while not (metrics.exists() and len(_logged_steps(metrics)) >= rows):
        assert time.time() < deadline and proc.poll() is None, "training never got there"
        time.sleep(0.05)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert time.time() - sent < 30
    return json.loads(out.strip().splitlines()[-1])


def test_sigterm_checkpoints_and_exits_cleanly_then_resumes(tmp_path):
    cfg = tiny(tmp_path)
    workdir = tmp_path / "run"
    # --steps must stay the same on resume, so the resumed run is stopped the same way.
    args = _train_cli(workdir, cfg.train.data, "--steps", "100000", "--ckpt-every", "100000",
                      "--eval-every", "100000")
    metrics = workdir / "metrics.jsonl"
    summary = _sigterm_after(subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True), metrics, 3)
    assert summary["preempted"] and summary["step"] >= 3
    stopped = summary["step"]
    assert ckpt.manager(workdir, read_only=True).all_steps() == [stopped]
    resumed = _sigterm_after(subprocess.Popen([*args, "--resume"], cwd=ROOT, env=ENV,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True), metrics, stopped + 2)
    assert resumed["preempted"] and resumed["step"] >= stopped + 2
    # nothing trained twice, nothing skipped
    assert _logged_steps(metrics) == list(range(1, resumed["step"] + 1))


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


@pytest.mark.parametrize("damage", ["unsealed", "flip"])
def test_with_no_intact_checkpoint_resume_starts_over_and_evaluate_refuses(tmp_path, capfd,
                                                                         six_steps, damage):
    """The run was killed at step 4, after its first checkpoint (3) was written but before it
    was sealed (or that checkpoint was altered since). `evaluate` and `sample` have nothing to
    read and say so; `--resume` moves the damaged step aside, says so in one line and trains
    from step 0: the same run as the uninterrupted one."""
    cfg, ref = six_steps
    workdir = tmp_path / "run"
    shutil.copytree(ref, workdir)
    shutil.rmtree(workdir / "checkpoints" / "6")
    _unseal(workdir, 6)
    metrics = workdir / "metrics.jsonl"
    metrics.write_text("".join(x + "\n" for x in metrics.read_text().splitlines()
                               if json.loads(x)["step"] <= 4))
    (workdir / "checkpoints" / "6.orbax-checkpoint-tmp").mkdir()  # the write the kill cut short
    if damage == "unsealed":
        _unseal(workdir, 3)
    else:
        _flip(max(_files(workdir, 3), key=lambda p: p.stat().st_size))
    with pytest.raises(ConfigError, match=r"none is intact \(3: "):
        restore_params(workdir, cfg)  # what evaluate and sample load through
    capfd.readouterr()
    summary = train_and_evaluate(cfg, workdir, resume=True, progress=False)
    warnings = [x for x in capfd.readouterr().err.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and "none is intact (3: " in warnings[0] \
        and "training again from step 0" in warnings[0], warnings
    assert summary["step"] == 6
    assert [p.name.split("-")[0] for p in (workdir / "checkpoints.damaged").iterdir()] == ["3"]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6"]
    assert _losses(workdir) == _losses(ref)
    assert max_tree_diff(restore_params(workdir, cfg).params,
                         restore_params(ref, cfg).params) == 0.0


SIGKILL_SEED = 20240611  # the kill point is drawn, but the same on every run of the suite


def test_sigkill_at_a_random_point_then_resume_is_bit_identical(tmp_path):
    cfg = tiny(tmp_path, steps=12, ckpt_every=2, eval_every=100)
    train_and_evaluate(cfg, tmp_path / "ref", progress=False)
    workdir = tmp_path / "run"
    args = _train_cli(workdir, cfg.train.data, "--steps", "12", "--ckpt-every", "2",
                      "--eval-every", "100")
    proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = workdir / "metrics.jsonl"
    kill_after = int(np.random.default_rng(SIGKILL_SEED).integers(3, 9))
    print(f"SIGKILL once {kill_after} steps are logged (seed {SIGKILL_SEED})")
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after):
        assert time.time() < deadline and proc.poll() is None, "training never got there"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    resumed = subprocess.run([*args, "--resume"], cwd=ROOT, env=ENV, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _losses(workdir) == _losses(tmp_path / "ref")
    a = restore_params(workdir, cfg).params
    b = restore_params(tmp_path / "ref", cfg).params
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_disk_filling_up_during_a_save_stops_cleanly_and_resume_continues(tmp_path, capfd):
    """Once checkpoint 2 is sealed, the run's files may no longer grow past 64 kB (a
    checkpoint's largest file is bigger, metrics.jsonl is smaller): the next save fails inside
    Orbax's background write. The run stops with one line and status 1, checkpoint 2 stays
    sealed and intact, and --resume continues from it. (Python ignores SIGXFSZ, so past the
    limit a write fails with EFBIG, as one on a full disk fails with ENOSPC.)"""
    cfg = tiny(tmp_path)
    workdir = tmp_path / "run"
    args = _train_cli(workdir, cfg.train.data, "--steps", "8", "--ckpt-every", "2",
                      "--eval-every", "100")
    proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (workdir / integrity.MANIFESTS / "2.json").exists():
        assert time.time() < deadline and proc.poll() is None, "checkpoint 2 was never sealed"
        time.sleep(0.005)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    assert "could not be written (File too large, errno 27)" in err
    sealed = sorted(int(p.stem) for p in (workdir / integrity.MANIFESTS).glob("*.json"))
    assert sealed and sealed == ckpt.manager(workdir, read_only=True).all_steps(), sealed
    assert all(integrity.problem(workdir, s) is None for s in sealed)
    assert f"checkpoint {sealed[-1]} is intact" in err
    capfd.readouterr()
    summary = train_and_evaluate(load_config(workdir), workdir, resume=True, progress=False)
    assert "warning" not in capfd.readouterr().err
    assert summary["resumed_from"] == sealed[-1] and summary["step"] == 8
    assert _logged_steps(workdir / "metrics.jsonl") == list(range(1, 9))


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


def test_fault_rows_keep_refusals_apart_from_recoveries(tmp_path):
    """A fault the run must refuse is labelled `refused`, not `recovered`; its lost steps are
    counted (the completed steps no checkpoint keeps), and a mocked fault says so."""
    cfg = faults.configs(tiny(tmp_path).train.data)[0]
    nonfinite = faults.nonfinite(tmp_path, cfg)
    assert nonfinite["outcome"] == "refused" and nonfinite["recovered"] is None
    assert nonfinite["message"].startswith("step 1:") and nonfinite["lost_steps"] == 0
    assert nonfinite["mocked"] is False
    small = faults.disk_too_small(tmp_path, cfg)
    assert small["outcome"] == "refused" and small["lost_steps"] == 0
    assert small["mocked"] is True and "mocked" in small["injected"]
    failed = dict(nonfinite, outcome="not refused")
    summary = faults.summarise([nonfinite, small], seed=0)
    assert summary["outcomes"]["refused"] == 2 and summary["all_recovered_nothing_lost"]
    assert not faults.summarise([nonfinite, failed], seed=0)["all_recovered_nothing_lost"]


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


def test_orphaned_write_errors_are_not_logged_during_a_save():
    """A full disk fails every write of a save; the caller's wait raises one of them (reported in
    one line) and asyncio reports the others as "exception was never retrieved", some with no
    Python traceback at all (raised inside TensorStore). Those reports are dropped while the
    save's filters are installed; an unrelated asyncio error still gets through."""
    import logging

    write_error = ValueError("OUT_OF_RANGE: Error writing \"params.x/0.2.0\" in OCDBT database: "
                             "Failed to write 94320 bytes to file 4: File too large "
                             "[os_error_code='27']")
    other = RuntimeError("something else went wrong")

    def record(exc) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1,
                                 "Future exception was never retrieved", None,
                                 (type(exc), exc, None))

    asyncio_log = logging.getLogger("asyncio")
    # A failed save earlier in this worker leaves its filters installed (as below); a save that
    # ends cleanly removes them, so the test starts from none whatever ran before it.
    with ckpt.save_errors_raised_not_logged():
        pass
    assert asyncio_log.filter(record(write_error))  # nothing installed: it would be logged
    with pytest.raises(OSError), ckpt.save_errors_raised_not_logged():
        assert not asyncio_log.filter(record(write_error))
        assert asyncio_log.filter(record(other))
        raise OSError("the save failed")  # the run stops: the filters stay for late writes
    assert not asyncio_log.filter(record(write_error))
    with ckpt.save_errors_raised_not_logged():  # a later save: installed once, removed after
        pass
    assert asyncio_log.filter(record(write_error))
