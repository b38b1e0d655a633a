"""One experiment of the runner: which launcher it runs with which arguments (full and quick),
what it writes, how long it takes, what it needs and what its table claims."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path

from experiments.cli.config import TORCH_PYTHON_ENV
from experiments.reporting.results_io import project_relative

# What an experiment may need beyond this project's environment (see runner.missing_need).
NEEDS = ("torch", "gpu", "llama_cpp")

# A claim: the results folder and whether the run was quick -> None when it holds, else a line
# saying what does not.
Claim = Callable[[Path, bool], str | None]


def torch_python() -> str | None:
    """$SHARDQ_TORCH_PYTHON as an absolute path (experiments run from the project root)."""
    python = os.environ.get(TORCH_PYTHON_ENV)
    return os.path.abspath(python) if python else None


def launcher(name: str, *args: str) -> tuple[str, ...]:
    """The argv that runs launcher `experiments.NAME` with `args`."""
    return ("-m", f"experiments.{name}", *args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
    """One launcher invocation. In argv, {results} is the results folder and {runs} a scratch
    folder for training runs; `outputs` are the results files it writes (in {results})."""

    name: str
    argv: tuple[str, ...]
    # The quick run's command; None: the same as argv (a step whose input is already the
    # quick run's smaller one).
    quick_argv: tuple[str, ...] | None = None
    outputs: tuple[str, ...]
    expected_s: float  # full run, on the 2-core CPU machine
    quick_expected_s: float
    feeds: str  # which README table(s) or plot
    # What the table claims, checked on the results folder after a run (full or quick). None
    # for measurements (speeds) that make no claim a shared machine could check.
    claim: Claim | None = None
    # What it needs beyond this project's environment, one of NEEDS; without it the experiment
    # is skipped with the reason (its table keeps the committed figures) instead of failing.
    needs: str | None = None
    # Experiments that write what this one reads (a training run in {runs}): `select` adds
    # them, and this one is skipped when one of them did not pass.
    after: tuple[str, ...] = ()
    # Environment variables set for this experiment alone.
    env: tuple[tuple[str, str], ...] = ()
    # Folders in {runs} it writes anew (a training run): emptied before it runs, since the
    # launchers refuse to start a run over an earlier one and the runner's scratch is its own.
    fresh: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.quick_argv is None:
            object.__setattr__(self, "quick_argv", self.argv)

    def command(self, quick: bool, results: Path, runs: Path) -> list[str]:
        # Project-relative paths (the commands run from the project root): results files
        # record their command, and a committed one must not hold this machine's paths.
        args = self.quick_argv if quick else self.argv
        res, run = project_relative(results), project_relative(runs)
        # A script of the PyTorch side runs under that environment's interpreter, by path.
        python = (torch_python() or "") if self.runs_in_torch else sys.executable
        return [python, *(a.replace("{results}", res).replace("{runs}", run) for a in args)]

    def fresh_folders(self, runs: Path) -> list[Path]:
        return [Path(runs) / f.removeprefix("{runs}/") for f in self.fresh]

    @property
    def runs_in_torch(self) -> bool:
        # Our launchers run as modules (-m); a script path is the PyTorch side's.
        return self.argv[0].endswith(".py")

    @property
    def module(self) -> str:
        """The launcher: a module of ours (`experiments.NAME`), or the PyTorch-side script."""
        return self.argv[0] if self.runs_in_torch else self.argv[1]

    def shown(self, quick: bool, results: Path, runs: Path) -> str:
        """The command as results record it: no machine's interpreter path."""
        cmd = self.command(quick, results, runs)
        env = "".join(f"{k}={v} " for k, v in self.env)
        python = f"${TORCH_PYTHON_ENV}" if self.runs_in_torch else "python"
        return env + " ".join([python, *cmd[1:]])
