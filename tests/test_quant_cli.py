"""The int8 launchers as a user runs them: quantize -> evaluate/sample --quant, and bad input
(one-line error, exit 2, nothing written)."""

import json
import os
import shutil

import pytest

from tests.helpers import cli, cli_in_one_process, one_line_error

# One worker runs this module and test_run_journeys.py: they read the same finished run
# (conftest.tiny_byte_run), trained once per session.
pytestmark = pytest.mark.xdist_group("tiny_byte_run")


@pytest.fixture(scope="module")
def trained(tiny_byte_run):
    return tiny_byte_run[0]


def test_quantize_then_evaluate_and_sample(trained):
    proc = cli("quantize", "--workdir", str(trained), "--mode", "w8a8-static",
               "--calib-batches", "2")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    out = trained / "quant" / "w8a8-static"
    assert set(os.listdir(out)) == {"ckpt", "report.json"}
    report = json.loads((out / "report.json").read_text())
    # 6 Dense layers in each of 2 blocks, and the embedding (the default rules take it)
    assert report["calibration"]["batches"] == 2 and len(report["layers"]) == 6 * 2 + 1
    assert summary["param_bytes"] < summary["float_param_bytes"]

    proc = cli("evaluate", "--workdir", str(trained), "--quant", "w8a8-static", "--json",
               "--strategy", "zero3")
    assert proc.returncode == 0, proc.stderr
    ev = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ev["quant_source"] == "checkpoint" and ev["param_bytes"] == summary["param_bytes"]
    assert {"val_loss", "bits_per_byte", "quantized_fraction"} <= set(ev)
    assert 0.5 < ev["quantized_fraction"] < 1

    proc = cli("sample", "--workdir", str(trained), "--quant", "w8a8-static",
               "--max-new-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["text"].startswith("def ")

    # A checkpoint folder copied under another mode's name is refused, not evaluated as that mode.
    shutil.copytree(out, trained / "quant" / "w8a8")
    proc = cli("evaluate", "--workdir", str(trained), "--quant", "w8a8", "--json")
    shutil.rmtree(trained / "quant" / "w8a8")
    assert proc.returncode == 2 and "holds a 'w8a8-static' checkpoint, not 'w8a8'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_outliers_beyond_the_capacity_are_warned_about(trained):
    """Every column reaches a tiny threshold; a capacity of one column: a warning per layer, and
    still a checkpoint (the surplus columns go through int8)."""
    proc = cli("quantize", "--workdir", str(trained), "--mode", "w8a8-outlier",
               "--outlier-threshold", "1e-6", "--outlier-capacity", "0.001", "--calib-batches", "1")
    assert proc.returncode == 0, proc.stderr
    warned = [ln for ln in proc.stderr.splitlines() if "warning:" in ln]
    assert len(warned) == 6 * 2 and all("raise --outlier-capacity" in ln for ln in warned)
    assert (trained / "quant" / "w8a8-outlier" / "ckpt").is_dir()


# Refused from the flags alone, before JAX starts: run in one process (`refused`).
EARLY = [
    (["--mode", "w4a4"], ["mode='w4a4'", "w8a8"]),
    (["--mode", "w8a8", "--calib-batches", "0"], ["calib_batches=0", "1..1024"]),
    (["--mode", "w8a8", "--calib-batches", "1025"], ["calib_batches=1025", "1..1024"]),
    (["--mode", "smoothquant", "--alpha", "1.5"], ["alpha=1.5", "[0, 1]"]),
    (["--mode", "w8a8", "--alpha", "0.5"], ["alpha=0.5", "only for the modes that smooth"]),
]
HELP = ["quantize", "quant_table", "bench_int8"]


def quant_folders(run):
    return set(os.listdir(run / "quant")) if (run / "quant").exists() else set()


@pytest.fixture(scope="module")
def refused(trained, tmp_path_factory):
    """EARLY's quantize refusals on the trained run, evaluate's and quantize's refusals on
    folders that hold no run, and HELP's --help, in one process
    (tests/helpers.cli_in_one_process): ({case: proc}, the scratch folder, the run's quant/
    folders before and after)."""
    tmp = tmp_path_factory.mktemp("refused")
    cases = {i: ("quantize", ["--workdir", str(trained), *args])
             for i, (args, _) in enumerate(EARLY)}
    cases["evaluate int4"] = ("evaluate", ["--workdir", str(tmp), "--quant", "int4"])
    cases["quantize no run"] = ("quantize", ["--workdir", str(tmp / "none"), "--mode", "w8"])
    cases.update({module: (module, ["--help"]) for module in HELP})
    before = quant_folders(trained)
    procs = cli_in_one_process(list(cases.values()))
    return dict(zip(cases, procs, strict=True)), tmp, before, quant_folders(trained)


@pytest.mark.parametrize("case", range(len(EARLY)), ids=[a[0][-1] for a in EARLY])
def test_bad_input_exits_2_and_writes_nothing(refused, case):
    procs, _, before, after = refused
    one_line_error(procs[case], *EARLY[case][1])
    assert after == before


def test_a_rule_that_selects_nothing_exits_2_and_writes_nothing(trained):
    before = quant_folders(trained)
    one_line_error(cli("quantize", "--workdir", str(trained), "--mode", "w8a8", "--include",
                       "nothing/*"), "select no module")
    assert quant_folders(trained) == before


def test_evaluate_refuses_unknown_mode_and_missing_run(refused):
    procs, tmp, _, _ = refused
    one_line_error(procs["evaluate int4"], "quant='int4'")
    one_line_error(procs["quantize no run"], "no config.json")
    assert not (tmp / "none").exists()


@pytest.mark.parametrize("module", HELP)
def test_help(refused, module):
    proc = refused[0][module]
    assert proc.returncode == 0 and "--" in proc.stdout
