"""Every experiment that feeds a README table or plot, pinned, and the runner that re-measures
them (experiments.reproduce is its command line).

Each experiment runs as a subprocess of its own launcher (`python -m experiments.NAME ...`), so
launchers stay leaves and one failing does not stop the others. A run writes its results into
one folder: the committed experiments/results/ for the full run, another folder for --quick
(the environment variable SHARDQ_RESULTS_DIR points every launcher's default output there, and
the commands below name it explicitly where a launcher takes --out/--record). After each
experiment its results files get a "provenance" entry (machine, software versions, date,
command), and reproduce.json in the folder records every experiment's command, status, wall
time and output tail.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from experiments.results_io import PROJECT_ROOT, RESULTS_ENV, project_relative, write_result


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One launcher invocation. In argv, {results} is the results folder and {runs} a scratch
    folder for training runs; `outputs` are the results files it writes (in {results})."""

    name: str
    argv: tuple[str, ...]
    quick_argv: tuple[str, ...]
    outputs: tuple[str, ...]
    expected_s: float  # full run, on the 2-core CPU machine
    quick_expected_s: float
    feeds: str  # which README table(s) or plot
    # What the table claims, checked on the results folder after a run (full or quick, the
    # second argument): None when it holds, else a line saying what does not. None for
    # measurements (speeds) that make no claim a shared machine could check.
    claim: Callable[[Path, bool], str | None] | None = None

    def command(self, quick: bool, results: Path, runs: Path) -> list[str]:
        # Project-relative paths (the commands run from the project root): results files
        # record their command, and a committed one must not hold this machine's paths.
        args = self.quick_argv if quick else self.argv
        res, run = project_relative(results), project_relative(runs)
        return [sys.executable, *(a.replace("{results}", res).replace("{runs}", run)
                                  for a in args)]

    @property
    def module(self) -> str:
        return self.argv[1]


def _m(name: str, *args: str) -> tuple[str, ...]:
    return ("-m", f"experiments.{name}", *args)


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def holds(name: str, what: str, test: Callable[[dict], bool],
          full_only: tuple[str, Callable[[dict], bool]] | None = None,
          ) -> Callable[[Path, bool], str | None]:
    """A claim on results file `name`: `test` of its JSON must be true, else `what` failed;
    `full_only` (what, test) is checked too, except on a quick run's smaller grid."""
    def check_one(results: Path, what: str, test: Callable[[dict], bool]) -> str | None:
        try:
            ok = bool(test(_load(results, name)))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            return f"{name}: cannot check that {what} ({type(e).__name__}: {e})"
        return None if ok else f"{name}: not true that {what}"

    def check(results: Path, quick: bool = False) -> str | None:
        broken = check_one(results, what, test)
        if broken is None and full_only and not quick:
            broken = check_one(results, *full_only)
        return broken
    return check


