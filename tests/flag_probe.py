"""Runs launchers as `python -m` would, many times in one process, and says how each run ended.

Used by tests/test_launcher_flags.py in a child process (never imported by a test): for each
argv it runs the launcher module as __main__ and reports the exit code, what it printed to
stderr and whether it raised. `experiments.cli.startup` is replaced by a stand-in that stops the
run where JAX would start, so a value the launcher accepts ends as "started" instead of running
a job: what the test checks is the part before start-up, where every flag must be checked. So
that an accepted value harms nothing either, starting a subprocess ends the run the same way, and
the test runs the probe in a scratch folder with SHARDQ_RESULTS_DIR pointing into it.

  python tests/flag_probe.py '{"experiments.score": [["--help"], ["--layers", "x"]]}'
  python tests/flag_probe.py --actions experiments.score ...   # each one's flags, as JSON
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: the project root

from experiments.cli import runtime, startup  # noqa: E402


class Started(Exception):
    """The launcher reached start-up: every flag it checks up front had passed."""


def _stop(*_args, **_kwargs):
    raise Started


def _actions(parser: argparse.ArgumentParser) -> list[dict]:
    rows = []
    for a in parser._actions:
        if not a.option_strings or a.nargs == 0 or isinstance(a, argparse._HelpAction):
            continue
        kind = getattr(a.type, "__name__", None) if a.type is not None else None
        if kind is None and isinstance(a.default, bool):
            kind = "bool"
        elif kind is None and isinstance(a.default, (int, float)):
            kind = type(a.default).__name__
        rows.append({"flag": max(a.option_strings, key=len), "dest": a.dest, "type": kind,
                     "choices": None if a.choices is None else [str(c) for c in a.choices],
                     "default": a.default if isinstance(a.default, (int, float, str)) else None,
                     "nargs": a.nargs if isinstance(a.nargs, (int, str)) else None,
                     "required": a.required})
    return rows


def actions(launcher: str) -> list[dict]:
    """The value-taking flags of the launcher's first parser, read when it parses."""
    found: list[dict] = []
    real = argparse.ArgumentParser.parse_known_args

    def grab(self, args=None, namespace=None):
        found.extend(_actions(self))
        raise Started

    argparse.ArgumentParser.parse_known_args = grab
    try:
        run(launcher, [])
    finally:
        argparse.ArgumentParser.parse_known_args = real
    return found


def run(launcher: str, argv: list[str]) -> dict:
    err = io.StringIO()
    printed = io.StringIO()
    out = {"argv": argv, "code": None, "stderr": "", "traceback": None, "started": False}
    sys.argv = [launcher, *argv]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(printed):
        try:
            runpy.run_module(launcher, run_name="__main__", alter_sys=True)
            out["code"] = 0
        except Started:
            out["started"] = True
        except SystemExit as e:
            out["code"] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - the point is to report any other ending
            out["traceback"] = traceback.format_exc()
    out["stderr"] = err.getvalue()
    out["stdout"] = printed.getvalue()[:4000]
    return out


def main() -> None:
    startup.begin = _stop
    startup.load = _stop
    runtime.start = _stop  # a launcher that starts the runtime itself stops there too
    subprocess.run = subprocess.Popen = _stop  # as does one that would start another process
    if sys.argv[1] == "--actions":
        print(json.dumps({name: actions(name) for name in sys.argv[2:]}))
        return
    req = json.loads(sys.argv[1])
    print(json.dumps({name: [run(name, case) for case in cases] for name, cases in req.items()}))


if __name__ == "__main__":
    main()
