"""Re-measure every table and plot of README.md and docs/ with one command.

  python -m experiments.reproduce                 # full run: experiments/results/, README.md
  python -m experiments.reproduce --quick         # smaller grids, runs/reproduce-quick/
  python -m experiments.reproduce --quick --only plan zero_memory

Runs each experiment of experiments/reporting/registry/ (pinned commands, one subprocess of its
launcher each) in order, printing which one runs, its progress and the time left (from the
expected times, stated up front). A failed experiment is reported and the others still run; the
exit status is 0 only if every one that ran passed and none named in --only was skipped. Each
results file gets its provenance (machine, software versions, date, command) and reproduce.json
in the results folder lists every run.

Then the tables are regenerated: the full run rewrites README.md and docs/*.md from
experiments/results/; --quick writes its results to runs/reproduce-quick/results/ (never over
the committed ones) and renders copies from them to runs/reproduce-quick/README.md and
runs/reproduce-quick/docs/, checking that the copies are consistent with them.
--results/--runs/--readme-out override the folders (the docs/ copies go beside --readme-out).

After each experiment the runner checks the claim its table makes on the results it wrote
(each registry entry's `claim`), in the quick run too: an experiment whose claim fails counts
as failed.

Some experiments need what this project does not install: the PyTorch side (set
$SHARDQ_TORCH_PYTHON to the reference environment's interpreter, docs/testing.md), llama.cpp's
tools (set $SHARDQ_LLAMA_CPP to their folder, docs/decoding_and_gpu.md) or an NVIDIA GPU.
Without it they are skipped, with the reason, and not re-measured (a full run leaves their
committed results as they are); so is an experiment whose prerequisite (a training run it
reads) did not pass. --only adds an experiment's prerequisites. The training runs go to
--runs; in the runner's own folder (the default, or one it created) each run replaces the
previous one of the same experiment.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.cli.config import ConfigError, Parser, check_output_file, check_output_folder, fail
from experiments.reporting import runner
from experiments.reporting.registry import catalog
from experiments.reporting.registry.experiment import Experiment
from experiments.reporting.results_io import PROJECT_ROOT, RESULTS_DIR
from experiments.reporting.tables.render import documents, render

PROG = "experiments.reproduce"


def _list(todo: list[Experiment]) -> None:
    """One line per experiment: name, what it feeds, what it needs or runs after, command."""
    for e in todo:
        extra = "".join(f" [{w}]" for w in (
            e.needs and f"needs {e.needs}", e.after and f"after {', '.join(e.after)}") if w)
        shown = e.shown(False, PROJECT_ROOT / "{results}", PROJECT_ROOT / "{runs}")
        print(f"{e.name:<20} {e.feeds}{extra}: {shown}")


def _regenerate(results: Path, readme_out: Path) -> bool:
    """Render README.md to `readme_out` and each docs/NAME.md to docs/NAME.md beside it, from
    `results`; whether every copy is consistent with the results."""
    consistent = True
    for doc in documents(PROJECT_ROOT):
        out = readme_out if doc == PROJECT_ROOT / "README.md" else \
            readme_out.parent / doc.relative_to(PROJECT_ROOT)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render(doc.read_text(), results))
        consistent &= render(out.read_text(), results) == out.read_text()
    return consistent


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller grids, separate folder")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help=f"run only these: {', '.join(catalog.NAMES)}")
    p.add_argument("--results", default=None, help="results folder (default: see above)")
    p.add_argument("--runs", default=None, help="scratch folder for training runs")
    p.add_argument("--readme-out", default=None,
                   help="where the regenerated README goes, docs/ beside it "
                        "(full run default: README.md)")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    args = p.parse_args(argv)
    try:
        todo = catalog.select(args.only)
    except ValueError as e:
        fail(PROG, str(e))
    if args.list:
        _list(todo)
        return 0
    base = PROJECT_ROOT / "runs" / ("reproduce-quick" if args.quick else "reproduce")
    results = Path(args.results) if args.results else (base / "results" if args.quick
                                                       else RESULTS_DIR)
    runs = Path(args.runs) if args.runs else base / "runs"
    readme_out = Path(args.readme_out) if args.readme_out else (
        base / "README.md" if args.quick else PROJECT_ROOT / "README.md")
    try:
        check_output_folder("results", results, "the results files")
        check_output_folder("runs", runs, "the training runs")
        check_output_file("readme_out", readme_out, "the regenerated README")
    except ConfigError as e:
        fail(PROG, str(e))

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    summary = runner.run_all(todo, quick=args.quick, results=results, runs=runs, say=say)

    consistent = _regenerate(results, readme_out)
    say(f"tables of README.md and docs/*.md regenerated from {results} into {readme_out} and "
        f"{readme_out.parent / 'docs'} (consistent with the results: {consistent})")
    if summary["failed"]:
        say(f"FAILED: {', '.join(summary['failed'])} (details in {results}/reproduce.json)")
    for name, why in summary["skipped"].items():
        say(f"skipped {name} (not re-measured: its tables show what {results} held before): "
            f"{why}")
    ran = len(todo) - len(summary["skipped"])
    say(f"{ran - len(summary['failed'])}/{ran} experiments passed in {summary['wall_s']:.0f} s"
        + (f", {len(summary['skipped'])} skipped" if summary["skipped"] else ""))
    # A whole run may skip what this machine lacks; an experiment asked for by name may not.
    named_skipped = [n for n in args.only or () if n in summary["skipped"]]
    if named_skipped:
        say(f"not run, though named in --only: {', '.join(named_skipped)}")
    return 0 if summary["passed"] and consistent and not named_skipped else 1


if __name__ == "__main__":
    sys.exit(main())