# The main job's checkpoint feeds the int8 table, so main_job comes before quant_table.
EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment("main_job", _m("main_job", "--workdir", "{runs}/main", "--no-progress",
                              "--record", "{results}/main_job.json"),
               _m("main_job", "--workdir", "{runs}/main", "--no-progress", "--preset", "tiny",
                  "--steps", "40", "--warmup-steps", "5", "--eval-every", "40",
                  "--eval-batches", "2",
                  "--ckpt-every", "40", "--record", "{results}/main_job.json"),
               ("main_job.json", "main_job.png"), 560, 20, "main_job table, loss curve"),
    Experiment("equivalence", _m("equivalence", "--devices", "8", "--steps", "20", "--json",
                                 "--out", "{results}/equivalence.json"),
               # Every strategy against one device, on 2 devices in fp32 (the claim's precision).
               _m("equivalence", "--devices", "2", "--device-counts", "2", "--precisions",
                  "float32", "--steps", "2", "--json", "--out", "{results}/equivalence.json"),
               ("equivalence.json",), 900, 60, "equivalence table"),
    Experiment("zero_memory", _m("zero_memory", "--json", "--out", "{results}/zero_memory.json"),
               _m("zero_memory", "--json", "--presets", "7.5b", "--devices", "4", "64",
                  "--stages", "dp", "zero3", "--out", "{results}/zero_memory.json"),
               ("zero_memory.json",), 330, 35, "ZeRO Table 1"),
    Experiment("comm_volume", _m("comm_volume", "--json", "--out", "{results}/comm_volume.json"),
               _m("comm_volume", "--json", "--strategies", "dp", "zero3",
                  "--out", "{results}/comm_volume.json"),
               ("comm_volume.json",), 90, 30, "communication volume table"),
    Experiment("zero_release", _m("zero_release", "--json",
                                  "--out", "{results}/zero_release.json"),
               _m("zero_release", "--json", "--strategies", "zero3", "--d-model", "256",
                  "--n-heads", "4", "--d-ff", "1024", "--out", "{results}/zero_release.json"),
               ("zero_release.json",), 150, 30, "release table"),
    Experiment("bench_strategies", _m("bench_strategies", "--preset", "small", "--devices", "8",
                                      "--json", "--out", "{results}/strategy_speed.json"),
               _m("bench_strategies", "--preset", "tiny", "--devices", "8", "--steps", "3",
                  "--warmup", "1", "--strategies", "dp,zero3", "--json",
                  "--out", "{results}/strategy_speed.json"),
               ("strategy_speed.json",), 240, 25, "step time table"),
    Experiment("zero_table2", _m("zero_table2", "--json", "--no-cache",
                                 "--out", "{results}/zero_table2.json"),
               _m("zero_table2", "--json", "--quick", "--no-cache",
                  "--out", "{results}/zero_table2.json"),
               ("zero_table2.json", "zero_table2.png"), 360, 60,
               "ZeRO Table 2 by search, planning table and plot"),
    Experiment("plan", _m("plan", "--preset", "7.5b", "--devices", "64", "--device-memory",
                          "32GB", "--no-cache", "--json",
                          "--out", "{results}/plan_7.5b_64x32gb.json"),
               _m("plan", "--preset", "tiny", "--devices", "8", "--device-memory", "4MB",
                  "--seq", "32", "--global-batch", "16", "--strategies", "zero3",
                  "--remats", "full", "--data-sizes", "1", "--micro-batches", "1",
                  "--no-cache", "--json", "--out", "{results}/plan_7.5b_64x32gb.json"),
               ("plan_7.5b_64x32gb.json",), 70, 10, "planner example table"),
    Experiment("plan_accuracy", _m("plan_accuracy", "--json",
                                   "--out", "{results}/plan_accuracy.json"),
               _m("plan_accuracy", "--json", "--quick", "--out", "{results}/plan_accuracy.json"),
               ("plan_accuracy.json",), 300, 45, "planner accuracy table"),
    Experiment("quant_table", _m("quant_table", "--workdir", "{runs}/main",
                                 "--out", "{results}/quant_eval.json"),
               _m("quant_table", "--workdir", "{runs}/main", "--modes", "w8,w8a8",
                  "--calib-batches", "1", "--out", "{results}/quant_eval.json"),
               ("quant_eval.json",), 150, 20, "int8 table (needs main_job's checkpoint)"),
    Experiment("llm_quant_table", _m("llm_quant_table", "--out", "{results}/smollm2_quant.json"),
               _m("llm_quant_table", "--layers", "4", "--modes", "w8a8", "--tokens", "512",
                  "--new-tokens", "8", "--out", "{results}/smollm2_quant.json"),
               ("smollm2_quant.json", "smollm2_quant.png"), 900, 30,
               "SmolLM2 int8 perplexity table and activation plot"),
    Experiment("chat_replies", _m("chat_replies", "--out", "{results}/smollm2_chat_replies.json"),
               _m("chat_replies", "--layers", "2", "--modes", "w8a8", "--prompts", "2",
                  "--max-new-tokens", "4,8", "--seeds", "2",
                  "--out", "{results}/smollm2_chat_replies.json"),
               ("smollm2_chat_replies.json",), 900, 60, "SmolLM2 int8 chat replies table"),
    Experiment("parity_smollm2", _m("parity_smollm2", "--out", "{results}/smollm2_parity.json"),
               _m("parity_smollm2", "--no-long", "--out", "{results}/smollm2_parity.json"),
               ("smollm2_parity.json",), 150, 30, "SmolLM2 parity with transformers"),
    Experiment("embed_fidelity", _m("embed_fidelity", "--json",
                                    "--out", "{results}/embed_fidelity.json"),
               _m("embed_fidelity", "--json", "--sentences", "16", "--calib", "8",
                  "--modes", "w8a8", "--out", "{results}/embed_fidelity.json"),
               ("embed_fidelity.json",), 300, 15, "MiniLM int8 fidelity table"),
    Experiment("bench_int8", _m("bench_int8", "--json", "--out", "{results}/int8_bench.json"),
               _m("bench_int8", "--json", "--preset", "tiny", "--repeats", "2",
                  "--new-tokens", "8", "--out", "{results}/int8_bench.json"),
               ("int8_bench.json",), 200, 25, "int8 speed table"),
    # With SHARDQ_TORCH_PYTHON naming an interpreter that has torch + transformers, the
    # benchmark adds the PyTorch side (the table's ratios); without it, ours only.
    Experiment("bench_encoder", _m("bench_encoder", "--json",
                                   "--out", "{results}/bench_encoder.json"),
               _m("bench_encoder", "--json", "--sentences", "16", "--rounds", "1",
                  "--modes", "w8a8", "--out", "{results}/bench_encoder.json"),
               ("bench_encoder.json",), 240, 20, "MiniLM speed vs PyTorch table"),
    Experiment("encoder_ablations", _m("bench_encoder", "--ablations", "--json",
                                       "--out", "{results}/encoder_ablations.json"),
               _m("bench_encoder", "--ablations", "--json", "--sentences", "32", "--rounds",
                  "1", "--no-cli", "--out", "{results}/encoder_ablations.json"),
               ("encoder_ablations.json",), 300, 30, "MiniLM speed changes table"),
    Experiment("bench_decode", _m("bench_decode", "--json", "--out", "{results}/bench_decode.json"),
               _m("bench_decode", "--json", "--layers", "2", "--new-tokens", "4", "--repeats",
                  "1", "--variants", "float,w8a8,float-scan",
                  "--out", "{results}/bench_decode.json"),
               ("bench_decode.json",), 240, 30, "SmolLM2 decoding speed table"),
    # Like bench_encoder, the PyTorch side needs SHARDQ_TORCH_PYTHON; the file keeps one row per
    # device count, so the full run measures 8 devices (the trainer's CPU default).
    Experiment("bench_train", _m("bench_train", "--devices", "8", "--json",
                                 "--out", "{results}/bench_train.json"),
               _m("bench_train", "--devices", "8", "--preset", "tiny", "--steps", "2",
                  "--rounds", "1", "--warmup", "1", "--profile-steps", "1", "--json",
                  "--out", "{results}/bench_train.json"),
               ("bench_train.json",), 90, 30, "training speed vs PyTorch table"),
    Experiment("comm_volume_smollm2", _m("comm_volume", "--preset", "smollm2", "--n-layers", "30",
                                         "--strategies", "dp", "zero1", "zero2", "zero3",
                                         "zero3_prefetch", "--json",
                                         "--out", "{results}/comm_volume_smollm2.json"),
               _m("comm_volume", "--preset", "smollm2", "--n-layers", "4", "--strategies",
                  "zero3", "--json", "--out", "{results}/comm_volume_smollm2.json"),
               ("comm_volume_smollm2.json",), 150, 30, "ZeRO volume on the GQA model"),
    Experiment("zero_memory_llama", _m("zero_memory", "--presets", "7.5b-gqa", "smollm2",
                                       "--json", "--out", "{results}/zero_memory_llama.json"),
               _m("zero_memory", "--presets", "7.5b-gqa", "--devices", "64", "--stages",
                  "zero3", "--json", "--out", "{results}/zero_memory_llama.json"),
               ("zero_memory_llama.json",), 600, 20, "Table 1 on the GQA shapes"),
    Experiment("fault_injection", _m("fault_injection", "--json",
                                     "--out", "{results}/fault_injection.json"),
               # One fault of each kind: a kill, a damaged checkpoint, another layout, a
               # non-finite step, a refused start.
               _m("fault_injection", "--json", "--scenarios", "crash_and_resume,"
                  "altered_checkpoint,resharding,nonfinite,disk_too_small",
                  "--out", "{results}/fault_injection.json"),
               ("fault_injection.json",), 200, 70, "failure behaviour table"),
)


