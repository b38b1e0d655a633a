"""Every experiment that feeds a README table or plot, pinned, and the runner that re-measures
them (experiments.reproduce is its command line).

Each experiment runs as a subprocess of its own launcher (`python -m experiments.NAME ...`, or
a PyTorch-side script under $SHARDQ_TORCH_PYTHON), so launchers stay leaves and one failing
does not stop the others; one that needs what the machine lacks (`needs`) is skipped. A run
writes its results into one folder: the committed experiments/results/ for the full run,
another folder for --quick (the environment variable SHARDQ_RESULTS_DIR points every
launcher's default output there, and the commands below name it explicitly where a launcher
takes --out/--record). After each experiment its results files get a "provenance" entry
(machine, software versions, date, command), and reproduce.json in the folder records every
experiment's command, status, wall time and output tail (and keeps, under "earlier", the
latest record of each experiment an earlier run there ran and this one did not).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from experiments.cli.config import TORCH_PYTHON_ENV
from experiments.reporting.results_io import (
    PROJECT_ROOT,
    RESULTS_ENV,
    project_relative,
    write_result,
)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One launcher invocation. In argv, {results} is the results folder and {runs} a scratch
    folder for training runs; `outputs` are the results files it writes (in {results})."""

    name: str
    argv: tuple[str, ...]
    quick_argv: tuple[str, ...]
    outputs: tuple[str, ...]
    expected_s: float  # full run, on the 2-core CPU machine
    quick_expected_s: float
    feeds: str  # which README table(s) or plot
    # What the table claims, checked on the results folder after a run (full or quick, the
    # second argument): None when it holds, else a line saying what does not. None for
    # measurements (speeds) that make no claim a shared machine could check.
    claim: Callable[[Path, bool], str | None] | None = None
    # What it needs beyond this project's environment, one of NEEDS; without it the experiment
    # is skipped with the reason (its table keeps the committed figures) instead of failing.
    needs: str | None = None
    # Experiments that write what this one reads (a training run in {runs}): `select` adds
    # them, and this one is skipped when one of them did not pass.
    after: tuple[str, ...] = ()
    # Environment variables set for this experiment alone.
    env: tuple[tuple[str, str], ...] = ()
    # Folders in {runs} it writes anew (a training run): emptied before it runs, since the
    # launchers refuse to start a run over an earlier one and the runner's scratch is its own.
    fresh: tuple[str, ...] = ()

    def command(self, quick: bool, results: Path, runs: Path) -> list[str]:
        # Project-relative paths (the commands run from the project root): results files
        # record their command, and a committed one must not hold this machine's paths.
        args = self.quick_argv if quick else self.argv
        res, run = project_relative(results), project_relative(runs)
        # A script of the PyTorch side runs under that environment's interpreter, by path.
        python = (torch_python() or "") if self.runs_in_torch else sys.executable
        return [python, *(a.replace("{results}", res).replace("{runs}", run) for a in args)]

    def fresh_folders(self, runs: Path) -> list[Path]:
        return [Path(runs) / f.removeprefix("{runs}/") for f in self.fresh]

    @property
    def runs_in_torch(self) -> bool:
        # Our launchers run as modules (-m); a script path is the PyTorch side's.
        return self.argv[0].endswith(".py")

    @property
    def module(self) -> str:
        """The launcher: a module of ours (`experiments.NAME`), or the PyTorch-side script."""
        return self.argv[0] if self.runs_in_torch else self.argv[1]

    def shown(self, quick: bool, results: Path, runs: Path) -> str:
        """The command as results record it: no machine's interpreter path."""
        cmd = self.command(quick, results, runs)
        env = "".join(f"{k}={v} " for k, v in self.env)
        python = f"${TORCH_PYTHON_ENV}" if self.runs_in_torch else "python"
        return env + " ".join([python, *cmd[1:]])


# needs -> why an experiment cannot run here (None: it can); see `missing_need`.
NEEDS = ("torch", "gpu")


def torch_python() -> str | None:
    """$SHARDQ_TORCH_PYTHON as an absolute path (experiments run from the project root)."""
    python = os.environ.get(TORCH_PYTHON_ENV)
    return os.path.abspath(python) if python else None


def _m(name: str, *args: str) -> tuple[str, ...]:
    return ("-m", f"experiments.{name}", *args)


