"""Regenerate the result tables of README.md and docs/*.md from experiments/results/*.json.

  python -m experiments.report           # rewrite the tables in README.md and docs/*.md
  python -m experiments.report --check   # exit 1 if any table is out of date
  python -m experiments.report --readme COPY.md --results DIR   # tables of another results set

Each table sits between `<!-- report:NAME -->` and `<!-- /report:NAME -->`;
experiments/reporting/tables/render.py says which results file and which renderer fill each one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.cli.config import Parser, fail
from experiments.reporting.tables.render import documents, render

PROG = "experiments.report"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readme", action="append", default=None,
                   help="a markdown file to render (repeatable; default README.md and docs/*.md)")
    p.add_argument("--check", action="store_true")
    p.add_argument("--results", default=None,
                   help="folder of results files (default experiments/results)")
    args = p.parse_args(argv)
    paths = [Path(r) for r in args.readme] if args.readme else documents()
    # Checked before anything is written: a mistyped folder would render every table as
    # missing into the documents.
    for path in paths:
        if not path.is_file():
            fail(PROG, f"readme={path}: no such file")
    if args.results and not Path(args.results).is_dir():
        fail(PROG, f"results={args.results}: no such folder")
    stale = []
    for path in paths:
        old = path.read_text()
        new = render(old, args.results) if args.results else render(old)
        if new == old:
            continue
        if args.check:
            stale.append(str(path))
        else:
            path.write_text(new)
    if stale:
        print(f"tables out of date in {', '.join(stale)}: run python -m experiments.report",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