CLAIMS: dict[str, Callable[[Path, bool], str | None]] = {
    "main_job": holds(
        "main_job.json", "the reloaded checkpoint evaluates to the trained loss",
        lambda d: abs(d["val_loss"] - d["train_val_loss"]) <= 1e-6),
    "equivalence": holds(
        "equivalence.json", "every fp32 run is within the tolerance of one device",
        lambda d: d["fp32_all_within_tolerance"] is True),
    "zero_memory": holds(
        "zero_memory.json", "every cell is within 2% of the paper",
        lambda d: d["all_within_2pct"] is True),
    # zero3_auto is XLA's own choice (it all-reduces activations): no paper figure to meet.
    "comm_volume": holds(
        "comm_volume.json", "every written strategy's volume is within 5% of the paper's",
        lambda d: all(r["within_5pct"] for r in d["results"] if r["strategy"] != "zero3_auto")),
    "comm_volume_smollm2": holds(
        "comm_volume_smollm2.json", "zero3 moves 3 Psi_layers inside the layer loop and its "
        "total is 3 Psi_layers + 2 Psi_rest",
        lambda d: all(r["within_5pct"] for r in d["results"]) and all(
            abs(r["in_layer_loop_psi_layers"] - 3) <= 0.01 for r in d["results"]
            if r["strategy"] == "zero3")),
    "zero_memory_llama": holds(
        "zero_memory_llama.json", "every cell within 2% of Table 1",
        lambda d: d["all_within_2pct"] is True),
    "zero_release": holds(
        "zero_release.json", "zero3 releases every gathered layer",
        lambda d: all(r["released"] for r in d["results"])),
    "zero_table2": holds(
        "zero_table2.json", "each stage trains a larger model than the one before",
        lambda d: [r["state_psi"] for r in d["table2"]]
        == sorted({r["state_psi"] for r in d["table2"]})),
    "plan": holds(
        "plan_7.5b_64x32gb.json", "the recommended candidate fits",
        lambda d: d["recommended"]["fits"] is True),
    # The runtime's own few MB per device are a larger share of the quick run's small
    # configurations, so only the full grid is held to the 10% goal.
    "plan_accuracy": holds(
        # The executed program's peak and the planner's differ by a few KB; against the quick
        # grid's ~14 MB peaks that reached 0.12% (0.04% on the full grid).
        "plan_accuracy.json", "every configuration ran and its executable compiles to the "
        "planner's peak (within 0.5%)",
        lambda d: not d["failures"] and d["max_abs_executable_vs_planner"] <= 5e-3,
        full_only=("the planner's peak is within the goal of the executed one",
                   lambda d: d["within_goal"] is True)),
    "quant_table": holds(
        "quant_eval.json", "every int8 mode is within 1% of float",
        lambda d: all(abs(r["rel_to_float"]) <= 0.01 for r in d["rows"])),
    "parity_smollm2": holds(
        "smollm2_parity.json", "token ids and next tokens are identical, mean NLLs within "
        "1e-4 nats, chat prompt ids identical and greedy replies identical but at near ties",
        lambda d: d["ids_identical"] == d["next_identical"] == d["texts"]
        and d["max_abs_nll_diff"] <= 1e-4
        and all(p["template_identical"] and (p["identical"] or p["parted_at_near_tie"])
                for p in d["chat"]["prompts"]),
        full_only=("the same holds for the long text (the quick run skips it)",
                   lambda d: d["long_text"]["ids_identical"] and d["long_text"]["next_identical"]
                   and d["long_text"]["abs_nll_diff"] <= 1e-4
                   and d["long_text"]["tail_abs_nll_diff"] <= 1e-4)),
    "fault_injection": holds(
        "fault_injection.json", "every fault is recovered from with nothing lost",
        lambda d: d["all_recovered_nothing_lost"] is True),
}
EXPERIMENTS = tuple(dataclasses.replace(e, claim=CLAIMS.get(e.name)) for e in EXPERIMENTS)
NAMES = tuple(e.name for e in EXPERIMENTS)


