"""Inject the faults a long run meets and show that nothing is lost.

  python -m experiments.fault_injection --json

Each scenario trains the `tiny` preset on 8 fake CPU devices (real text: the json module's
source), injects one fault, recovers the way a user would, and compares with an uninterrupted
reference run of the same config and seed. `lost_steps` counts the steps whose loss or final
parameters differ from the reference (0 = nothing lost). `recovery_s` is the wall time of the
recovery (the resumed run, or from the signal to a clean exit). Writes
experiments/results/fault_injection.json (--out); the last stdout line is its JSON.
Runtime: about 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments import checkpoint as ckpt
from experiments import runtime, trainer
from experiments.config import PRESETS
from experiments.guards import NonFiniteError
from experiments.integrity import MANIFESTS
from experiments.restore import restore_params
from experiments.results_io import results_path, write_result
from experiments.trainer import train_and_evaluate
from parallel.sharded_run import max_tree_diff

PROG = "experiments.fault_injection"
STEPS, CKPT_EVERY = 12, 3


def _losses(workdir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _lost(workdir: Path, ref: Path, cfg) -> int:
    """Steps whose logged loss differs from the reference, or all of them if the final
    parameters differ (bitwise)."""

    a, b = _losses(workdir), _losses(ref)
    lost = sum(1 for k in b if a.get(k) != b[k])
    pa = restore_params(workdir, cfg).params
    pb = restore_params(ref, cfg).params
    return lost if max_tree_diff(pa, pb) == 0.0 else max(lost, len(b))


def _cli(workdir: Path, data: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "experiments.train", "--workdir", str(workdir), "--preset",
            "tiny", "--data", data, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY),
            "--eval-every", "1000", "--no-progress", *extra]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _wait_for_steps(proc, metrics: Path, n: int) -> None:
    deadline = time.time() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError("the training process never reached the fault point")
        time.sleep(0.05)


def crash_and_resume(root: Path, data: str, ref: Path, cfg, rng) -> dict:
    workdir = root / "crash"
    kill_at = int(rng.integers(2, STEPS - 1))
    proc = subprocess.Popen(_cli(workdir, data), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _wait_for_steps(proc, workdir / "metrics.jsonl", kill_at)
    proc.kill()
    proc.wait()
    t = time.perf_counter()
    resumed = subprocess.run([*_cli(workdir, data), "--resume"], env=_env(),
                             capture_output=True, text=True)
    return {"scenario": "crash_and_resume", "injected": f"SIGKILL after step {kill_at}",
            "recovered": resumed.returncode == 0, "recovery_s": time.perf_counter() - t,
            "lost_steps": _lost(workdir, ref, cfg)}


def preemption(root: Path, data: str, ref: Path, cfg, rng) -> dict:
    workdir = root / "preempt"
    at = int(rng.integers(2, STEPS - 1))
    proc = subprocess.Popen(_cli(workdir, data), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    _wait_for_steps(proc, workdir / "metrics.jsonl", at)
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    exit_s = time.perf_counter() - t
    stopped = json.loads(out.strip().splitlines()[-1])["step"]
    resumed = subprocess.run([*_cli(workdir, data), "--resume"], env=_env(),
                             capture_output=True, text=True)
    return {"scenario": "preemption", "injected": f"SIGTERM after step {at}",
            "recovered": proc.returncode == 0 and resumed.returncode == 0,
            "recovery_s": exit_s, "checkpointed_step": stopped,
            "lost_steps": _lost(workdir, ref, cfg)}


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
    train_and_evaluate(cfg, workdir, resume=True, progress=False)
    return {"scenario": f"{how}_checkpoint", "injected": f"{how} checkpoint {STEPS}",
            "recovered": True, "recovery_s": time.perf_counter() - t,
            "lost_steps": _lost(workdir, ref, cfg)}


def resharding(ref: Path, cfg) -> dict:
    t = time.perf_counter()
    base = restore_params(ref, cfg).params
    worst = 0.0
    for strategy, devices in (("zero3", 4), ("zero3", 2), ("dp", 1)):
        params = restore_params(ref, cfg, strategy=strategy, devices=devices).params
        worst = max(worst, max_tree_diff(params, base))
    return {"scenario": "resharding", "injected": "zero3@8 checkpoint read as zero3@4, "
            "zero3@2, dp@1", "recovered": worst == 0.0, "recovery_s": time.perf_counter() - t,
            "lost_steps": 0 if worst == 0.0 else STEPS, "max_param_diff": worst}


def nonfinite(root: Path, cfg) -> dict:
    original = trainer.init_sharded_state

    def poisoned(run):
        state = original(run)
        table = state["params"]["embed"]["embedding"]
        state["params"]["embed"]["embedding"] = table.at[:, 0].set(jnp.inf)
        return state

    workdir = root / "nonfinite"
    trainer.init_sharded_state = poisoned
    t = time.perf_counter()
    try:
        trainer.train_and_evaluate(cfg, workdir, progress=False)
        message = "not detected"
    except NonFiniteError as e:
        message = str(e).split(";")[0]
    finally:
        trainer.init_sharded_state = original
    saved = ckpt.manager(workdir, read_only=True).all_steps()
    return {"scenario": "nonfinite", "injected": "Inf in the embedding (NaN loss at step 1)",
            "recovered": message.startswith("step 1") and saved == [],
            "recovery_s": time.perf_counter() - t, "lost_steps": 0, "message": message}


def disk_full(root: Path, cfg) -> dict:
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
    return {"scenario": "disk_full", "injected": "10 kB free on the work dir's disk",
            "recovered": "GB free" in message and not workdir.exists(),
            "recovery_s": time.perf_counter() - t, "lost_steps": 0, "message": message}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=None, help="fault points (default: random)")
    p.add_argument("--out", default=str(results_path("fault_injection.json")))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    runtime.start(8)

    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "corpus.txt"
        data.write_text(Path(json.__file__).read_text() * 4)
        base = PRESETS["tiny"]
        cfg = dataclasses.replace(base, train=dataclasses.replace(
            base.train, steps=STEPS, ckpt_every=CKPT_EVERY, eval_every=1000, data=str(data),
            devices=8, strategy="zero3", keep_ckpts=3))
        ref = root / "reference"
        train_and_evaluate(cfg, ref, progress=False)
        dp = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, strategy="dp"))
        ref_dp = root / "reference-dp"
        train_and_evaluate(dp, ref_dp, progress=False)
        scenarios = [
            lambda: crash_and_resume(root, str(data), ref_dp, dp, rng),
            lambda: preemption(root, str(data), ref_dp, dp, rng),
            lambda: damaged_checkpoint(root, str(data), ref, cfg, "interrupted"),
            lambda: damaged_checkpoint(root, str(data), ref, cfg, "truncated"),
            lambda: damaged_checkpoint(root, str(data), ref, cfg, "altered"),
            lambda: resharding(ref, cfg),
            lambda: nonfinite(root, cfg),
            lambda: disk_full(root, cfg),
        ]
        results = [run() for run in tqdm(scenarios, desc="scenarios", file=sys.stderr)]
    out = {"preset": "tiny", "devices": 8, "steps": STEPS, "ckpt_every": CKPT_EVERY,
           "all_recovered_nothing_lost": all(r["recovered"] and r["lost_steps"] == 0
                                             for r in results), "results": results}
    write_result(args.out, out)
    if not args.json:
        for r in results:
            print(f"{r['scenario']:24s} {r['injected']:45s} recovered={r['recovered']} "
                  f"lost={r['lost_steps']} {r['recovery_s']:.1f} s")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
