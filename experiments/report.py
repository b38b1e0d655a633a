"""Regenerate the README's result tables from experiments/results/*.json.

  python -m experiments.report           # rewrite the tables in README.md
  python -m experiments.report --check   # exit 1 if any table is out of date
  python -m experiments.report --readme COPY.md --results DIR   # tables of another results set

Each table sits between `<!-- report:NAME -->` and `<!-- /report:NAME -->`; experiments/tables.py
says which results file and which renderer fill each one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.tables import render


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="experiments.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readme", default="README.md")
    p.add_argument("--check", action="store_true")
    p.add_argument("--results", default=None,
                   help="folder of results files (default experiments/results)")
    args = p.parse_args(argv)
    path = Path(args.readme)
    old = path.read_text()
    new = render(old, args.results) if args.results else render(old)
    if args.check:
        if new != old:
            print(f"{path} tables are out of date: run python -m experiments.report",
                  file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