def select(names: list[str] | None) -> list[Experiment]:
    """The experiments named (in the list's order), all when None; ValueError naming the
    unknown ones."""
    if not names:
        return list(EXPERIMENTS)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"only={' '.join(unknown)}: allowed {', '.join(NAMES)}")
    return [e for e in EXPERIMENTS if e.name in names]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """The machine and software a run used (a small stand-in for a shared machine helper)."""
    mem = None
    try:
        kb = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines()
                  if x.startswith("MemTotal"))
        mem = round(kb * 1024 / 1e9, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gb": mem,
                    "platform": platform.platform()},
        "software": {"python": platform.python_version(),
                     **{p: _version(p) for p in ("jax", "jaxlib", "flax", "optax",
                                                 "orbax-checkpoint", "numpy")}},
        "git_commit": _git_commit(),
    }


def stamp(path: Path, provenance: dict) -> bool:
    """Add `provenance` to a JSON results file (False if it is not a JSON object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(data, dict):
        return False
    data["provenance"] = provenance
    write_result(path, data)
    return True


def _fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def run_all(experiments: list[Experiment], *, quick: bool, results: Path, runs: Path,
            say: Callable[[str], None] = print, timeout_s: float | None = None) -> dict:
    """Run each experiment in turn (a failure is recorded and the next one runs); returns the
    summary also written to results/reproduce.json."""
    results, runs = Path(results).resolve(), Path(runs).resolve()
    results.mkdir(parents=True, exist_ok=True)
    runs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, RESULTS_ENV: str(results),
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    expected = [e.quick_expected_s if quick else e.expected_s for e in experiments]
    say(f"{len(experiments)} experiments, expected about {_fmt(sum(expected))} on a 2-core CPU; "
        f"results in {results}")
    machine = environment()
    start = time.perf_counter()
    rows = []
    for i, exp in enumerate(experiments):
        cmd = exp.command(quick, results, runs)
        shown = "python " + " ".join(cmd[1:])
        left = sum(expected[i:])
        say(f"[{i + 1}/{len(experiments)}] {exp.name} ({exp.feeds}): {shown}  "
            f"[elapsed {_fmt(time.perf_counter() - start)}, about {_fmt(left)} left]")
        t0 = time.perf_counter()
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        tail: list[str] = []
        try:
            proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace")
            for line in proc.stdout:
                line = line.rstrip("\n")
                if len(line) < 400:  # progress lines; the last-line JSON is long and kept below
                    say(f"    {exp.name}: {line}")
                tail = (tail + [line[-2000:]])[-15:]
            rc = proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            rc, tail = -1, tail + [f"{type(e).__name__}: {e}"]
        wall = time.perf_counter() - t0
        missing = [o for o in exp.outputs if not (results / o).exists()]
        broken = exp.claim(results, quick) if exp.claim and rc == 0 and not missing else None
        ok = rc == 0 and not missing and broken is None
        provenance = {**machine, "date": date, "command": shown, "wall_s": round(wall, 1),
                      "quick": quick}
        for o in exp.outputs:
            if o.endswith(".json") and (results / o).exists() and rc == 0:
                stamp(results / o, provenance)
        rows.append({"name": exp.name, "feeds": exp.feeds, "command": shown, "date": date,
                     "returncode": rc, "passed": ok, "wall_s": round(wall, 1),
                     "outputs": list(exp.outputs), "missing_outputs": missing,
                     "claim_failed": broken,
                     "tail": tail if not ok else tail[-3:]})
        say(f"    {exp.name}: {'passed' if ok else 'FAILED'} in {_fmt(wall)}"
            + ("" if ok else f" (exit {rc}" + (f", missing {', '.join(missing)}" if missing
                                                else "") + (f"; {broken}" if broken else "")
               + ")"))
    summary = {"quick": quick, "results": project_relative(results),
               "passed": all(r["passed"] for r in rows),
               "failed": [r["name"] for r in rows if not r["passed"]],
               "wall_s": round(time.perf_counter() - start, 1),
               "experiments": rows, **machine}
    write_result(results / "reproduce.json", summary)
    return summary
