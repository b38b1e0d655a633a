"""XLA:CPU flags as decoding levers: one decode variant timed in child processes that differ only
in `XLA_FLAGS` (flags are read once, when a process starts its backend).

The children run `experiments.bench_decode --decode-only` one after another in rounds (the
baseline with this process's own flags, then each flag set; the next round in reverse order),
so that a change in the machine's load hits them alike and none always runs first; each row is
the median over its rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# what the flags change -> the flags (added to this process's own XLA_FLAGS)
FLAG_SETS = {
    "YNNPACK also fuses elementwise operations and reductions":
        "--xla_cpu_experimental_ynn_fusion_type=individual_dot,dot,eltwise,reduce",
    "512-bit vectors in XLA's own loops": "--xla_cpu_prefer_vector_width=512",
    "XLA's plain scheduler instead of its concurrency-optimised one":
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    "single-threaded Eigen (and no YNNPACK thread pool)": "--xla_cpu_multi_thread_eigen=false",
}


def child_speeds(argv: list[str], env: dict[str, str], what: str
                 ) -> tuple[dict[str, float], int | None]:
    """({variant: tokens/s} that `experiments.bench_decode --decode-only *argv` times in a child
    process started with `env`, the child's bytes in huge pages); `what` names the setting in
    an error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        done = subprocess.run([sys.executable, "-m", "experiments.bench_decode", "--decode-only",
                               *argv, "--out", str(out)], env=env, capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise RuntimeError(f"{what}: the child run failed: {tail}")
        result = json.loads(out.read_text())
    return ({r["variant"]: r["tokens_per_s"] for r in result["variants"]},
            (result.get("huge_pages") or {}).get("bytes"))


def child_speed(argv: list[str], extra_flags: str) -> float:
    """tokens/s of the one variant `experiments.bench_decode --decode-only *argv` times in a
    child process whose XLA_FLAGS add `extra_flags`."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), extra_flags) if f)
    (speed,) = child_speeds(argv, env, f"XLA_FLAGS={extra_flags!r}")[0].values()
    return speed


def round_order(settings: list, round_index: int) -> list:
    """The children of one round: in order, then reversed in the next round (A B, B A, A B ...),
    so no setting always runs first, right after the parent's own work or the last round."""
    return settings if round_index % 2 == 0 else settings[::-1]


def flag_rows(argv: list[str], rounds: int, flag_sets: dict[str, str] | None = None
              ) -> list[dict]:
    """One row per flag set: its tokens/s and the baseline's (medians over `rounds` rounds, the
    order reversed every other round) and the speed-up; `argv` picks the variant, model and
    timing (bench_decode flags)."""
    flag_sets = FLAG_SETS if flag_sets is None else flag_sets
    runs: dict[str, list[float]] = {"": []} | {flags: [] for flags in flag_sets.values()}
    for i in range(rounds):
        for flags in round_order(list(runs), i):
            runs[flags].append(child_speed(argv, flags))
    base = statistics.median(runs[""])
    return [{"change": what, "xla_flags": flags, "baseline_tokens_per_s": base,
             "tokens_per_s": statistics.median(runs[flags]),
             "speedup": statistics.median(runs[flags]) / base,
             "runs_tokens_per_s": runs[flags], "baseline_runs_tokens_per_s": runs[""]}
            for what, flags in flag_sets.items()]
