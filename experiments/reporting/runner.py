"""The runner behind experiments.reproduce: each experiment as a subprocess of its own launcher
(`python -m experiments.NAME ...`, or a PyTorch-side script under $SHARDQ_TORCH_PYTHON), so
launchers stay leaves and one failing does not stop the others; one that needs what the
machine lacks (`needs`) is skipped.

A run writes its results into one folder: the committed experiments/results/ for the full run,
another folder for --quick (SHARDQ_RESULTS_DIR points every launcher's default output there,
and the commands name it explicitly where a launcher takes --out/--record). After each
experiment its claim is checked and its results files get a "provenance" entry (machine,
software versions, date, command); reproduce.json in the folder records every experiment's
command, status, wall time and output tail (and keeps, under "earlier", the latest record of
each experiment an earlier run there ran and this one did not).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from experiments.cli.config import TORCH_PYTHON_ENV, ConfigError
from experiments.reporting.provenance import environment, stamp
from experiments.reporting.registry.experiment import Experiment, torch_python
from experiments.reporting.results_io import (
    PROJECT_ROOT,
    RESULTS_ENV,
    project_relative,
    write_result,
)
from experiments.speed import llama_cpp

# In a runs folder the runner made: its training runs may be replaced by the next run.
SCRATCH_MARK = ".reproduce-scratch"


def _backend_is_nvidia_gpu() -> bool:
    """Whether JAX, started in a subprocess (this runner never starts it), finds a CUDA GPU
    (`experiments.cli.runtime.on_nvidia_gpu`, the check the GPU launchers make)."""
    probe = "from experiments.cli.runtime import on_nvidia_gpu; print(on_nvidia_gpu())"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=300, cwd=PROJECT_ROOT)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.stdout.strip().endswith("True")


# The llama.cpp tools an experiment that `needs` llama_cpp runs.
LLAMA_CPP_TOOLS = ("llama-quantize", llama_cpp.PERPLEXITY)


def missing_need(exp: Experiment, gpu: Callable[[], bool] = _backend_is_nvidia_gpu) -> str | None:
    """Why `exp` cannot run on this machine (None: it can)."""
    if exp.needs == "torch":
        python = torch_python()
        if not python:
            return (f"needs the PyTorch environment: set ${TORCH_PYTHON_ENV} to its interpreter "
                    "(docs/testing.md)")
        if not os.access(python, os.X_OK):
            return f"${TORCH_PYTHON_ENV}={python!r} is not an executable file"
    if exp.needs == "gpu" and not gpu():
        return "needs an NVIDIA GPU (JAX's backend here is not one)"
    if exp.needs == "llama_cpp":
        try:
            tools, why = llama_cpp.locate(None, need=LLAMA_CPP_TOOLS)
        except ConfigError as e:
            return str(e)
        if tools is None:
            return why
    return None


def _fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _own_scratch(runs: Path) -> bool:
    """Whether `runs` is the runner's own folder: one it finds empty or missing it makes and
    marks as its scratch."""
    if not runs.exists() or not any(runs.iterdir()):
        runs.mkdir(parents=True, exist_ok=True)
        (runs / SCRATCH_MARK).write_text("experiments.reproduce's scratch runs: replaced by "
                                         "its next run\n")
    return (runs / SCRATCH_MARK).exists()


def _stream(cmd: list[str], env: dict, name: str, say: Callable[[str], None],
            timeout_s: float | None) -> tuple[int, list[str]]:
    """Run `cmd`, echoing its progress lines; its exit status (-1 when it could not start or
    ran out of time) and the last lines of its output."""
    tail: list[str] = []
    try:
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        for line in proc.stdout:
            line = line.rstrip("\n")
            if len(line) < 400:  # progress lines; the last-line JSON is long and kept below
                say(f"    {name}: {line}")
            tail = (tail + [line[-2000:]])[-15:]
        rc = proc.wait(timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        rc, tail = -1, tail + [f"{type(e).__name__}: {e}"]
    return rc, tail


def _run_one(exp: Experiment, *, quick: bool, results: Path, runs: Path, own_runs: bool,
             env: dict, provenance: dict, say: Callable[[str], None],
             timeout_s: float | None) -> dict:
    """Run one experiment, check its outputs and its claim, and stamp its results files with
    `provenance` (the machine, date and command) plus the wall time; returns its record."""
    for folder in exp.fresh_folders(runs) if own_runs else ():
        shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    rc, tail = _stream(exp.command(quick, results, runs), {**env, **dict(exp.env)}, exp.name,
                       say, timeout_s)
    wall = time.perf_counter() - t0
    missing = [o for o in exp.outputs if not (results / o).exists()]
    broken = exp.claim(results, quick) if exp.claim and rc == 0 and not missing else None
    ok = rc == 0 and not missing and broken is None
    provenance = {**provenance, "wall_s": round(wall, 1), "quick": quick}
    if exp.runs_in_torch:  # not this environment's packages: the file names its own
        provenance["software"] = {"interpreter": f"${TORCH_PYTHON_ENV}"}
    for o in exp.outputs:
        if o.endswith(".json") and (results / o).exists() and rc == 0:
            stamp(results / o, provenance)
    say(f"    {exp.name}: {'passed' if ok else 'FAILED'} in {_fmt(wall)}"
        + ("" if ok else f" (exit {rc}" + (f", missing {', '.join(missing)}" if missing
                                            else "") + (f"; {broken}" if broken else "")
           + ")"))
    return {"name": exp.name, "feeds": exp.feeds, "command": provenance["command"],
            "date": provenance["date"], "returncode": rc, "passed": ok, "wall_s": round(wall, 1),
            "outputs": list(exp.outputs), "missing_outputs": missing, "claim_failed": broken,
            "tail": tail if not ok else tail[-3:]}


def run_all(experiments: list[Experiment], *, quick: bool, results: Path, runs: Path,
            say: Callable[[str], None] = print, timeout_s: float | None = None) -> dict:
    """Run each experiment in turn (a failure is recorded and the next one runs); returns the
    summary also written to results/reproduce.json. An experiment's `fresh` folders are emptied
    first only where `runs` is the runner's own (it made the folder); elsewhere an earlier run
    there stays, and its launcher refuses to start over it."""
    results, runs = Path(results).resolve(), Path(runs).resolve()
    results.mkdir(parents=True, exist_ok=True)
    own_runs = _own_scratch(runs)
    env = {**os.environ, RESULTS_ENV: str(results),
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    # What this machine lacks is known before anything runs: those take no time.
    gpu = functools.cache(_backend_is_nvidia_gpu)
    lacking = {e.name: missing_need(e, gpu) for e in experiments}
    expected = [0 if lacking[e.name] else e.quick_expected_s if quick else e.expected_s
                for e in experiments]
    say(f"{len(experiments)} experiments ({sum(map(bool, lacking.values()))} of them skipped "
        f"here: see below), expected about {_fmt(sum(expected))} on a 2-core CPU; results in "
        f"{results}")
    machine = environment()
    start = time.perf_counter()
    rows: list[dict] = []
    passed: set[str] = set()
    for i, exp in enumerate(experiments):
        shown = exp.shown(quick, results, runs)
        say(f"[{i + 1}/{len(experiments)}] {exp.name} ({exp.feeds}): {shown}  "
            f"[elapsed {_fmt(time.perf_counter() - start)}, about {_fmt(sum(expected[i:]))} "
            f"left]")
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        not_run = [a for a in exp.after if a not in passed]
        skipped = lacking[exp.name] or (
            f"runs after {', '.join(not_run)}, which did not pass here" if not_run else None)
        if skipped:
            rows.append({"name": exp.name, "feeds": exp.feeds, "command": shown, "date": date,
                         "skipped": skipped, "passed": None, "outputs": list(exp.outputs)})
            say(f"    {exp.name}: skipped: {skipped}")
            continue
        rows.append(_run_one(exp, quick=quick, results=results, runs=runs, own_runs=own_runs,
                             env=env, provenance={**machine, "date": date, "command": shown},
                             say=say, timeout_s=timeout_s))
        if rows[-1]["passed"]:
            passed.add(exp.name)
    summary = _summary(rows, quick=quick, results=results, wall_s=time.perf_counter() - start,
                       machine=machine)
    write_result(results / "reproduce.json", summary)
    return summary


def _summary(rows: list[dict], *, quick: bool, results: Path, wall_s: float,
             machine: dict) -> dict:
    """reproduce.json: the run's verdict and every experiment's record. A skipped experiment
    (passed: None) is neither passed nor failed: the summary names it apart."""
    return {"quick": quick, "results": project_relative(results),
            "passed": all(r["passed"] is not False for r in rows),
            "failed": [r["name"] for r in rows if r["passed"] is False],
            "skipped": {r["name"]: r["skipped"] for r in rows if r.get("skipped")},
            "wall_s": round(wall_s, 1),
            "experiments": rows, **machine,
            "earlier": earlier_records(results / "reproduce.json", rows, quick)}


def earlier_records(log: Path, rows: list[dict], quick: bool) -> list[dict]:
    """The latest record of every experiment that the folder's previous reproduce.json holds
    (its own run's or its "earlier" ones) and this run did not run, each with the commit and
    the machine of its run: a run of a few experiments (`--only`) keeps the log of the others,
    whose results files it leaves in place. Nothing from a log of the other kind (quick or
    full), or one that is unreadable."""
    try:
        old = json.loads(log.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict) or old.get("quick") != quick:
        return []
    ran = {r["name"] for r in rows}
    own = [{"git_commit": old.get("git_commit"), "machine": old.get("machine"), **r}
           for r in old.get("experiments", []) if isinstance(r, dict)]
    kept: dict[str, dict] = {}
    for r in own + [r for r in old.get("earlier", []) if isinstance(r, dict)]:
        if r.get("name") not in ran:
            kept.setdefault(r.get("name"), r)  # the previous run's record before older ones
    return list(kept.values())
