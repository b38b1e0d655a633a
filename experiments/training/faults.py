"""Fault scenarios for a short training run: inject one fault, handle it the way a user would,
and compare with an uninterrupted reference run of the same config and seed.

Each scenario trains the `tiny` preset on 8 fake CPU devices (real text: the json module's
source). A row's `outcome` says which of two kinds of handling it measured:
  recovered / not recovered   the fault hit a run with something to resume: the resumed run
                              reached the last step and its final parameters equal the
                              reference's bit for bit;
  refused / not refused       the fault is one the run must refuse (a non-finite step, a disk
                              too small): it stopped as described, before saving anything.
  recovered        True or False for a recovery row, None for a refusal (nothing to recover);
  lost_steps       recovery rows: steps whose logged loss differs from the reference, or all
                   of them if the final parameters differ; refusal rows: steps the run had
                   trained that no checkpoint keeps (0 = nothing lost);
  retrained_steps  steps trained twice: the interrupted run had trained them, but they came
                   after the checkpoint the resumed run started from;
  recovery_s       wall time of the recovery (the resumed run, or from the signal to a clean
                   exit, or of the refused run);
  mocked           True where the fault is simulated inside the process instead of produced
                   (the free space the pre-flight check reads).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments.training import checkpoint as ckpt
from experiments.training import integrity, trainer
from experiments.training.config import PRESETS
from experiments.training.guards import NonFiniteError
from experiments.training.integrity import MANIFESTS
from experiments.training.restore import restore_params
from experiments.training.trainer import train_and_evaluate
from parallel.sharded_run import max_tree_diff

STEPS, CKPT_EVERY = 12, 3
# Once the disk "fills up", no file may grow past this: above metrics.jsonl and a manifest,
# below the largest file of a `tiny` checkpoint.
FILE_LIMIT = 1 << 16
SCENARIOS = ("crash_and_resume", "killed_in_first_save", "preemption", "interrupted_checkpoint",
             "truncated_checkpoint", "altered_checkpoint", "disk_full_during_save", "resharding",
             "nonfinite", "nonfinite_update", "disk_too_small")
# The outcomes a row may have: what a recovery row or a refusal row reports when it went as
# intended, and when it did not.
RECOVERED, NOT_RECOVERED, REFUSED, NOT_REFUSED = ("recovered", "not recovered", "refused",
                                                  "not refused")


def _losses(workdir: Path) -> dict[int, float]:
    """{step: loss} of the training rows (evaluation rows are not steps) logged so far; the run
    may still be writing the file, and a line cut mid-write is not read."""
    metrics, losses = workdir / "metrics.jsonl", {}
    for line in metrics.read_text().splitlines() if metrics.exists() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in row:
            losses[row["step"]] = row["loss"]
    return losses


def _last_trained(workdir: Path) -> int:
    """The last step the interrupted run logged (every step is logged: log_every is 1)."""
    return max(_losses(workdir), default=0)


def _lost(workdir: Path, ref: Path, cfg) -> int:
    """Steps whose logged loss differs from the reference, or all of them if the final
    parameters differ (bitwise) or cannot be read."""

    a, b = _losses(workdir), _losses(ref)
    lost = sum(1 for k in b if a.get(k) != b[k])
    try:
        pa = restore_params(workdir, cfg).params
    except ValueError:  # no intact checkpoint at all
        return len(b)
    pb = restore_params(ref, cfg).params
    return lost if max_tree_diff(pa, pb) == 0.0 else max(lost, len(b))


def _recovery(recovered: bool, lost: int, retrained: int | None) -> dict:
    """The shared fields of a recovery row."""
    return {"outcome": RECOVERED if recovered else NOT_RECOVERED, "recovered": recovered,
            "lost_steps": lost, "retrained_steps": retrained, "mocked": False}


def _outcome(workdir: Path, ref: Path, cfg, trained: int, summary: dict | None,
             clean: bool = True) -> dict:
    """What a resume recovered: `summary` is the resumed run's (None if it failed), `trained`
    the last step the interrupted run had trained, `clean` whether the fault itself was met
    as it should be (a clean exit, intact checkpoints)."""
    lost = _lost(workdir, ref, cfg)
    recovered = clean and summary is not None and summary["step"] == STEPS and lost == 0
    return _recovery(recovered, lost,
                     max(0, trained - summary["resumed_from"]) if summary else None)


def _saved_steps(workdir: Path) -> list[int]:
    return ckpt.manager(workdir, read_only=True).all_steps() if workdir.exists() else []


def _refusal(name: str, injected: str, workdir: Path, message: str, expected: bool,
             completed: int, seconds: float, mocked: bool = False) -> dict:
    """A refusal row: `expected` says whether the run stopped as described, having saved nothing;
    `completed` is the last step whose update the run kept. Its lost steps are the completed
    steps no checkpoint keeps (the refused step itself is not lost: it is the one refused)."""
    saved = _saved_steps(workdir)
    refused = expected and saved == []
    lost = max(0, completed - max(saved, default=0))
    return {"scenario": name, "injected": injected,
            "outcome": REFUSED if refused else NOT_REFUSED, "recovered": None,
            "lost_steps": lost, "retrained_steps": 0, "mocked": mocked, "recovery_s": seconds,
            "message": message}


def _cli(workdir: Path, data: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "experiments.train", "--workdir", str(workdir), "--preset",
            "tiny", "--data", data, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY),
            "--eval-every", "1000", "--no-progress", *extra]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _resume(workdir: Path, data: str) -> tuple[dict | None, float, str]:
    """`train --resume` as a user runs it: (its summary or None, seconds, stderr)."""
    t = time.perf_counter()
    done = subprocess.run([*_cli(workdir, data), "--resume"], env=_env(), capture_output=True,
                          text=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    return summary, time.perf_counter() - t, done.stderr


def _wait_for(proc, ready, what: str, poll_s: float = 0.05) -> None:
    deadline = time.time() + 180
    while not ready():
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the training process never reached {what}")
        time.sleep(poll_s)


def _wait_for_steps(proc, workdir: Path, n: int) -> None:
    _wait_for(proc, lambda: _last_trained(workdir) >= n, f"step {n}")


def crash_and_resume(root: Path, data: str, ref: Path, cfg, rng) -> dict:
    workdir = root / "crash"
    kill_at = int(rng.integers(2, STEPS - 1))
    proc = subprocess.Popen(_cli(workdir, data), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _wait_for_steps(proc, workdir, kill_at)
    proc.kill()
    proc.wait()
    trained = _last_trained(workdir)
    summary, seconds, _ = _resume(workdir, data)
    return {"scenario": "crash_and_resume", "injected": f"SIGKILL once step {kill_at} was logged",
            **_outcome(workdir, ref, cfg, trained, summary), "recovery_s": seconds}


def killed_in_first_save(root: Path, data: str, ref: Path, cfg) -> dict:
    """SIGKILL the moment the first checkpoint's folder appears: before its seal, as a rule."""
    workdir = root / "first-save"
    first = workdir / "checkpoints" / str(CKPT_EVERY)
    proc = subprocess.Popen(_cli(workdir, data), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _wait_for(proc, first.is_dir, f"checkpoint {CKPT_EVERY}", poll_s=0.001)
    proc.kill()
    proc.wait()
    sealed = (workdir / MANIFESTS / f"{CKPT_EVERY}.json").exists()
    trained = _last_trained(workdir)
    summary, seconds, err = _resume(workdir, data)
    warnings = [x for x in err.splitlines() if x.startswith("warning:")]
    return {"scenario": "killed_in_first_save",
            "injected": f"SIGKILL as checkpoint {CKPT_EVERY} appeared "
                        f"({'after' if sealed else 'before'} its seal)",
            **_outcome(workdir, ref, cfg, trained, summary), "recovery_s": seconds,
            "warnings": warnings}


def preemption(root: Path, data: str, ref: Path, cfg, rng) -> dict:
    workdir = root / "preempt"
    at = int(rng.integers(2, STEPS - 1))
    proc = subprocess.Popen(_cli(workdir, data), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    _wait_for_steps(proc, workdir, at)
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    exit_s = time.perf_counter() - t
    stopped = json.loads(out.strip().splitlines()[-1])["step"] if proc.returncode == 0 else 0
    trained = _last_trained(workdir)
    summary, _, _ = _resume(workdir, data)
    outcome = _outcome(workdir, ref, cfg, trained, summary, clean=proc.returncode == 0)
    return {"scenario": "preemption", "injected": f"SIGTERM once step {at} was logged", **outcome,
            "recovery_s": exit_s, "checkpointed_step": stopped}


def damaged_checkpoint(root: Path, data: str, ref: Path, cfg, how: str) -> dict:
    workdir = root / f"damaged-{how}"
    train_and_evaluate(cfg, workdir, progress=False)  # the newest checkpoint is the last step
    newest = workdir / "checkpoints" / str(STEPS)
    victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    if how == "truncated":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif how == "altered":
        data_ = bytearray(victim.read_bytes())
        data_[len(data_) // 2] ^= 0xFF
        victim.write_bytes(bytes(data_))
    else:  # interrupted: the process died before the checkpoint was sealed
        (workdir / MANIFESTS / f"{STEPS}.json").unlink()
    t = time.perf_counter()
    summary = train_and_evaluate(cfg, workdir, resume=True, progress=False)
    return {"scenario": f"{how}_checkpoint", "injected": f"{how} checkpoint {STEPS}",
            **_outcome(workdir, ref, cfg, STEPS, summary),
            "recovery_s": time.perf_counter() - t}


def disk_full_during_save(root: Path, data: str, ref: Path, cfg) -> dict:
    """Once the first checkpoint is sealed, no file of the run may grow past FILE_LIMIT (the
    process's RLIMIT_FSIZE, lowered from outside): a later save fails inside Orbax's
    background write with EFBIG, as one on a full disk fails with ENOSPC. (Python ignores
    SIGXFSZ, so the write fails instead of the process being killed.)"""
    workdir = root / "disk-full"
    proc = subprocess.Popen(_cli(workdir, data), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(proc, (workdir / MANIFESTS / f"{CKPT_EVERY}.json").exists,
              f"the seal of checkpoint {CKPT_EVERY}", poll_s=0.005)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (FILE_LIMIT, resource.RLIM_INFINITY))
    _, err = proc.communicate(timeout=180)
    message = err.strip()
    clean = proc.returncode == 1 and len(message.splitlines()) == 1 \
        and "could not be written" in message
    sealed = sorted(int(p.stem) for p in (workdir / MANIFESTS).glob("*.json"))
    intact = bool(sealed) and all(integrity.problem(workdir, s) is None for s in sealed)
    trained = _last_trained(workdir)
    summary, seconds, _ = _resume(workdir, data)
    outcome = _outcome(workdir, ref, cfg, trained, summary, clean=clean and intact)
    return {"scenario": "disk_full_during_save",
            "injected": f"files capped at {FILE_LIMIT // 1024} kB after checkpoint "
                        f"{CKPT_EVERY} (EFBIG mid-save)", **outcome, "recovery_s": seconds,
            "exit_status": proc.returncode, "message": message,
            "sealed_after_failure": sealed, "sealed_intact": intact}


def resharding(ref: Path, cfg) -> dict:
    t = time.perf_counter()
    base = restore_params(ref, cfg).params
    worst = 0.0
    for strategy, devices in (("zero3", 4), ("zero3", 2), ("dp", 1)):
        params = restore_params(ref, cfg, strategy=strategy, devices=devices).params
        worst = max(worst, max_tree_diff(params, base))
    return {"scenario": "resharding", "injected": "zero3@8 checkpoint read as zero3@4, "
            "zero3@2, dp@1", **_recovery(worst == 0.0, 0 if worst == 0.0 else STEPS, 0),
            "recovery_s": time.perf_counter() - t, "max_param_diff": worst}


def _stops_at_step_1(root: Path, cfg, name: str, injected: str, patch: tuple) -> dict:
    """A run with `patch` (module, attribute, replacement) applied must stop at step 1 with a
    NonFiniteError and save nothing."""
    module, attr, replacement = patch
    original = getattr(module, attr)
    workdir = root / name
    setattr(module, attr, replacement(original))
    t = time.perf_counter()
    try:
        trainer.train_and_evaluate(cfg, workdir, progress=False)
        message = "not detected"
    except NonFiniteError as e:
        message = str(e).split(";")[0]
    finally:
        setattr(module, attr, original)
    # The guard leaves the state as after the step before the one it names.
    named = re.match(r"step (\d+):", message)
    completed = int(named.group(1)) - 1 if named else _last_trained(workdir)
    return _refusal(name, injected, workdir, message, message.startswith("step 1:"), completed,
                    time.perf_counter() - t)


def nonfinite(root: Path, cfg) -> dict:
    def poison(init):
        def poisoned(run):
            state = init(run)
            table = state["params"]["embed"]["embedding"]
            state["params"]["embed"]["embedding"] = table.at[:, 0].set(jnp.inf)
            return state
        return poisoned

    return _stops_at_step_1(root, cfg, "nonfinite", "Inf in the embedding (NaN loss at step 1)",
                            (trainer, "init_sharded_state", poison))


def nonfinite_update(root: Path, cfg) -> dict:
    """lr=inf past the config's validation: finite loss and gradient, non-finite parameters."""
    def infinite_lr(make):
        return lambda train: make(dataclasses.replace(train, lr=float("inf")))

    return _stops_at_step_1(root, cfg, "nonfinite_update",
                            "lr=inf in the optimizer (finite loss, NaN update)",
                            (trainer, "make_optimizer", infinite_lr))


def disk_too_small(root: Path, cfg) -> dict:
    """The pre-flight check: the disk's free space cannot hold the checkpoints kept; refused
    before anything is written. The free space is mocked (`shutil.disk_usage` reports 10 kB):
    a real small filesystem needs a mount, which a CI container may not allow."""
    workdir = root / "diskfull"

    class Usage:
        free = 10_000

    real = trainer.shutil.disk_usage
    trainer.shutil.disk_usage = lambda _: Usage
    t = time.perf_counter()
    try:
        trainer.train_and_evaluate(cfg, workdir, progress=False)
        message = "not detected"
    except trainer.ConfigError as e:
        message = str(e)
    finally:
        trainer.shutil.disk_usage = real
    return _refusal("disk_too_small", "disk_usage reports 10 kB free (mocked)", workdir, message,
                    "GB free" in message and not workdir.exists(), _last_trained(workdir),
                    time.perf_counter() - t, mocked=True)


def configs(data: str | Path) -> tuple:
    """The zero3 config the in-process scenarios run and the dp one the command-line runs use
    (the CLI's default strategy)."""
    base = PRESETS["tiny"]
    cfg = dataclasses.replace(base, train=dataclasses.replace(
        base.train, steps=STEPS, ckpt_every=CKPT_EVERY, eval_every=1000, data=str(data),
        devices=8, strategy="zero3", keep_ckpts=3))
    return cfg, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, strategy="dp"))


def summarise(results: list[dict], seed: int) -> dict:
    """The table: every recovery row recovered and every refusal row refused, nothing lost."""
    counts = {o: sum(r["outcome"] == o for r in results)
              for o in (RECOVERED, NOT_RECOVERED, REFUSED, NOT_REFUSED)}
    return {"preset": "tiny", "devices": 8, "steps": STEPS, "ckpt_every": CKPT_EVERY,
            "seed": seed, "outcomes": counts,
            "all_recovered_nothing_lost": all(r["outcome"] in (RECOVERED, REFUSED)
                                              and r["lost_steps"] == 0 for r in results),
            "results": results}


def run(names: list[str], seed: int) -> dict:
    """Run the scenarios `names` (in SCENARIOS' order) in a temporary folder; the kill and
    SIGTERM points are drawn from `seed`. Each reference run is trained only when a chosen
    scenario compares against it."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "corpus.txt"
        data.write_text(Path(json.__file__).read_text() * 4)
        cfg, dp = configs(data)
        refs: dict[str, Path] = {}

        def ref(which: str) -> Path:
            if which not in refs:
                refs[which] = root / f"reference-{which}"
                train_and_evaluate(cfg if which == "zero3" else dp, refs[which], progress=False)
            return refs[which]

        d = str(data)
        runs = {
            "crash_and_resume": lambda: crash_and_resume(root, d, ref("dp"), dp, rng),
            "killed_in_first_save": lambda: killed_in_first_save(root, d, ref("dp"), dp),
            "preemption": lambda: preemption(root, d, ref("dp"), dp, rng),
            "interrupted_checkpoint": lambda: damaged_checkpoint(root, d, ref("zero3"), cfg,
                                                                 "interrupted"),
            "truncated_checkpoint": lambda: damaged_checkpoint(root, d, ref("zero3"), cfg,
                                                               "truncated"),
            "altered_checkpoint": lambda: damaged_checkpoint(root, d, ref("zero3"), cfg,
                                                             "altered"),
            "disk_full_during_save": lambda: disk_full_during_save(root, d, ref("dp"), dp),
            "resharding": lambda: resharding(ref("zero3"), cfg),
            "nonfinite": lambda: nonfinite(root, cfg),
            "nonfinite_update": lambda: nonfinite_update(root, cfg),
            "disk_too_small": lambda: disk_too_small(root, cfg),
        }
        assert tuple(runs) == SCENARIOS
        chosen = [runs[name] for name in SCENARIOS if name in names]
        results = [scenario() for scenario in tqdm(chosen, desc="scenarios", file=sys.stderr)]
    return summarise(results, seed)