def _also_quick(argv: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(argv, quick_argv) of a step whose quick form is the same command (its input is already
    the quick run's smaller one)."""
    return argv, argv


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def holds(name: str, what: str, test: Callable[[dict], bool],
          full_only: tuple[str, Callable[[dict], bool]] | None = None,
          ) -> Callable[[Path, bool], str | None]:
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


def _train_speed(name: str, devices: int, *, ablate: bool, expected_s: float,
                 quick_s: float) -> Experiment:
    """bench_train on `devices`: the speed against PyTorch, or (`ablate`) each change undone."""
    file = "bench_train_changes.json" if ablate else "bench_train.json"
    args = ("--ablate", "--devices", str(devices)) if ablate else ("--devices", str(devices),
                                                                   "--json")
    out = ("--changes-out" if ablate else "--out", "{results}/" + file)
    quick = ("--preset", "tiny", "--steps", "2", "--rounds", "1", "--warmup", "1",
             *(() if ablate else ("--profile-steps", "1")))
    feeds = ("training step changes table" if ablate else "training speed vs PyTorch table")
    return Experiment(name, _m("bench_train", *args, *out), _m("bench_train", *args, *quick, *out),
                      (file,), expected_s, quick_s, f"{feeds}, {devices} device(s)",
                      needs=None if ablate else "torch")


# The main job's checkpoint feeds the int8 table, so main_job comes before quant_table.
EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment("main_job", _m("main_job", "--workdir", "{runs}/main", "--no-progress",
                              "--record", "{results}/main_job.json"),
               _m("main_job", "--workdir", "{runs}/main", "--no-progress", "--preset", "tiny",
                  "--steps", "40", "--warmup-steps", "5", "--eval-every", "40",
                  "--eval-batches", "2",
                  "--ckpt-every", "40", "--record", "{results}/main_job.json"),
               ("main_job.json", "main_job.png"), 560, 20, "main_job table, loss curve",
               fresh=("{runs}/main",)),
    Experiment("equivalence", _m("equivalence", "--devices", "8", "--steps", "20", "--json",
                                 "--out", "{results}/equivalence.json"),
               # Every strategy against one device, on 2 devices in fp32 (the claim's precision).
               _m("equivalence", "--devices", "2", "--device-counts", "2", "--precisions",
                  "float32", "--steps", "2", "--json", "--out", "{results}/equivalence.json"),
               ("equivalence.json",), 900, 60, "equivalence table"),
    Experiment("zero_memory", _m("zero_memory", "--json", "--out", "{results}/zero_memory.json"),
               _m("zero_memory", "--json", "--presets", "7.5b", "--devices", "4", "64",
                  "--stages", "dp", "zero3", "--out", "{results}/zero_memory.json"),
               ("zero_memory.json",), 330, 35, "ZeRO Table 1"),
    Experiment("comm_volume", _m("comm_volume", "--json", "--out", "{results}/comm_volume.json"),
               _m("comm_volume", "--json", "--strategies", "dp", "zero3",
                  "--out", "{results}/comm_volume.json"),
               ("comm_volume.json",), 90, 30, "communication volume table"),
    Experiment("zero_release", _m("zero_release", "--json",
                                  "--out", "{results}/zero_release.json"),
               _m("zero_release", "--json", "--strategies", "zero3", "--d-model", "256",
                  "--n-heads", "4", "--d-ff", "1024", "--out", "{results}/zero_release.json"),
               ("zero_release.json",), 150, 30, "release table"),
    Experiment("bench_strategies", _m("bench_strategies", "--preset", "small", "--devices", "8",
                                      "--json", "--out", "{results}/strategy_speed.json"),
               _m("bench_strategies", "--preset", "tiny", "--devices", "8", "--steps", "3",
                  "--warmup", "1", "--strategies", "dp,zero3", "--json",
                  "--out", "{results}/strategy_speed.json"),
               ("strategy_speed.json",), 240, 25, "step time table"),
    Experiment("zero_table2", _m("zero_table2", "--json", "--no-cache",
                                 "--out", "{results}/zero_table2.json"),
               _m("zero_table2", "--json", "--quick", "--no-cache",
                  "--out", "{results}/zero_table2.json"),
               ("zero_table2.json", "zero_table2.png"), 360, 60,
               "ZeRO Table 2 by search, planning table and plot"),
    Experiment("plan", _m("plan", "--preset", "7.5b", "--devices", "64", "--device-memory",
                          "32GB", "--no-cache", "--json",
                          "--out", "{results}/plan_7.5b_64x32gb.json"),
               _m("plan", "--preset", "tiny", "--devices", "8", "--device-memory", "4MB",
                  "--seq", "32", "--global-batch", "16", "--strategies", "zero3",
                  "--remats", "full", "--data-sizes", "1", "--micro-batches", "1",
                  "--no-cache", "--json", "--out", "{results}/plan_7.5b_64x32gb.json"),
               ("plan_7.5b_64x32gb.json",), 70, 10, "planner example table"),
    Experiment("plan_accuracy", _m("plan_accuracy", "--json",
                                   "--out", "{results}/plan_accuracy.json"),
               _m("plan_accuracy", "--json", "--quick", "--out", "{results}/plan_accuracy.json"),
               ("plan_accuracy.json",), 300, 45, "planner accuracy table"),
    Experiment("quant_table", _m("quant_table", "--workdir", "{runs}/main",
                                 "--out", "{results}/quant_eval.json"),
               _m("quant_table", "--workdir", "{runs}/main", "--modes", "w8,w8a8",
                  "--calib-batches", "1", "--out", "{results}/quant_eval.json"),
               ("quant_eval.json",), 150, 20, "int8 table (needs main_job's checkpoint)",
               after=("main_job",)),
    # Sizes do not depend on the values: 20 steps give the medium shape's checkpoint.
    Experiment("train_medium_disk", _m("train", "--workdir", "{runs}/medium-disk", "--preset",
                                       "medium", "--steps", "20", "--batch-size", "8",
                                       "--eval-batches", "2", "--eval-every", "20",
                                       "--ckpt-every", "20", "--warmup-steps", "2",
                                       "--no-progress"),
               _m("train", "--workdir", "{runs}/medium-disk", "--preset", "tiny", "--steps",
                  "4", "--batch-size", "8", "--eval-batches", "1", "--eval-every", "4",
                  "--ckpt-every", "4", "--warmup-steps", "1", "--no-progress"),
               (), 150, 15, "the checkpoint the next table quantises",
               fresh=("{runs}/medium-disk",)),
    Experiment("quant_disk_medium", _m("quant_table", "--workdir", "{runs}/medium-disk",
                                       "--modes", "w8,w8a8,smoothquant", "--calib-batches",
                                       "2", "--out", "{results}/quant_disk_medium.json"),
               _m("quant_table", "--workdir", "{runs}/medium-disk", "--modes", "w8,w8a8",
                  "--calib-batches", "1", "--out", "{results}/quant_disk_medium.json"),
               ("quant_disk_medium.json",), 90, 15, "int8 checkpoint size on the medium shape",
               after=("train_medium_disk",)),
    Experiment("llm_quant_table", _m("llm_quant_table", "--out", "{results}/smollm2_quant.json"),
               _m("llm_quant_table", "--layers", "4", "--modes", "w8a8", "--tokens", "512",
                  "--new-tokens", "8", "--out", "{results}/smollm2_quant.json"),
               ("smollm2_quant.json", "smollm2_quant.png"), 1000, 30,
               "SmolLM2 int8 perplexity table and activation plot"),
    Experiment("chat_replies", _m("chat_replies", "--out", "{results}/smollm2_chat_replies.json"),
               _m("chat_replies", "--layers", "2", "--modes", "w8a8", "--prompts", "2",
                  "--max-new-tokens", "4,8", "--seeds", "2",
                  "--out", "{results}/smollm2_chat_replies.json"),
               ("smollm2_chat_replies.json",), 900, 60, "SmolLM2 int8 chat replies table"),
    Experiment("parity_smollm2", _m("parity_smollm2", "--out", "{results}/smollm2_parity.json"),
               _m("parity_smollm2", "--no-long", "--out", "{results}/smollm2_parity.json"),
               ("smollm2_parity.json",), 150, 30, "SmolLM2 parity with transformers"),
    Experiment("llm_int8_checkpoint", _m("llm_int8_checkpoint",
                                         "--json-out", "{results}/smollm2_int8_checkpoint.json"),
               _m("llm_int8_checkpoint", "--devices", "2",
                  "--json-out", "{results}/smollm2_int8_checkpoint.json"),
               ("smollm2_int8_checkpoint.json",), 120, 70,
               "SmolLM2 int8 checkpoint size and zero3 reload table"),
    Experiment("w8a8_crosscheck", _m("w8a8_crosscheck",
                                     "--json-out", "{results}/smollm2_w8a8_crosscheck.json"),
               _m("w8a8_crosscheck", "--layers", "2", "--tokens", "1024", "--new-tokens", "4",
                  "--json-out", "{results}/smollm2_w8a8_crosscheck.json"),
               ("smollm2_w8a8_crosscheck.json",), 600, 180,
               "SmolLM2 w8a8 against transformers' W8A8", needs="torch"),
    Experiment("embed_fidelity", _m("embed_fidelity", "--json",
                                    "--out", "{results}/embed_fidelity.json"),
               _m("embed_fidelity", "--json", "--sentences", "16", "--calib", "8",
                  "--modes", "w8a8", "--out", "{results}/embed_fidelity.json"),
               ("embed_fidelity.json",), 300, 15, "MiniLM int8 fidelity table"),
    Experiment("bench_int8", _m("bench_int8", "--json", "--out", "{results}/int8_bench.json"),
               _m("bench_int8", "--json", "--preset", "tiny", "--repeats", "2",
                  "--new-tokens", "8", "--out", "{results}/int8_bench.json"),
               ("int8_bench.json",), 200, 25, "int8 speed table"),
    # The table is a ratio to PyTorch (torch + transformers under SHARDQ_TORCH_PYTHON): without
    # that side a run would replace the committed file with ours alone, so it is skipped.
    Experiment("bench_encoder", _m("bench_encoder", "--json",
                                   "--out", "{results}/bench_encoder.json"),
               _m("bench_encoder", "--json", "--sentences", "16", "--rounds", "1",
                  "--modes", "w8a8", "--out", "{results}/bench_encoder.json"),
               ("bench_encoder.json",), 240, 20, "MiniLM speed vs PyTorch table",
               needs="torch"),
    Experiment("encoder_ablations", _m("bench_encoder", "--ablations", "--json",
                                       "--out", "{results}/encoder_ablations.json"),
               _m("bench_encoder", "--ablations", "--json", "--sentences", "32", "--rounds",
                  "1", "--no-cli", "--out", "{results}/encoder_ablations.json"),
               ("encoder_ablations.json",), 300, 30, "MiniLM speed changes table"),
    Experiment("bench_decode", _m("bench_decode", "--json", "--out", "{results}/bench_decode.json"),
               _m("bench_decode", "--json", "--layers", "2", "--new-tokens", "4", "--repeats",
                  "1", "--variants", "float,w8a8,float-scan",
                  "--out", "{results}/bench_decode.json"),
               ("bench_decode.json",), 240, 30, "SmolLM2 decoding speed table"),
    # The speed table is a ratio to PyTorch eager (SHARDQ_TORCH_PYTHON, as bench_encoder's);
    # each file keeps one entry per device count, and the tables show 1 and 8 devices.
    _train_speed("bench_train", 8, ablate=False, expected_s=90, quick_s=30),
    _train_speed("bench_train_1dev", 1, ablate=False, expected_s=90, quick_s=20),
    _train_speed("train_changes", 1, ablate=True, expected_s=240, quick_s=30),
    _train_speed("train_changes_8dev", 8, ablate=True, expected_s=240, quick_s=30),
    Experiment("comm_volume_smollm2", _m("comm_volume", "--preset", "smollm2", "--n-layers", "30",
                                         "--strategies", "dp", "zero1", "zero2", "zero3",
                                         "zero3_prefetch", "--json",
                                         "--out", "{results}/comm_volume_smollm2.json"),
               _m("comm_volume", "--preset", "smollm2", "--n-layers", "4", "--strategies",
                  "zero3", "--json", "--out", "{results}/comm_volume_smollm2.json"),
               ("comm_volume_smollm2.json",), 150, 30, "ZeRO volume on the GQA model"),
    Experiment("zero_memory_llama", _m("zero_memory", "--presets", "7.5b-gqa", "smollm2",
                                       "--json", "--out", "{results}/zero_memory_llama.json"),
               _m("zero_memory", "--presets", "7.5b-gqa", "--devices", "64", "--stages",
                  "zero3", "--json", "--out", "{results}/zero_memory_llama.json"),
               ("zero_memory_llama.json",), 600, 20, "Table 1 on the GQA shapes"),
    Experiment("finetune_smollm2", _m("finetune", "--workdir", "{runs}/finetune-smollm2",
                                      "--json", "--out", "{results}/finetune_smollm2.json"),
               _m("finetune", "--workdir", "{runs}/finetune-smollm2", "--n-layers", "2",
                  "--steps", "2", "--batch-size", "8", "--max-len", "32", "--eval-batches", "1",
                  "--json", "--out", "{results}/finetune_smollm2.json"),
               ("finetune_smollm2.json", "finetune_smollm2.png"), 420, 50,
               "SmolLM2 fine-tuning table and loss curve", fresh=("{runs}/finetune-smollm2",)),
    Experiment("equivalence_smollm2", _m("equivalence", "--model", "smollm2-truncated",
                                         "--steps", "3", "--json",
                                         "--out", "{results}/equivalence_smollm2.json"),
               _m("equivalence", "--model", "smollm2-truncated", "--devices", "2",
                  "--device-counts", "2", "--strategies", "dp,zero3", "--steps", "1",
                  "--json", "--out", "{results}/equivalence_smollm2.json"),
               ("equivalence_smollm2.json",), 150, 25,
               "every strategy from the pretrained weights against one device"),
    # A fine-tuned run exported in both formats, then scored by transformers (the safetensors
    # folder) and by our loader (the GGUF file): the export_run table. Every step needs the
    # PyTorch side, so that a machine without it does not rewrite half of the table's sources.
    Experiment("export_train", _m("train", "--preset", "smollm2", "--steps", "2",
                                  "--ckpt-every", "2", "--eval-every", "2", "--eval-batches", "1",
                                  "--devices", "8", "--workdir", "{runs}/ft-export",
                                  "--no-progress"),
               _m("train", "--preset", "smollm2", "--n-layers", "2", "--max-len", "32",
                  "--batch-size", "8", "--steps", "1", "--warmup-steps", "0", "--ckpt-every",
                  "1", "--eval-every", "1", "--eval-batches", "1", "--devices", "2", "--workdir",
                  "{runs}/ft-export", "--no-progress"),
               (), 240, 20, "the run the export table exports", needs="torch",
               fresh=("{runs}/ft-export",)),
    Experiment("export_safetensors",
               *_also_quick(_m("export", "--workdir", "{runs}/ft-export", "--format",
                               "safetensors", "--out", "{runs}/exports/ft-export", "--force",
                               "--record", "{results}/export_run_smollm2.json")),
               ("export_run_smollm2.json",), 60, 10, "export table: the Hugging Face folder",
               needs="torch", after=("export_train",)),
    Experiment("export_gguf",
               *_also_quick(_m("export", "--workdir", "{runs}/ft-export", "--format", "gguf",
                               "--out", "{runs}/exports/ft-export-gguf", "--force")),
               (), 60, 10, "export table: the GGUF file", needs="torch",
               after=("export_train",)),
    Experiment("export_reference",
               *_also_quick(("experiments/reference/check_export_reference.py", "--dir",
                             "{runs}/exports/ft-export", "--texts-from",
                             "tests/fixtures/smollm2_reference.json",
                             "--out", "{results}/export_run_transformers.json")),
               ("export_run_transformers.json",), 120, 10,
               "export table: transformers scores the exported folder", needs="torch",
               after=("export_safetensors",), env=(("HF_HUB_OFFLINE", "1"),)),
    Experiment("export_parity",
               *_also_quick(_m("parity_smollm2", "--gguf",
                               "{runs}/exports/ft-export-gguf/model.gguf", "--fixture",
                               "{results}/export_run_transformers.json", "--no-long",
                               "--out", "{results}/export_run_parity.json")),
               ("export_run_parity.json",), 150, 10,
               "export table: our loader scores the exported GGUF against transformers",
               needs="torch", after=("export_gguf", "export_reference")),
    # The GPU benchmark: runs only where JAX's backend is an NVIDIA GPU (--tiny: its code paths
    # on tiny shapes, for the quick run).
    Experiment("bench_gpu", _m("bench_gpu", "--json", "--out", "{results}/bench_gpu.json"),
               _m("bench_gpu", "--tiny", "--json", "--out", "{results}/bench_gpu.json"),
               ("bench_gpu.json", "bench_gpu.png"), 300, 60,
               "GPU training MFU, attention and int8 GEMM tables", needs="gpu"),
    Experiment("bench_gpu_no_triton", _m("bench_gpu", "--parts", "training,matmuls",
                                         "--variants", "dp/full/xla,dp/save_dots/cudnn",
                                         "--json", "--out", "{results}/bench_gpu_no_triton.json"),
               _m("bench_gpu", "--tiny", "--parts", "training,matmuls", "--json",
                  "--out", "{results}/bench_gpu_no_triton.json"),
               ("bench_gpu_no_triton.json", "bench_gpu_no_triton.png"), 200, 60,
               "GPU table without XLA's Triton GEMMs", needs="gpu",
               env=(("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false"),)),
    Experiment("fault_injection", _m("fault_injection", "--json",
                                     "--out", "{results}/fault_injection.json"),
               # One fault of each kind: a kill, a damaged checkpoint, another layout, a
               # non-finite step, a refused start.
               _m("fault_injection", "--json", "--scenarios", "crash_and_resume,"
                  "altered_checkpoint,resharding,nonfinite,disk_too_small",
                  "--out", "{results}/fault_injection.json"),
               ("fault_injection.json",), 200, 70, "failure behaviour table"),
)


def _ppl(d: dict, quant: str) -> float:
    """A mode's perplexity in a SmolLM2 table (KeyError when it is not there)."""
    for r in d["rows"]:
        if r["quant"] == quant:
            return r["perplexity"]
    raise KeyError(quant)


CLAIMS: dict[str, Callable[[Path, bool], str | None]] = {
    "main_job": holds(
        "main_job.json", "the reloaded checkpoint evaluates to the trained loss",
        lambda d: abs(d["val_loss"] - d["train_val_loss"]) <= 1e-6),
    "equivalence": holds(
        "equivalence.json", "every fp32 run is within the tolerance of one device",
        lambda d: d["fp32_all_within_tolerance"] is True),
    "zero_memory": holds(
        "zero_memory.json", "every cell is within 2% of the paper",
        lambda d: d["all_within_2pct"] is True),
    # zero3_auto is XLA's own choice (it all-reduces activations): no paper figure to meet.
    "comm_volume": holds(
        "comm_volume.json", "every written strategy's volume is within 5% of the paper's",
        lambda d: all(r["within_5pct"] for r in d["results"] if r["strategy"] != "zero3_auto")),
    "comm_volume_smollm2": holds(
        "comm_volume_smollm2.json", "zero3 moves 3 Psi_layers inside the layer loop and its "
        "total is 3 Psi_layers + 2 Psi_rest",
        lambda d: all(r["within_5pct"] for r in d["results"]) and all(
            abs(r["in_layer_loop_psi_layers"] - 3) <= 0.01 for r in d["results"]
            if r["strategy"] == "zero3")),
    "zero_memory_llama": holds(
        "zero_memory_llama.json", "every cell within 2% of Table 1",
        lambda d: d["all_within_2pct"] is True),
    "zero_release": holds(
        "zero_release.json", "zero3 releases every gathered layer",
        lambda d: all(r["released"] for r in d["results"])),
    "zero_table2": holds(
        "zero_table2.json", "each stage trains a larger model than the one before",
        lambda d: [r["state_psi"] for r in d["table2"]]
        == sorted({r["state_psi"] for r in d["table2"]})),
    "plan": holds(
        "plan_7.5b_64x32gb.json", "the recommended candidate fits",
        lambda d: d["recommended"]["fits"] is True),
    # The runtime's own few MB per device are a larger share of the quick run's small
    # configurations, so only the full grid is held to the 10% goal.
    "plan_accuracy": holds(
        # The executed program's peak and the planner's differ by a few KB; against the quick
        # grid's ~14 MB peaks that reached 0.12% (0.04% on the full grid).
        "plan_accuracy.json", "every configuration ran and its executable compiles to the "
        "planner's peak (within 0.5%)",
        lambda d: not d["failures"] and d["max_abs_executable_vs_planner"] <= 5e-3,
        # What planning.md says: the planner's peak is within 10% of the executed one, or below
        # it by the few MB per device a step takes outside XLA's accounting (2.2-4.8 MB on the
        # smallest configuration across runs), which at these sizes can reach 11% (the 10% goal
        # is then missed, and the table says so); and XLA's own buffers at the peak (glibc's
        # blocks of 128 KiB or more) are within 5% of the compiled peak. That count is read in a
        # second step, sampled more slowly than the resident set: it has fallen short of a short
        # peak by up to 4.5% (one-off runs) and exceeded it by 3.1% once (zero3_prefetch, a
        # committed run; blocks that size which are not XLA's count too). The quick grid's small
        # shapes put more buffers under 128 KiB, so this is not held there.
        full_only=("the planner's peak is within 10%, or within 6 MB per device below, of the "
                   "executed one, and XLA's buffers at the peak within 5% of the compiled one",
                   lambda d: all((abs(r["error"]) <= 0.10 or 0 <= r["executed_peak_bytes"]
                                  - r["planner_peak_bytes"] <= 6e6)
                                 and -0.05 <= r.get("executed_large_blocks_peak_bytes",
                                                    r["compiled_peak_bytes"])
                                 / r["compiled_peak_bytes"] - 1 <= 0.05
                                 for r in d["results"]))),
    "quant_table": holds(
        "quant_eval.json", "every int8 mode is within 1% of float",
        lambda d: all(abs(r["rel_to_float"]) <= 0.01 for r in d["rows"])),
    "llm_quant_table": holds(
        "smollm2_quant.json", "every mode was measured (finite perplexities, and each int8 "
        "mode's divergence from float: a mean KL of at least 0, a top-1 agreement in [0, 1])",
        lambda d: all(math.isfinite(r["perplexity"]) and (
            r["quant"] == "none" or (r["divergence"]["kl_mean"] >= 0
                                     and 0 <= r["divergence"]["top1_agree"] <= 1))
            for r in d["rows"]),
        full_only=("smoothquant, auto and w8a8-rotated are within 1% of float, and smoothquant "
                   "is no worse than plain per-token w8a8",
                   lambda d: all(r["vs_float_pct"] <= 1.0 for r in d["rows"]
                                 if r["quant"] in ("smoothquant", "auto", "w8a8-rotated"))
                   and _ppl(d, "smoothquant") <= _ppl(d, "w8a8"))),
    "parity_smollm2": holds(
        "smollm2_parity.json", "token ids and next tokens are identical, mean NLLs within "
        "1e-4 nats, chat prompt ids identical and greedy replies identical but at near ties",
        lambda d: d["ids_identical"] == d["next_identical"] == d["texts"]
        and d["max_abs_nll_diff"] <= 1e-4
        and all(p["template_identical"] and (p["identical"] or p["parted_at_near_tie"])
                for p in d["chat"]["prompts"]),
        full_only=("the same holds for the long text (the quick run skips it)",
                   lambda d: d["long_text"]["ids_identical"] and d["long_text"]["next_identical"]
                   and d["long_text"]["abs_nll_diff"] <= 1e-4
                   and d["long_text"]["tail_abs_nll_diff"] <= 1e-4)),
    "llm_int8_checkpoint": holds(
        "smollm2_int8_checkpoint.json", "the int8 checkpoint is at least 3.5x smaller than the "
        "float32 parameters and reads back bit-identical, scoring as the in-memory model",
        lambda d: d["disk_ratio"] >= 3.5 and d["params_bit_identical"] is True
        and d["reload_vs_in_memory_same_layout"]["max_abs_nll_diff"] == 0.0
        and d["reload_vs_in_memory_same_layout"]["next_tokens_identical"] is True),
    "w8a8_crosscheck": holds(
        "smollm2_w8a8_crosscheck.json", "the two float models agree (mean NLL within 1e-4 nats)",
        lambda d: abs(d["rows"][0]["ours"]["nll"] - d["rows"][0]["transformers"]["nll"]) <= 1e-4
        and d["rows"][0]["variant"] == "none",
        full_only=("plain and rotated per-token w8a8 change perplexity alike in both "
                   "implementations (within 0.5 points)",
                   lambda d: all(abs(r["ours"]["vs_float_pct"] - r["transformers"]["vs_float_pct"])
                                 <= 0.5 for r in d["rows"]
                                 if r["variant"] in ("w8a8", "w8a8-rotated")))),
    # 20 steps of the medium shape: sizes only (the quick run's tiny model is mostly embedding).
    "quant_disk_medium": holds(
        "quant_disk_medium.json", "every mode was measured",
        lambda d: all(r["val_loss"] == r["val_loss"] for r in d["rows"]),
        full_only=("every int8 checkpoint is at least 3.5x smaller on disk than float32",
                   lambda d: all(r["disk_ratio_vs_fp32"] >= 3.5 for r in d["rows"]
                                 if r["mode"] != "none"))),
    "finetune_smollm2": holds(
        "finetune_smollm2.json", "both perplexities are finite",
        lambda d: math.isfinite(d["perplexity_before"]) and math.isfinite(d["perplexity_after"]),
        full_only=("fine-tuning lowers the held-out perplexity by at least 10%",
                   lambda d: d["perplexity_after"] <= 0.9 * d["perplexity_before"])),
    "equivalence_smollm2": holds(
        "equivalence_smollm2.json", "every strategy is within the fp32 tolerance of one device",
        lambda d: d["all_within_tolerance"] is True),
    "export_parity": holds(
        "export_run_parity.json", "our loader's scores of the exported GGUF match transformers' "
        "of the exported folder (ids and next tokens identical, mean NLLs within 1e-4 nats)",
        lambda d: d["ids_identical"] == d["next_identical"] == d["texts"]
        and d["max_abs_nll_diff"] <= 1e-4),
    "fault_injection": holds(
        "fault_injection.json", "every fault is recovered from with nothing lost",
        lambda d: d["all_recovered_nothing_lost"] is True),
}
EXPERIMENTS = tuple(dataclasses.replace(e, claim=CLAIMS.get(e.name)) for e in EXPERIMENTS)
NAMES = tuple(e.name for e in EXPERIMENTS)


def select(names: list[str] | None) -> list[Experiment]:
    """The experiments named and those they run after, in EXPERIMENTS' order; all when None;
    ValueError naming the unknown ones."""
    if not names:
        return list(EXPERIMENTS)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"only={' '.join(unknown)}: allowed {', '.join(NAMES)}")
    by_name = {e.name: e for e in EXPERIMENTS}
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(by_name[name].after)
    return [e for e in EXPERIMENTS if e.name in wanted]


