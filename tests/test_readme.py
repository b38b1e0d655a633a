"""The README's promises: its two commands, and tables regenerated from experiments/results."""

import json
import re
import subprocess
from pathlib import Path

from experiments.reporting.tables import render as report
from experiments.reporting.tables.headline import headline, headline_gpu

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_starts_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    setup_and_main, setup_and_tests = blocks[0], blocks[1]
    assert README.index("```bash") < README.index("\n## ")  # before any section
    assert "pip install" in setup_and_main and "experiments.main_job" in setup_and_main
    assert "pip install" in setup_and_tests and "pytest" in setup_and_tests
    # .ci/run extracts and runs exactly this command.
    awk = re.search(r"test_cmd=\$\(awk '(.*?)' README.md\)", (ROOT / ".ci" / "run").read_text())
    extracted = subprocess.run(["awk", awk.group(1), "README.md"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    assert extracted == setup_and_tests


def test_readme_tables_come_from_the_results_files(monkeypatch):
    """Every table of README.md and docs/*.md is what the results files say, and every table
    the report knows appears in exactly one document."""
    monkeypatch.chdir(ROOT)
    texts = {p: p.read_text() for p in report.documents(ROOT)}
    for path, text in texts.items():
        assert report.render(text) == text, f"{path} is stale: run python -m experiments.report"
    for name in [*report.SECTIONS, *report.MULTI_FILE]:
        homes = [p.name for p, t in texts.items() if f"<!-- report:{name} -->" in t]
        assert len(homes) == 1, f"table {name} appears in {homes or 'no document'}"


def test_nothing_reads_pickle():
    """Checkpoints and weights are read only through Orbax, safetensors and JSON."""
    pattern = re.compile(r"^\s*(import pickle|from pickle|import dill|import cloudpickle)|"
                         r"allow_pickle\s*=\s*True|torch\.load\(", re.M)
    offenders = [str(p.relative_to(ROOT)) for folder in ("model", "parallel", "quant",
                                                          "experiments")
                 for p in (ROOT / folder).rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_relative_links_resolve():
    """Links and images in README.md and docs/*.md point at files that exist (docs/ is one
    level down, so its links to the results start with ../)."""
    broken = []
    for path in report.documents(ROOT):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []


def test_headline_table_survives_a_smaller_results_set(tmp_path):
    """reproduce --quick renders the README from smaller grids: a headline row whose cells are
    missing says so instead of failing the whole render."""
    (tmp_path / "zero_memory.json").write_text(json.dumps({"results": [
        {"params": "7.5b", "n_devices": 64, "stage": "zero3", "model_state_gb": 1.9,
         "paper_gb": 1.875}]}))
    (tmp_path / "comm_volume.json").write_text(json.dumps({"results": [
        {"strategy": "dp", "volume_psi": 2.0}, {"strategy": "zero3", "volume_psi": 2.9}]}))
    table = headline(tmp_path)
    assert "not in this results set" in table and "2.00 / 2.90 Ψ" in table
    assert "no bench_train.json yet" in table


def test_headline_names_the_host_and_commit_of_each_row(tmp_path):
    """The headline joins figures from different runs: each row names the host and commit its
    own results file's provenance records (a control: another provenance, another cell), and
    "—" for a file without one."""
    d = json.loads((ROOT / "experiments" / "results" / "comm_volume.json").read_text())

    def cells(provenance: dict | None) -> list[str]:
        data = {k: v for k, v in d.items() if k != "provenance"}
        if provenance is not None:
            data["provenance"] = provenance
        (tmp_path / "comm_volume.json").write_text(json.dumps(data))
        table = headline(tmp_path).splitlines()
        assert table[0].endswith("| from | host | commit |")
        row = next(line for line in table if "`comm_volume.json`" in line)
        return [c.strip() for c in row.split("|")[1:-1]][-2:]

    xeon = {"machine": {"cpu": "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", "cores": 16},
            "git_commit": "0123456789abcdef0123456789abcdef01234567"}
    epyc = {"machine": {"cpu": "AMD EPYC 9R14 96-Core Processor", "cores": 2},
            "git_commit": "fedcba9876543210fedcba9876543210fedcba98"}
    assert cells(xeon) == ["Intel Xeon Platinum 8375C, 16 cores", "`0123456`"]
    assert cells(epyc) == ["AMD EPYC 9R14, 2 cores", "`fedcba9`"]
    assert cells(None) == ["—", "—"]


def test_gpu_headline_is_a_table_of_its_own(tmp_path):
    """The CPU headline comes from one host; the GPU's rows, from another machine, render in
    their own table and never in the CPU one."""
    (tmp_path / "bench_gpu.json").write_text(json.dumps({
        "machine": {"backend": "gpu", "device_kind": "NVIDIA H100"},
        "training": [{"strategy": "dp", "remat": "full", "attention": "xla", "mfu": 0.25,
                      "peak_flops_per_device": 1e15}],
        "matmuls": [{"n": 4096, "bf16_tflops": 600.0}]}))
    cpu, gpu = headline(tmp_path), headline_gpu(tmp_path)
    assert "bench_gpu.json" not in cpu
    row = next(line for line in gpu.splitlines() if "`bench_gpu.json`" in line)
    assert "MFU 25.0%" in row and "60% of the chip's peak" in row and "| NVIDIA H100 |" in row
