"""Every launcher, every value-taking flag, a generated bad value: one line naming the flag, exit 2,
and the refusal comes before start-up (so before any compile and before anything is written).

Each launcher runs in a child process through tests/flag_probe.py, which stands in for
`experiments.cli.startup`: a bad value the launcher lets through ends the run where JAX would
start, and the test says which. The values: a word where a number goes, a negative count, NaN
where a float goes, an unknown name where a fixed set of names goes, and a path below a regular
file (no such file can be read, and no file or folder can be made there).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, child_env

# One worker runs every test of this module, so the module fixture's two child processes run
# once per session (`--dist loadgroup` in pyproject.toml), not once per xdist worker.
pytestmark = pytest.mark.xdist_group("launcher_flags")

LAUNCHERS = sorted(
    f"experiments.{p.stem}" for p in (Path(ROOT) / "experiments").glob("*.py")
    if 'if __name__ == "__main__":' in p.read_text())
PROBE = str(Path(__file__).with_name("flag_probe.py"))

# Flags whose value may be any integer (a negative one included).
ANY_INT = {"seed", "alpha_seed", "rotation_seed", "perturb_seed"}
# Flags that take one of a fixed set of names, checked by the launcher or by argparse.
NAMED = {"quant", "mode", "modes", "preset", "presets", "stages", "stage", "format", "corpus",
         "strategy", "strategies", "mlp", "attention", "dtype", "param_dtype", "compute_dtype",
         "model", "only", "remat", "layout", "variants", "kinds"}
# Flags that name a file or folder to read or write.
# What a launcher needs beside the bad flag to get as far as checking it ({scratch}: a scratch
# folder). The launchers that read a training run refuse before it without one; for them the
# test asks only for one line, exit 2 and no traceback.
BASE = {"experiments.train": ["--workdir", "{scratch}/runs/new"],
        "experiments.chat": ["--prompt", "Hi"],
        "experiments.export": ["--model", "smollm2", "--out", "{scratch}/exported"],
        "experiments.launch_local": ["--processes", "2"],
        "experiments.convert_minilm": ["--out", "{scratch}/minilm"],
        "experiments.w8a8_crosscheck": ["--torch-python", sys.executable]}
NEEDS_A_RUN = {"experiments.evaluate", "experiments.sample", "experiments.quantize",
               "experiments.quant_table"}
PATHY = re.compile(r"(^|_)(out|workdir|dir|data|record|fixture|gguf|cache|path|file|results|"
                   r"runs|init|python|request|readme_out)($|_)")


def _probe(args: list[str], scratch: Path) -> dict:
    """tests/flag_probe.py in `scratch` (a copy of README.md and docs/), results sent there too:
    a value a launcher wrongly accepts writes nothing of the project's."""
    env = {**child_env(), "SHARDQ_RESULTS_DIR": str(scratch / "results"), "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, PROBE, *args], capture_output=True, text=True,
                          env=env, cwd=scratch, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def bad_values(row: dict, tmp: Path) -> list[str]:
    """Generated bad values for one flag (none for a flag this generator cannot judge)."""
    dest, kind = row["dest"], row["type"]
    if kind == "int":
        return ["abc"] + ([] if dest in ANY_INT else ["-1"])
    if kind == "float":
        return ["abc", "nan"]
    if row["choices"] is not None or dest in NAMED:
        return ["no-such-name"]
    if PATHY.search(dest):
        return [str(tmp / "a_file" / "below")]
    return []


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict:
    """Every launcher's --help and generated bad values, run in two child processes (one reads
    the flags, one runs the cases): {launcher: [(flag row or None for --help, result)]}."""
    scratch = tmp_path_factory.mktemp("scratch")
    shutil.copy(Path(ROOT) / "README.md", scratch)
    shutil.copytree(Path(ROOT) / "docs", scratch / "docs")
    (scratch / "results").mkdir()
    (scratch / "a_file").write_text("a regular file: nothing lies below it\n")
    flags = _probe(["--actions", *LAUNCHERS], scratch)
    cases, rows = {}, {}
    for launcher in LAUNCHERS:
        base = [a.replace("{scratch}", str(scratch)) for a in BASE.get(launcher, [])]
        cases[launcher], rows[launcher] = [["--help"]], [None]
        for row in flags[launcher]:
            for value in bad_values(row, scratch):
                cases[launcher].append([*base, f"{row['flag']}={value}"])
                rows[launcher].append(row)
    before = _snapshot(scratch)
    results = _probe([json.dumps(cases)], scratch)
    assert _snapshot(scratch) == before  # nothing written, nothing changed
    return {name: list(zip(rows[name], results[name], strict=True)) for name in LAUNCHERS}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_help_and_generated_bad_values_end_in_one_line(launcher, probed):
    (_, helped), *bad = probed[launcher]
    assert helped["code"] == 0 and "usage" in helped["stdout"].lower(), helped
    problems = []
    for row, res in bad:
        said = res["stderr"].strip()
        flag = row["flag"].lstrip("-")
        names = {row["dest"], row["dest"].replace("_", "-"), flag, flag.replace("-", "_")}
        if res["traceback"]:
            problems.append(f"{res['argv']}: traceback {res['traceback'].splitlines()[-1]}")
        elif res["started"]:
            problems.append(f"{res['argv']}: accepted, reached start-up")
        elif res["code"] != 2:
            problems.append(f"{res['argv']}: exit {res['code']}")
        elif len(said.splitlines()) != 1:
            problems.append(f"{res['argv']}: {len(said.splitlines())} lines on stderr")
        elif launcher not in NEEDS_A_RUN and not any(n in said for n in names):
            problems.append(f"{res['argv']}: the line names no flag: {said}")
    assert not problems, "\n".join(problems)
