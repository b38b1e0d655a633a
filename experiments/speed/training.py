"""The training-speed benchmark behind `experiments.bench_train`: the trainer's real jitted step
(built by `experiments.training.trainer.prepare` through parallel/sharded_run.py), timed, profiled
and, optionally, interleaved with the PyTorch eager reference
(experiments/reference/torch_train_reference.py, run as a subprocess of another interpreter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from experiments.cli.config import ConfigError
from experiments.speed import machine, step_profile, step_variants
from experiments.training.config import Config
from experiments.training.trainer import global_batch, init_sharded_state, prepare
from model import param_count, train_flops_per_token
from model.flops import matmul_params

TORCH_SCRIPT = Path(__file__).resolve().parents[1] / "reference" / "torch_train_reference.py"


def torch_command(python: str, cfg: Config, steps: int, warmup: int) -> list[str]:
    """The reference script's command line for the same model, batch and context as `cfg`."""
    m, t = cfg.model, cfg.train
    if m.mlp != "gelu" or m.n_kv_heads not in (None, m.n_heads):
        raise ConfigError(f"preset={cfg.preset!r}: the torch reference has only the GELU MLP "
                          f"and multi-head attention")
    args = {"vocab": m.vocab_size, "d-model": m.d_model, "n-layers": m.n_layers,
            "n-heads": m.n_heads, "d-ff": m.d_ff, "seq-len": m.max_len, "batch": t.batch_size,
            "steps": steps, "warmup": warmup, "rope-base": m.rope_base, "norm-eps": m.norm_eps,
            "lr": t.lr, "threads": os.cpu_count() or 1}
    cmd = [python, str(TORCH_SCRIPT)] + [x for k, v in args.items() for x in (f"--{k}", str(v))]
    return cmd + (["--tie"] if m.tie_embeddings else [])


