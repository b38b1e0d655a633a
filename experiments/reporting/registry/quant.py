"""Experiments of the byte-level model's int8 quantisation: quality, size on disk and speed."""

from __future__ import annotations

from experiments.reporting.registry.claims import holds
from experiments.reporting.registry.experiment import Experiment, launcher

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        name="quant_table",
        argv=launcher("quant_table", "--workdir", "{runs}/main",
                      "--out", "{results}/quant_eval.json"),
        quick_argv=launcher("quant_table", "--workdir", "{runs}/main", "--modes", "w8,w8a8",
                            "--calib-batches", "1", "--out", "{results}/quant_eval.json"),
        outputs=("quant_eval.json",),
        expected_s=150, quick_expected_s=20,
        feeds="int8 table (needs main_job's checkpoint)",
        after=("main_job",),
        claim=holds(
            "quant_eval.json", "every int8 mode is within 1% of float",
            lambda d: all(abs(r["rel_to_float"]) <= 0.01 for r in d["rows"])),
    ),
    # Sizes do not depend on the values: 20 steps give the medium shape's checkpoint.
    Experiment(
        name="train_medium_disk",
        argv=launcher("train", "--workdir", "{runs}/medium-disk", "--preset", "medium",
                      "--steps", "20", "--batch-size", "8", "--eval-batches", "2",
                      "--eval-every", "20", "--ckpt-every", "20", "--warmup-steps", "2",
                      "--no-progress"),
        quick_argv=launcher("train", "--workdir", "{runs}/medium-disk", "--preset", "tiny",
                            "--steps", "4", "--batch-size", "8", "--eval-batches", "1",
                            "--eval-every", "4", "--ckpt-every", "4", "--warmup-steps", "1",
                            "--no-progress"),
        outputs=(),
        expected_s=150, quick_expected_s=15,
        feeds="the checkpoint the next table quantises",
        fresh=("{runs}/medium-disk",),
    ),
    Experiment(
        name="quant_disk_medium",
        argv=launcher("quant_table", "--workdir", "{runs}/medium-disk",
                      "--modes", "w8,w8a8,smoothquant", "--calib-batches", "2",
                      "--out", "{results}/quant_disk_medium.json"),
        quick_argv=launcher("quant_table", "--workdir", "{runs}/medium-disk", "--modes", "w8,w8a8",
                            "--calib-batches", "1", "--out", "{results}/quant_disk_medium.json"),
        outputs=("quant_disk_medium.json",),
        expected_s=90, quick_expected_s=15,
        feeds="int8 checkpoint size on the medium shape",
        after=("train_medium_disk",),
        # 20 steps of the medium shape: sizes only (the quick run's tiny model is mostly embedding).
        claim=holds(
            "quant_disk_medium.json", "every mode was measured",
            lambda d: all(r["val_loss"] == r["val_loss"] for r in d["rows"]),
            full_only=("every int8 checkpoint is at least 3.5x smaller on disk than float32",
                       lambda d: all(r["disk_ratio_vs_fp32"] >= 3.5 for r in d["rows"]
                                     if r["mode"] != "none"))),
    ),
    Experiment(
        name="bench_int8",
        argv=launcher("bench_int8", "--json", "--out", "{results}/int8_bench.json"),
        quick_argv=launcher("bench_int8", "--json", "--preset", "tiny", "--repeats", "2",
                            "--new-tokens", "8", "--out", "{results}/int8_bench.json"),
        outputs=("int8_bench.json",),
        expected_s=200, quick_expected_s=25,
        feeds="int8 speed table",
    ),
)