def _backend_is_nvidia_gpu() -> bool:
    """Whether JAX, started in a subprocess (this runner never starts it), finds a CUDA GPU
    (`experiments.cli.runtime.on_nvidia_gpu`, the check the GPU launchers make)."""
    probe = "from experiments.cli.runtime import on_nvidia_gpu; print(on_nvidia_gpu())"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=300, cwd=PROJECT_ROOT)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.stdout.strip().endswith("True")


def missing_need(exp: Experiment, gpu: Callable[[], bool] = _backend_is_nvidia_gpu) -> str | None:
    """Why `exp` cannot run on this machine (None: it can)."""
    if exp.needs == "torch":
        python = torch_python()
        if not python:
            return (f"needs the PyTorch environment: set ${TORCH_PYTHON_ENV} to its interpreter "
                    "(docs/testing.md)")
        if not os.access(python, os.X_OK):
            return f"${TORCH_PYTHON_ENV}={python!r} is not an executable file"
    if exp.needs == "gpu" and not gpu():
        return "needs an NVIDIA GPU (JAX's backend here is not one)"
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """The machine and software a run used (a small stand-in for a shared machine helper)."""
    mem = None
    try:
        kb = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines()
                  if x.startswith("MemTotal"))
        mem = round(kb * 1024 / 1e9, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gb": mem,
                    "platform": platform.platform()},
        "software": {"python": platform.python_version(),
                     **{p: _version(p) for p in ("jax", "jaxlib", "flax", "optax",
                                                 "orbax-checkpoint", "numpy")}},
        "git_commit": _git_commit(),
    }


