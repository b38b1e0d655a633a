"""What a results file records about the run that wrote it: the machine, the software
versions, the commit (environment()), then the date and command (stamp adds them)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from experiments.reporting.results_io import PROJECT_ROOT, write_result

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's words elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """The project's checked-out commit (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _memory_gb() -> float | None:
    try:
        kb = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines()
                  if x.startswith("MemTotal"))
    except (OSError, StopIteration, ValueError):
        return None
    return round(kb * 1024 / 1e9, 1)


def environment() -> dict:
    """The machine and software a run used (a small stand-in for a shared machine helper)."""
    return {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gb": _memory_gb(),
                    "platform": platform.platform()},
        "software": {"python": platform.python_version(),
                     **{p: _version(p) for p in PACKAGES}},
        "git_commit": git_commit(),
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
