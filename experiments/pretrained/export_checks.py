"""The export's output folder, checked without JAX: `experiments.export` refuses a bad --out
before it starts the runtime, and `exporter.export` checks the same way again."""

from __future__ import annotations

from pathlib import Path

from experiments.cli.config import ConfigError, check_output_folder


def check_out(out: str | Path, force: bool) -> Path:
    """`out` as a Path: a folder the export may write (an existing non-empty one only with
    `force`; ConfigError, one line, otherwise)."""
    check_output_folder("out", out, "the export")
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"out={str(out)!r}: exists and is not empty; pass --force to "
                          f"replace it")
    return out
