"""XLA:CPU flags as decoding levers: one decode variant timed in child processes that differ only
in `XLA_FLAGS` (flags are read once, when a process starts its backend).

The children run `experiments.bench_decode --decode-only` one after another in rounds (the
baseline with this process's own flags, a second child with those same flags as the control,
then each flag set; the next round in reverse order), so that a change in the machine's load
hits them alike and none always runs first; each row is the median over its rounds. The
control's speed-up is what separates two identical children: a flag set's speed-up means
something only beyond it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.speed.interleaving import round_order

BASELINE = "baseline"
# A second child with the baseline's own flags, timed as a flag set is: the speed-up two
# identical children show, against which a flag set's speed-up is read.
CONTROL = "none (a second baseline child: the spread of identical children)"
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


def flag_rows(argv: list[str], rounds: int, flag_sets: dict[str, str] | None = None
              ) -> list[dict]:
    """One row per flag set, and first the CONTROL row: its tokens/s and the baseline's
    (medians over `rounds` rounds, the order reversed every other round) and the speed-up;
    `argv` picks the variant, model and timing (bench_decode flags)."""
    flag_sets = FLAG_SETS if flag_sets is None else flag_sets
    settings = {BASELINE: "", CONTROL: "", **flag_sets}  # what -> the flags it adds
    runs: dict[str, list[float]] = {what: [] for what in settings}
    for i in range(rounds):
        for what in round_order(list(settings), i):
            runs[what].append(child_speed(argv, settings[what]))
    base = statistics.median(runs[BASELINE])
    return [{"change": what, "xla_flags": settings[what], "control": what == CONTROL,
             "baseline_tokens_per_s": base, "tokens_per_s": statistics.median(runs[what]),
             "speedup": statistics.median(runs[what]) / base,
             "runs_tokens_per_s": runs[what], "baseline_runs_tokens_per_s": runs[BASELINE]}
            for what in settings if what != BASELINE]
