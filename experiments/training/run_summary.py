"""A finished run's record beside its metrics: summary.json and its loss curve (summary.png),
written the same way by every launcher that trains (`train`, `main_job`)."""

from __future__ import annotations

from pathlib import Path

from experiments.reporting.plots import loss_curve
from experiments.reporting.results_io import write_result


def write_summary(workdir: str | Path, summary: dict, title: str, *, byte_tokens: bool = True,
                  also: tuple[str | Path, ...] = ()) -> list[Path]:
    """WORKDIR/summary.json (and each path in `also`) with the loss plot beside each, drawn from
    WORKDIR/metrics.jsonl in bits per byte for a byte-level run, nats per token otherwise."""
    written = []
    for path in [Path(workdir) / "summary.json", *map(Path, also)]:
        write_result(path, summary)
        plot = loss_curve(Path(workdir) / "metrics.jsonl", path.with_suffix(".png"), title,
                          per_token=not byte_tokens)
        written += [path, plot]
    return written
