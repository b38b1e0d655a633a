"""What every table renderer shares: the results folder, loading a results file, a markdown
header, and the cells several tables format alike."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.reporting.results_io import RESULTS_DIR

RESULTS = RESULTS_DIR
SHOWN = "experiments/results"  # how the README names that folder
# The ZeRO stages, in the paper's column order.
STAGE_ORDER = ("dp", "zero1", "zero2", "zero3")


def load(name: str, results: Path = RESULTS) -> dict | None:
    """Results file `name` of folder `results` as JSON (None while it does not exist)."""
    path = Path(results) / name
    return json.loads(path.read_text()) if path.exists() else None


def head(*columns: str) -> list[str]:
    """A markdown table's header and separator lines."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def divergence(r: dict, kl: str = ".4f", top1: str = ".1%") -> str:
    """A row's mean KL from float and top-1 agreement as two cells ('–' where not measured:
    the float row, and files written before the measurement existed)."""
    dv = r.get("divergence")
    return f"{dv['kl_mean']:{kl}} | {dv['top1_agree']:{top1}}" if dv else "– | –"


def cell(text: str, width: int = 70) -> str:
    """`text` as one markdown table cell: one line, at most `width` characters, no pipes."""
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= width else text[:width - 1] + "…"
