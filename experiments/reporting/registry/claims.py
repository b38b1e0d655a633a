"""How an experiment's claim is written: a test on one results file, and the helpers the
tests share."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from experiments.reporting.registry.experiment import Claim


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def holds(name: str, what: str, test: Callable[[dict], bool],
          full_only: tuple[str, Callable[[dict], bool]] | None = None,
          ) -> Claim:
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


def perplexity(d: dict, quant: str) -> float:
    """A mode's perplexity in a SmolLM2 table (KeyError when it is not there)."""
    for r in d["rows"]:
        if r["quant"] == quant:
            return r["perplexity"]
    raise KeyError(quant)