def stamp(path: Path, provenance: dict) -> bool:
    """Add `provenance` to a JSON results file (False if it is not a JSON object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(data, dict):
        return False
    data["provenance"] = provenance
    write_result(path, data)
    return True


def _fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# In a runs folder the runner made: its training runs may be replaced by the next run.
SCRATCH_MARK = ".reproduce-scratch"


def run_all(experiments: list[Experiment], *, quick: bool, results: Path, runs: Path,
            say: Callable[[str], None] = print, timeout_s: float | None = None) -> dict:
    """Run each experiment in turn (a failure is recorded and the next one runs); returns the
    summary also written to results/reproduce.json. An experiment's `fresh` folders are emptied
    first only where `runs` is the runner's own (it made the folder); elsewhere an earlier run
    there stays, and its launcher refuses to start over it."""
    results, runs = Path(results).resolve(), Path(runs).resolve()
    results.mkdir(parents=True, exist_ok=True)
    if not runs.exists() or not any(runs.iterdir()):
        runs.mkdir(parents=True, exist_ok=True)
        (runs / SCRATCH_MARK).write_text("experiments.reproduce's scratch runs: replaced by "
                                         "its next run\n")
    own_runs = (runs / SCRATCH_MARK).exists()
    env = {**os.environ, RESULTS_ENV: str(results),
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    # What this machine lacks is known before anything runs: those take no time.
    gpu = functools.cache(_backend_is_nvidia_gpu)
    lacking = {e.name: missing_need(e, gpu) for e in experiments}
    expected = [0 if lacking[e.name] else e.quick_expected_s if quick else e.expected_s
                for e in experiments]
    say(f"{len(experiments)} experiments ({sum(map(bool, lacking.values()))} of them skipped "
        f"here: see below), expected about {_fmt(sum(expected))} on a 2-core CPU; results in "
        f"{results}")
    machine = environment()
    start = time.perf_counter()
    rows = []
    passed: set[str] = set()
    for i, exp in enumerate(experiments):
        cmd = exp.command(quick, results, runs)
        shown = exp.shown(quick, results, runs)
        left = sum(expected[i:])
        say(f"[{i + 1}/{len(experiments)}] {exp.name} ({exp.feeds}): {shown}  "
            f"[elapsed {_fmt(time.perf_counter() - start)}, about {_fmt(left)} left]")
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        not_run = [a for a in exp.after if a not in passed]
        skipped = lacking[exp.name] or (
            f"runs after {', '.join(not_run)}, which did not pass here" if not_run else None)
        if skipped:
            rows.append({"name": exp.name, "feeds": exp.feeds, "command": shown, "date": date,
                         "skipped": skipped, "passed": None, "outputs": list(exp.outputs)})
            say(f"    {exp.name}: skipped: {skipped}")
            continue
        for folder in exp.fresh_folders(runs) if own_runs else ():
            shutil.rmtree(folder, ignore_errors=True)
        t0 = time.perf_counter()
        tail: list[str] = []
        try:
            proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env={**env, **dict(exp.env)},
                                    stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace")
            for line in proc.stdout:
                line = line.rstrip("\n")
                if len(line) < 400:  # progress lines; the last-line JSON is long and kept below
                    say(f"    {exp.name}: {line}")
                tail = (tail + [line[-2000:]])[-15:]
            rc = proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            rc, tail = -1, tail + [f"{type(e).__name__}: {e}"]
        wall = time.perf_counter() - t0
        missing = [o for o in exp.outputs if not (results / o).exists()]
        broken = exp.claim(results, quick) if exp.claim and rc == 0 and not missing else None
        ok = rc == 0 and not missing and broken is None
        if ok:
            passed.add(exp.name)
        provenance = {**machine, "date": date, "command": shown, "wall_s": round(wall, 1),
                      "quick": quick}
        if exp.runs_in_torch:  # not this environment's packages: the file names its own
            provenance["software"] = {"interpreter": f"${TORCH_PYTHON_ENV}"}
        for o in exp.outputs:
            if o.endswith(".json") and (results / o).exists() and rc == 0:
                stamp(results / o, provenance)
        rows.append({"name": exp.name, "feeds": exp.feeds, "command": shown, "date": date,
                     "returncode": rc, "passed": ok, "wall_s": round(wall, 1),
                     "outputs": list(exp.outputs), "missing_outputs": missing,
                     "claim_failed": broken,
                     "tail": tail if not ok else tail[-3:]})
        say(f"    {exp.name}: {'passed' if ok else 'FAILED'} in {_fmt(wall)}"
            + ("" if ok else f" (exit {rc}" + (f", missing {', '.join(missing)}" if missing
                                                else "") + (f"; {broken}" if broken else "")
               + ")"))
    # A skipped experiment (passed: None) is neither: the summary names it apart.
    summary = {"quick": quick, "results": project_relative(results),
               "passed": all(r["passed"] is not False for r in rows),
               "failed": [r["name"] for r in rows if r["passed"] is False],
               "skipped": {r["name"]: r["skipped"] for r in rows if r.get("skipped")},
               "wall_s": round(time.perf_counter() - start, 1),
               "experiments": rows, **machine,
               "earlier": earlier_records(results / "reproduce.json", rows, quick)}
    write_result(results / "reproduce.json", summary)
    return summary


def earlier_records(log: Path, rows: list[dict], quick: bool) -> list[dict]:
    """The latest record of every experiment that the folder's previous reproduce.json holds
    (its own run's or its "earlier" ones) and this run did not run, each with the commit and
    the machine of its run: a run of a few experiments (`--only`) keeps the log of the others,
    whose results files it leaves in place. Nothing from a log of the other kind (quick or
    full), or one that is unreadable."""
    try:
        old = json.loads(log.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict) or old.get("quick") != quick:
        return []
    ran = {r["name"] for r in rows}
    own = [{"git_commit": old.get("git_commit"), "machine": old.get("machine"), **r}
           for r in old.get("experiments", []) if isinstance(r, dict)]
    kept: dict[str, dict] = {}
    for r in own + [r for r in old.get("earlier", []) if isinstance(r, dict)]:
        if r.get("name") not in ran:
            kept.setdefault(r.get("name"), r)  # the previous run's record before older ones
    return list(kept.values())
