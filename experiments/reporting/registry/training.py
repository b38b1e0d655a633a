"""Experiments of the training runs: the main job, every strategy against one device (the
byte-level model and SmolLM2), the step time per strategy, fine-tuning SmolLM2 and fault
injection."""

from __future__ import annotations

import math

from experiments.reporting.registry.claims import holds
from experiments.reporting.registry.experiment import Experiment, launcher

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        name="main_job",
        argv=launcher("main_job", "--workdir", "{runs}/main", "--no-progress",
                      "--record", "{results}/main_job.json"),
        quick_argv=launcher("main_job", "--workdir", "{runs}/main", "--no-progress",
                            "--preset", "tiny", "--steps", "40", "--warmup-steps", "5",
                            "--eval-every", "40", "--eval-batches", "2", "--ckpt-every", "40",
                            "--record", "{results}/main_job.json"),
        outputs=("main_job.json", "main_job.png"),
        expected_s=560, quick_expected_s=20,
        feeds="main_job table, loss curve",
        fresh=("{runs}/main",),
        claim=holds(
            "main_job.json", "the reloaded checkpoint evaluates to the trained loss",
            lambda d: abs(d["val_loss"] - d["train_val_loss"]) <= 1e-6),
    ),
    Experiment(
        name="equivalence",
        argv=launcher("equivalence", "--devices", "8", "--steps", "20", "--json",
                      "--out", "{results}/equivalence.json"),
        # Every strategy against one device, on 2 devices in fp32 (the claim's precision).
        quick_argv=launcher("equivalence", "--devices", "2", "--device-counts", "2",
                            "--precisions", "float32", "--steps", "2", "--json",
                            "--out", "{results}/equivalence.json"),
        outputs=("equivalence.json",),
        expected_s=900, quick_expected_s=60,
        feeds="equivalence table",
        claim=holds(
            "equivalence.json", "every fp32 run is within the tolerance of one device",
            lambda d: d["fp32_all_within_tolerance"] is True),
    ),
    Experiment(
        name="bench_strategies",
        argv=launcher("bench_strategies", "--preset", "small", "--devices", "8", "--json",
                      "--out", "{results}/strategy_speed.json"),
        quick_argv=launcher("bench_strategies", "--preset", "tiny", "--devices", "8",
                            "--steps", "3", "--warmup", "1", "--strategies", "dp,zero3", "--json",
                            "--out", "{results}/strategy_speed.json"),
        outputs=("strategy_speed.json",),
        expected_s=240, quick_expected_s=25,
        feeds="step time table",
    ),
    Experiment(
        name="finetune_smollm2",
        argv=launcher("finetune", "--workdir", "{runs}/finetune-smollm2", "--json",
                      "--out", "{results}/finetune_smollm2.json"),
        quick_argv=launcher("finetune", "--workdir", "{runs}/finetune-smollm2", "--n-layers", "2",
                            "--steps", "2", "--batch-size", "8", "--max-len", "32",
                            "--eval-batches", "1", "--json",
                            "--out", "{results}/finetune_smollm2.json"),
        outputs=("finetune_smollm2.json", "finetune_smollm2.png"),
        expected_s=420, quick_expected_s=50,
        feeds="SmolLM2 fine-tuning table and loss curve",
        fresh=("{runs}/finetune-smollm2",),
        claim=holds(
            "finetune_smollm2.json", "both perplexities are finite",
            lambda d: math.isfinite(d["perplexity_before"])
            and math.isfinite(d["perplexity_after"]),
            full_only=("fine-tuning lowers the held-out perplexity by at least 10%",
                       lambda d: d["perplexity_after"] <= 0.9 * d["perplexity_before"])),
    ),
    Experiment(
        name="finetune_gemma3",
        argv=launcher("finetune", "--preset", "gemma3-270m", "--devices", "2",
                      "--workdir", "{runs}/finetune-gemma3", "--json",
                      "--out", "{results}/finetune_gemma3.json"),
        quick_argv=launcher("finetune", "--preset", "gemma3-270m", "--devices", "2",
                            "--workdir", "{runs}/finetune-gemma3", "--n-layers", "2",
                            "--steps", "2", "--max-len", "32", "--eval-batches", "1", "--json",
                            "--out", "{results}/finetune_gemma3.json"),
        outputs=("finetune_gemma3.json", "finetune_gemma3.png"),
        expected_s=900, quick_expected_s=120,
        feeds="Gemma 3 270M fine-tuning table (zero3 on 2 devices: its gathered 262k-entry "
              "embedding per fake device is what host memory holds)",
        fresh=("{runs}/finetune-gemma3",),
        claim=holds(
            "finetune_gemma3.json", "both perplexities are finite and the run is zero3",
            lambda d: math.isfinite(d["perplexity_before"])
            and math.isfinite(d["perplexity_after"]) and d["strategy"] == "zero3",
            full_only=("fine-tuning lowers the held-out perplexity",
                       lambda d: d["perplexity_after"] < d["perplexity_before"])),
    ),
    Experiment(
        name="equivalence_smollm2",
        argv=launcher("equivalence", "--model", "smollm2-truncated", "--steps", "3", "--json",
                      "--out", "{results}/equivalence_smollm2.json"),
        quick_argv=launcher("equivalence", "--model", "smollm2-truncated", "--devices", "2",
                            "--device-counts", "2", "--strategies", "dp,zero3", "--steps", "1",
                            "--json", "--out", "{results}/equivalence_smollm2.json"),
        outputs=("equivalence_smollm2.json",),
        expected_s=150, quick_expected_s=25,
        feeds="every strategy from the pretrained weights against one device",
        claim=holds(
            "equivalence_smollm2.json", "every strategy is within the fp32 tolerance of one device",
            lambda d: d["all_within_tolerance"] is True),
    ),
    Experiment(
        name="fault_injection",
        argv=launcher("fault_injection", "--json", "--out", "{results}/fault_injection.json"),
        # One fault of each kind: a kill, a damaged checkpoint, another layout, a non-finite step,
        # a refused start.
        quick_argv=launcher("fault_injection", "--json", "--scenarios", "crash_and_resume,"
                            "altered_checkpoint,resharding,nonfinite,disk_too_small",
                            "--out", "{results}/fault_injection.json"),
        outputs=("fault_injection.json",),
        expected_s=200, quick_expected_s=70,
        feeds="failure behaviour table",
        claim=holds(
            "fault_injection.json",
            "every recovery recovers and every refusal refuses, with nothing lost",
            lambda d: d["all_recovered_nothing_lost"] is True),
    ),
)