def run_torch(cmd: list[str]) -> dict:
    """One run of the reference script: its JSON line (RuntimeError with its stderr if it
    fails)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"torch reference failed ({proc.returncode}): "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def flop_shares(cfg: Config) -> dict:
    """Which breakdown groups the model FLOPs (model/flops.py) belong to: the matmuls and the
    attention products; every other group does none that the count includes."""
    total = train_flops_per_token(cfg.model)
    matmul = 6.0 * matmul_params(cfg.model)
    return {"matmul": matmul / total, "attention": (total - matmul) / total}


def bench(cfg: Config, *, steps: int, rounds: int = 1, warmup: int = 3,
          profile_steps: int = 2, torch_python: str | None = None,
          peak_size: int = 2048) -> dict:
    """Tokens/s of cfg's training step (median over `rounds` x `steps` timed steps), its model
    FLOP/s against this machine's matmul peak, a per-operation breakdown, and with
    `torch_python` the reference's tokens/s measured between our rounds (ours, torch, ours,
    torch, ...) so that machine load hits both alike."""
    run = prepare(cfg)
    state = init_sharded_state(run)
    batch = global_batch(run, run.sampler.next_batch)
    state, _ = step_profile.time_steps(run.step_fn, state, batch, 0, warmup)  # compile + warm
    cmd = torch_command(torch_python, cfg, steps, warmup) if torch_python else None
    ours, theirs, torch_out = [], [], None
    for _ in range(rounds):
        state, times = step_profile.time_steps(run.step_fn, state, batch, steps)
        ours.extend(times)
        if cmd:
            torch_out = run_torch(cmd)
            theirs.append(torch_out["tokens_per_s"])
    state, breakdown = step_profile.step_breakdown(run.step_fn, state, batch,
                                                   steps=profile_steps)
    state, host = step_profile.host_costs(run.step_fn, state, batch, steps)
    peak = step_profile.matmul_peak(peak_size)
    tokens = cfg.train.batch_size * cfg.model.max_len
    step_s = statistics.median(ours)
    tps = tokens / step_s
    flops = tps * train_flops_per_token(cfg.model)
    out = {"preset": cfg.preset, "devices": run.mesh.size,
           "strategy": cfg.train.strategy, "batch": cfg.train.batch_size,
           "seq_len": cfg.model.max_len, "params": param_count(cfg.model),
           "model": dataclasses.asdict(cfg.model), "steps": steps, "rounds": rounds,
           "median_step_s": step_s, "tokens_per_s": tps,
           "train_flops_per_token": train_flops_per_token(cfg.model),
           "model_flops_per_s": flops, "matmul_peak_flops_per_s": peak,
           "flop_shares": flop_shares(cfg),
           "fraction_of_peak": flops / peak, "breakdown": breakdown, "host": host,
           "machine": {**machine.describe(), "load_avg_1min": os.getloadavg()[0]}}
    if cmd:
        torch_tps = statistics.median(theirs)
        out["torch"] = {"version": torch_out["torch_version"], "threads": torch_out["threads"],
                        "params": torch_out["params"], "tokens_per_s": torch_tps,
                        "tokens_per_s_rounds": theirs, "ratio": tps / torch_tps}
        if torch_out["params"] != out["params"]:
            raise RuntimeError(f"torch reference has {torch_out['params']} parameters, "
                               f"model/flops.py counts {out['params']}: not the same model")
    return out


def ablate(cfg: Config, *, steps: int, rounds: int, warmup: int = 3,
           names: tuple[str, ...] | None = None) -> dict:
    """Each change of step_variants.CHANGES measured paired: the current step against the step
    with that change undone (and against all of them undone), built and warmed alike, timed in
    interleaved rounds (the order reversed every other round). Step wall time and this
    process's CPU time per step are both recorded: on a shared machine the CPU time is the
    steadier of the two."""
    names = tuple(names or step_variants.CHANGES)
    variants = {"current": (), **{f"without {n}": (n,) for n in names}, "without all": names}
    runs = {}
    for label, undo in variants.items():
        with step_variants.undone(undo):
            run = prepare(cfg)
            state = init_sharded_state(run)
            batch = global_batch(run, run.sampler.next_batch)
            state, _ = step_profile.time_steps(run.step_fn, state, batch, 0, warmup)
        runs[label] = {"run": run, "state": state, "batch": batch, "wall": [], "cpu": []}
    order = list(variants)
    for r in range(rounds):
        for label in order if r % 2 == 0 else order[::-1]:
            v = runs[label]
            for _ in range(steps):
                c0 = time.process_time()
                v["state"], t = step_profile.time_steps(v["run"].step_fn, v["state"],
                                                        v["batch"], 1)
                v["cpu"].append(time.process_time() - c0)
                v["wall"].extend(t)
    med = {label: {"step_s": statistics.median(v["wall"]), "cpu_s": statistics.median(v["cpu"])}
           for label, v in runs.items()}
    cur = med["current"]
    changes = [{"change": n, "what": step_variants.CHANGES[n].what,
                "step_s_without": med[f"without {n}"]["step_s"], "step_s_with": cur["step_s"],
                "speedup": med[f"without {n}"]["step_s"] / cur["step_s"],
                "cpu_s_without": med[f"without {n}"]["cpu_s"], "cpu_s_with": cur["cpu_s"],
                "cpu_speedup": med[f"without {n}"]["cpu_s"] / cur["cpu_s"]} for n in names]
    tokens = cfg.train.batch_size * cfg.model.max_len
    return {"preset": cfg.preset, "devices": runs["current"]["run"].mesh.size, "steps": steps,
            "rounds": rounds, "medians": med, "changes": changes,
            "tokens_per_s_without_all": tokens / med["without all"]["step_s"],
            "tokens_per_s_current": tokens / cur["step_s"],
            "speedup_all": med["without all"]["step_s"] / cur["step_s"],
            "cpu_speedup_all": med["without all"]["cpu_s"] / cur["cpu_s"],
            "machine": {**machine.describe(), "load_avg_1min": os.getloadavg()[0]}}
