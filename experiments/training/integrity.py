"""Checkpoint integrity: a SHA-256 manifest per step, sealed after Orbax has finished writing it.

Orbax writes a step into a temporary folder and renames it when complete, so a crash mid-write
leaves no half step under its final name. What it cannot tell is whether a finished step was
truncated or altered afterwards, or whether the process died between the rename and our
seal. So, once a step is final, every file in it is hashed into WORKDIR/checkpoints.sha256/
<step>.json; before a restore the hashes are checked, and a step without a manifest or with a
mismatch is skipped with a warning naming it (a resumed run moves it to
WORKDIR/checkpoints.damaged/ so that it can write that step again).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

MANIFESTS = "checkpoints.sha256"


def _step_dir(workdir: Path, step: int) -> Path:
    return workdir / "checkpoints" / str(step)


def _digests(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        out[str(path.relative_to(folder))] = h.hexdigest()
    return out


def seal(workdir: Path, steps) -> None:
    """Write the manifest of every finished step that has none; drop those of deleted steps."""
    root = workdir / MANIFESTS
    root.mkdir(exist_ok=True)
    for step in steps:
        target = root / f"{step}.json"
        if not target.exists() and _step_dir(workdir, step).is_dir():  # a failed save has none
            tmp = target.with_suffix(".tmp")
            try:
                tmp.write_text(json.dumps(_digests(_step_dir(workdir, step))))
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)  # a full disk leaves no half manifest behind
    keep = {f"{s}.json" for s in steps}
    for manifest in root.glob("*.json"):
        if manifest.name not in keep:
            manifest.unlink()


def problem(workdir: Path, step: int) -> str | None:
    """Why step is not intact, or None."""
    manifest = workdir / MANIFESTS / f"{step}.json"
    if not manifest.exists():
        return "it was never sealed (the run died while or right after writing it)"
    expected = json.loads(manifest.read_text())
    found = _digests(_step_dir(workdir, step))
    for name, digest in expected.items():
        if name not in found:
            return f"{name} is missing"
        if found[name] != digest:
            return f"{name} changed since it was written"
    extra = sorted(set(found) - set(expected))
    return f"{extra[0]} was added after it was written" if extra else None


def quarantine(workdir: Path, step: int) -> Path:
    """Move a damaged step out of Orbax's sight (kept for inspection, never loaded)."""
    target = workdir / "checkpoints.damaged" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.parent.mkdir(exist_ok=True)
    os.replace(_step_dir(workdir, step), target)
    (workdir / MANIFESTS / f"{step}.json").unlink(missing_ok=True)
    return target


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
