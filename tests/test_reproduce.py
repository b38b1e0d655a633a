"""experiments.reproduce: a tiny --only run end to end, and the runner's bookkeeping.

References: the issue's list of experiments that feed README tables, the committed README
(which a quick run must not touch), and stand-in experiments (`python -c ...`) that fail or
write a result, for what the runner does after a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.reporting import runner
from experiments.reporting.registry import catalog, claims
from experiments.reporting.registry.experiment import NEEDS, Experiment
from experiments.reporting.tables.render import SECTIONS, documents

ROOT = Path(__file__).resolve().parent.parent
ISSUE_LIST = {"equivalence", "zero_memory", "comm_volume", "zero_release", "bench_strategies",
              "zero_table2", "quant_table", "llm_quant_table", "parity_smollm2",
              "embed_fidelity", "bench_int8", "fault_injection", "main_job"}


def _stand_in(name: str, argv: tuple[str, ...], outputs: tuple[str, ...], **fields) -> Experiment:
    """A stand-in experiment: the same command full and quick, a second each."""
    return Experiment(name=name, argv=argv, outputs=outputs, expected_s=1, quick_expected_s=1,
                      feeds="a table", **fields)


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "experiments.reproduce", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_every_table_source_is_listed():
    assert ISSUE_LIST <= set(catalog.NAMES)
    for e in catalog.EXPERIMENTS:
        assert e.expected_s > 0 and e.quick_expected_s > 0 and e.needs in (None, *NEEDS)
        if e.runs_in_torch:  # a script of the PyTorch side, run by path
            assert (ROOT / e.module).is_file() and e.quick_argv[0] == e.module and e.needs
        else:
            assert e.module.startswith("experiments.") and e.module == e.quick_argv[1]
        # A prerequisite runs first, and no experiment runs after one that does not exist.
        assert all(catalog.NAMES.index(a) < catalog.NAMES.index(e.name)
                   for a in e.after)


def test_every_results_file_a_document_shows_has_an_experiment():
    """Each table's results file and each plot the README and docs show is written by an
    experiment of the runner (a table nobody can regenerate with it would be a gap)."""
    written = {o for e in catalog.EXPERIMENTS for o in e.outputs}
    tables = {f for f, _ in SECTIONS.values()} | {"export_run_smollm2.json",
                                                  "export_run_parity.json"}
    plots = {m for doc in documents(ROOT)
             for m in re.findall(r"experiments/results/([\w.]+\.png)", doc.read_text())}
    assert {"main_job.png", "finetune_smollm2.png"} <= plots
    assert tables | plots <= written, sorted((tables | plots) - written)


def test_only_adds_prerequisites_in_order():
    names = [e.name for e in catalog.select(["export_parity", "plan"])]
    assert names.index("export_train") < names.index("export_safetensors") \
        < names.index("export_reference") < names.index("export_parity")
    assert {"export_gguf", "plan"} <= set(names) and "main_job" not in names
    assert [e.name for e in catalog.select(["quant_table"])] == ["main_job", "quant_table"]


def test_what_a_machine_lacks_is_skipped_not_failed(tmp_path, monkeypatch):
    """An experiment that needs the PyTorch environment or a GPU this machine does not have is
    skipped with the reason, so is one that runs after it; the run still passes."""
    monkeypatch.delenv("SHARDQ_TORCH_PYTHON", raising=False)
    write = ("-c", "import json, os; open(os.path.join(os.environ['SHARDQ_RESULTS_DIR'], "
                   "'ok.json'), 'w').write(json.dumps({'x': 1}))")
    torch = _stand_in("ref", ("ref.py",), ("ref.json",), needs="torch")
    later = _stand_in("later", write, ("ok.json",), after=("ref",))
    fine = _stand_in("fine", write, ("ok.json",))
    lines = []
    summary = runner.run_all([torch, later, fine], quick=True, results=tmp_path / "r",
                             runs=tmp_path / "w", say=lines.append)
    assert summary["passed"] and summary["failed"] == []
    assert "SHARDQ_TORCH_PYTHON" in summary["skipped"]["ref"]
    assert summary["skipped"]["later"] == "runs after ref, which did not pass here"
    assert [r["passed"] for r in summary["experiments"]] == [None, None, True]
    assert any("ref: skipped: needs the PyTorch environment" in line for line in lines)
    monkeypatch.setenv("SHARDQ_TORCH_PYTHON", str(tmp_path / "no-such-python"))
    assert "is not an executable file" in runner.missing_need(torch)
    monkeypatch.setenv("SHARDQ_TORCH_PYTHON", sys.executable)
    assert runner.missing_need(torch) is None
    gpu = _stand_in("gpu", write, (), needs="gpu")
    assert runner.missing_need(gpu, gpu=lambda: False).startswith("needs an NVIDIA GPU")
    assert runner.missing_need(gpu, gpu=lambda: True) is None
    peer = _stand_in("peer", write, (), needs="llama_cpp")
    monkeypatch.delenv("SHARDQ_LLAMA_CPP", raising=False)
    assert "no tools named" in runner.missing_need(peer)
    monkeypatch.setenv("SHARDQ_LLAMA_CPP", str(tmp_path))
    assert "holds no executable llama-quantize" in runner.missing_need(peer)
    for tool in runner.LLAMA_CPP_TOOLS:
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    assert runner.missing_need(peer) is None


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine")
def test_the_gpu_probe_says_no_on_a_cpu_machine():
    assert runner._backend_is_nvidia_gpu() is False


def test_an_experiment_asked_for_by_name_and_skipped_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDQ_TORCH_PYTHON", raising=False)
    proc = _run("--quick", "--only", "w8a8_crosscheck", "--results", str(tmp_path / "r"),
                "--runs", str(tmp_path / "w"), "--readme-out", str(tmp_path / "README.md"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "w8a8_crosscheck: skipped: needs the PyTorch environment" in proc.stderr
    assert "not run, though named in --only: w8a8_crosscheck" in proc.stderr
    assert not (tmp_path / "r" / "smollm2_w8a8_crosscheck.json").exists()


def test_a_training_run_is_replaced_only_in_the_runners_own_folder(tmp_path):
    """Launchers refuse to start a run over an earlier one: in a runs folder the runner made,
    the experiment's own run folder is emptied first; in someone else's it is left alone."""
    probe = ("-c", "import os, sys; d = os.path.join(sys.argv[1], 'run'); "
                   "sys.exit(3) if os.path.exists(d) else os.makedirs(d)", "{runs}")
    exp = _stand_in("trains", probe, (), fresh=("{runs}/run",))
    own, theirs = tmp_path / "own", tmp_path / "theirs"
    for _ in range(2):  # the second run finds the first one's folder
        summary = runner.run_all([exp], quick=True, results=tmp_path / "r", runs=own,
                                 say=lambda _: None)
        assert summary["passed"], summary
    (theirs / "run").mkdir(parents=True)
    (theirs / "run" / "keep.txt").write_text("someone's run")
    summary = runner.run_all([exp], quick=True, results=tmp_path / "r", runs=theirs,
                             say=lambda _: None)
    assert summary["failed"] == ["trains"]  # the launcher's refusal, and nothing deleted
    assert (theirs / "run" / "keep.txt").read_text() == "someone's run"


def test_a_pytorch_side_script_runs_under_that_interpreter_and_records_no_path(monkeypatch):
    monkeypatch.setenv("SHARDQ_TORCH_PYTHON", "/opt/ref/bin/python")
    exp = next(e for e in catalog.EXPERIMENTS if e.name == "export_reference")
    cmd = exp.command(False, ROOT / "experiments" / "results", ROOT / "runs" / "r")
    assert cmd[:2] == ["/opt/ref/bin/python", "experiments/reference/check_export_reference.py"]
    shown = exp.shown(False, ROOT / "experiments" / "results", ROOT / "runs" / "r")
    assert shown.startswith("HF_HUB_OFFLINE=1 $SHARDQ_TORCH_PYTHON experiments/")
    assert "/opt/ref" not in shown and "runs/r/exports/ft-export" in shown


def test_quick_only_runs_end_to_end_and_leaves_the_readme(tmp_path):
    docs = {p: p.read_bytes() for p in documents(ROOT)}
    committed = sorted((ROOT / "experiments" / "results").iterdir())
    stamps = {p.name: p.stat().st_mtime_ns for p in committed}
    proc = _run("--quick", "--only", "plan", "--results", str(tmp_path / "results"),
                "--runs", str(tmp_path / "runs"), "--readme-out", str(tmp_path / "README.md"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1/1] plan" in proc.stderr and "left]" in proc.stderr  # progress with time left
    result = json.loads((tmp_path / "results" / "plan_7.5b_64x32gb.json").read_text())
    assert result["recommended"]["fits"] is True
    prov = result["provenance"]
    assert prov["command"].startswith("python -m experiments.plan") and prov["quick"] is True
    assert prov["software"]["jax"] and prov["machine"]["cores"] and prov["date"]
    summary = json.loads((tmp_path / "results" / "reproduce.json").read_text())
    assert summary["passed"] and [r["name"] for r in summary["experiments"]] == ["plan"]
    # The docs are rendered beside the README copy; the planner's table lives in planning.md.
    assert (tmp_path / "README.md").read_text().startswith("# shardq")
    copy = (tmp_path / "docs" / "planning.md").read_text()
    start = copy.index("<!-- report:plan_example -->")
    assert "| 1 | **zero3** | data=1,fsdp=8 | full |" in copy[start:start + 2000]
    # The committed README, docs and results are untouched.
    assert {p: p.read_bytes() for p in documents(ROOT)} == docs
    assert {p.name: p.stat().st_mtime_ns for p in committed} == stamps


def test_a_failure_is_reported_and_the_rest_still_run(tmp_path):
    boom = ("-c", "import sys; print('bad'); sys.exit(3)")
    fail = _stand_in("boom", boom, ())
    write = ("-c", "import json, os; open(os.path.join(os.environ['SHARDQ_RESULTS_DIR'], "
                   "'ok.json'), 'w').write(json.dumps({'x': 1}))")
    ok = _stand_in("fine", write, ("ok.json",))
    lost = _stand_in("silent", ("-c", "pass"), ("none.json",))
    lines = []
    summary = runner.run_all([fail, ok, lost], quick=True, results=tmp_path / "r",
                             runs=tmp_path / "w", say=lines.append)
    rows = {r["name"]: r for r in summary["experiments"]}
    assert rows["boom"]["returncode"] == 3 and not rows["boom"]["passed"]
    assert "bad" in rows["boom"]["tail"]
    assert rows["fine"]["passed"]  # ran after the failure
    assert json.loads((tmp_path / "r" / "ok.json").read_text())["provenance"]["quick"] is True
    assert not rows["silent"]["passed"] and rows["silent"]["missing_outputs"] == ["none.json"]
    assert summary["failed"] == ["boom", "silent"] and summary["passed"] is False
    assert any("FAILED" in line for line in lines)


def test_a_partial_run_keeps_the_log_of_the_experiments_it_did_not_run(tmp_path):
    write = ("-c", "import json, os; open(os.path.join(os.environ['SHARDQ_RESULTS_DIR'], "
                   "'ok.json'), 'w').write(json.dumps({'x': 1}))")
    a = _stand_in("a", write, ("ok.json",))
    b = _stand_in("b", write, ("ok.json",))
    quiet = dict(results=tmp_path / "r", runs=tmp_path / "w", say=lambda line: None)
    runner.run_all([a, b], quick=True, **quiet)
    first = json.loads((tmp_path / "r" / "reproduce.json").read_text())
    summary = runner.run_all([b], quick=True, **quiet)  # as `--only b`
    assert [r["name"] for r in summary["experiments"]] == ["b"]
    assert [r["name"] for r in summary["earlier"]] == ["a"]
    kept = summary["earlier"][0]
    assert kept["date"] == first["experiments"][0]["date"]
    assert kept["git_commit"] == first["git_commit"] and kept["machine"] == first["machine"]
    # carried on through later partial runs; a run of it replaces it; a full run's log is
    # another kind and is not mixed in
    assert [r["name"] for r in runner.run_all([b], quick=True, **quiet)["earlier"]] == ["a"]
    assert [r["name"] for r in runner.run_all([a], quick=True, **quiet)["earlier"]] == ["b"]
    assert runner.run_all([a], quick=False, **quiet)["earlier"] == []


def test_every_claim_holds_on_the_committed_results():
    """The claims the runner checks after each experiment hold for the committed results (a
    claim written against the wrong field or sense would fail here)."""
    claimed = [e for e in catalog.EXPERIMENTS if e.claim]
    assert {"equivalence", "fault_injection", "zero_memory", "plan"} <= {e.name for e in claimed}
    committed = ROOT / "experiments" / "results"
    assert {e.name: e.claim(committed, False) for e in claimed} == \
        {e.name: None for e in claimed}


def test_a_broken_claim_fails_the_experiment(tmp_path):
    write = ("-c", "import json, os; open(os.path.join(os.environ['SHARDQ_RESULTS_DIR'], "
                   "'f.json'), 'w').write(json.dumps({'all_recovered_nothing_lost': False}))")
    exp = _stand_in(
        "faults", write, ("f.json",),
        claim=claims.holds("f.json", "nothing is lost",
                           lambda d: d["all_recovered_nothing_lost"]))
    lines = []
    summary = runner.run_all([exp], quick=True, results=tmp_path / "r",
                             runs=tmp_path / "w", say=lines.append)
    row = summary["experiments"][0]
    assert row["returncode"] == 0 and not row["passed"]
    assert row["claim_failed"] == "f.json: not true that nothing is lost"
    assert any("not true that nothing is lost" in line for line in lines)



def test_a_full_only_claim_is_left_out_of_the_quick_run(tmp_path):
    (tmp_path / "a.json").write_text('{"close": true, "within_goal": false}')
    claim = claims.holds("a.json", "it is close", lambda d: d["close"],
                         full_only=("it meets the goal", lambda d: d["within_goal"]))
    assert claim(tmp_path, True) is None
    assert claim(tmp_path, False) == "a.json: not true that it meets the goal"


def test_unknown_name_is_one_line_exit_2():
    with pytest.raises(ValueError, match="only=nope"):
        catalog.select(["nope"])
    proc = _run("--only", "nope", timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("experiments.reproduce: error: only=nope")


def test_parity_claim_needs_the_long_text_on_a_full_run(tmp_path):
    committed = json.loads((ROOT / "experiments" / "results" / "smollm2_parity.json").read_text())
    assert committed["long_text"]["tokens"] > 7000  # the committed run has it
    claim = next(e.claim for e in catalog.EXPERIMENTS if e.name == "parity_smollm2")
    long = committed["long_text"]
    for long_text, full_holds in ((None, False), (long, True),
                                  ({**long, "abs_nll_diff": 2e-4}, False),
                                  ({**long, "next_identical": False}, False)):
        d = {k: v for k, v in committed.items() if k != "long_text"}
        if long_text is not None:
            d["long_text"] = long_text
        (tmp_path / "smollm2_parity.json").write_text(json.dumps(d))
        assert (claim(tmp_path, False) is None) == full_holds, long_text
        assert claim(tmp_path, True) is None  # a quick run (--no-long) is not asked for it


def test_parity_claim_holds_the_chat_replies(tmp_path):
    """The parity claim fails when a greedy reply parts from transformers' away from a near tie
    or a chat prompt's ids differ, and still holds where the reply parts at a near tie."""
    committed = json.loads((ROOT / "experiments" / "results" / "smollm2_parity.json").read_text())
    claim = next(e.claim for e in catalog.EXPERIMENTS if e.name == "parity_smollm2")
    first = committed["chat"]["prompts"][0]
    parted = {"identical": False, "common_prefix": 3, "margin_where_parted": 0.5,
              "parted_at_near_tie": False}
    for change, holds in (({}, True), ({**parted, "margin_where_parted": 2e-4,
                                        "parted_at_near_tie": True}, True),
                          (parted, False), ({"template_identical": False}, False)):
        prompts = [{**first, **change}] + committed["chat"]["prompts"][1:]
        d = {**committed, "chat": {**committed["chat"], "prompts": prompts}}
        (tmp_path / "smollm2_parity.json").write_text(json.dumps(d))
        assert (claim(tmp_path, True) is None) == holds, change
