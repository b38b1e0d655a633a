"""Where experiments write their results, and the one writer they use.

A results file appears whole or not at all (written beside, then renamed), so an interrupted
experiment never leaves a half-written table source behind.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

# Where results go: the committed experiments/results/, unless SHARDQ_RESULTS_DIR names another
# folder (experiments.reproduce --quick sends a whole quick run there, so the committed results
# are never overwritten by smaller grids).
RESULTS_ENV = "SHARDQ_RESULTS_DIR"
RESULTS_DIR = (Path(os.environ[RESULTS_ENV]).resolve() if os.environ.get(RESULTS_ENV)
               else Path(__file__).resolve().parents[1] / "results")
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def project_relative(path: str | Path) -> str:
    """`path` as results record it: relative to the project root (with `..` where it lies
    outside), so a committed results file never holds the absolute paths of the machine that
    wrote it."""
    return Path(os.path.relpath(Path(path).resolve(), PROJECT_ROOT)).as_posix()


def command_line(module: str, argv: list[str] | None = None,
                 env: dict[str, str] | None = None) -> str:
    """The command a results file records: `python -m MODULE ARGS`, shell-quoted so that it runs
    as written (`argv` None: this process's arguments), after the VAR=value settings of `env`."""
    words = [*(f"{k}={v}" for k, v in (env or {}).items()),
             "python", "-m", module, *(sys.argv[1:] if argv is None else argv)]
    return shlex.join(words)


def results_path(name: str) -> Path:
    """experiments/results/NAME (the committed results the README tables come from), or NAME
    in $SHARDQ_RESULTS_DIR when that is set."""
    return RESULTS_DIR / name


def write_result(path: str | Path, data: dict, indent: int = 1) -> Path:
    """Write `data` as JSON to `path` atomically (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=indent, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:  # a failed write (a folder at `path`, a full disk) leaves no stray .tmp behind
        tmp.unlink(missing_ok=True)
    return path
