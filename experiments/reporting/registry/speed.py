"""Experiments of speed: MiniLM encoding, SmolLM2 decoding, the training step against PyTorch
and per change, and the GPU benchmark."""

from __future__ import annotations

from experiments.reporting.registry.experiment import Experiment, launcher

# The quick run times the training step on the tiny preset, briefly.
QUICK_STEPS = ("--preset", "tiny", "--steps", "2", "--rounds", "1", "--warmup", "1")

EXPERIMENTS: tuple[Experiment, ...] = (
    # The table is a ratio to PyTorch (torch + transformers under SHARDQ_TORCH_PYTHON): without
    # that side a run would replace the committed file with ours alone, so it is skipped.
    Experiment(
        name="bench_encoder",
        argv=launcher("bench_encoder", "--json", "--out", "{results}/bench_encoder.json"),
        quick_argv=launcher("bench_encoder", "--json", "--sentences", "16", "--rounds", "1",
                            "--modes", "w8a8", "--out", "{results}/bench_encoder.json"),
        outputs=("bench_encoder.json",),
        expected_s=240, quick_expected_s=20,
        feeds="MiniLM speed vs PyTorch table",
        needs="torch",
    ),
    Experiment(
        name="encoder_ablations",
        argv=launcher("bench_encoder", "--ablations", "--json",
                      "--out", "{results}/encoder_ablations.json"),
        quick_argv=launcher("bench_encoder", "--ablations", "--json", "--sentences", "32",
                            "--rounds", "1", "--no-cli",
                            "--out", "{results}/encoder_ablations.json"),
        outputs=("encoder_ablations.json",),
        expected_s=300, quick_expected_s=30,
        feeds="MiniLM speed changes table",
    ),
    Experiment(
        name="bench_decode",
        argv=launcher("bench_decode", "--json", "--out", "{results}/bench_decode.json"),
        quick_argv=launcher("bench_decode", "--json", "--layers", "2", "--new-tokens", "4",
                            "--repeats", "1", "--variants", "float,w8a8,float-scan",
                            "--out", "{results}/bench_decode.json"),
        outputs=("bench_decode.json",),
        expected_s=240, quick_expected_s=30,
        feeds="SmolLM2 decoding speed table",
    ),
    # The speed table is a ratio to PyTorch eager (SHARDQ_TORCH_PYTHON, as bench_encoder's);
    # each file keeps one entry per device count, and the tables show 1 and 8 devices.
    Experiment(
        name="bench_train",
        argv=launcher("bench_train", "--devices", "8", "--json",
                      "--out", "{results}/bench_train.json"),
        quick_argv=launcher("bench_train", "--devices", "8", "--json", *QUICK_STEPS,
                            "--profile-steps", "1", "--out", "{results}/bench_train.json"),
        outputs=("bench_train.json",),
        expected_s=90, quick_expected_s=30,
        feeds="training speed vs PyTorch table, 8 device(s)",
        needs="torch",
    ),
    Experiment(
        name="bench_train_1dev",
        argv=launcher("bench_train", "--devices", "1", "--json",
                      "--out", "{results}/bench_train.json"),
        quick_argv=launcher("bench_train", "--devices", "1", "--json", *QUICK_STEPS,
                            "--profile-steps", "1", "--out", "{results}/bench_train.json"),
        outputs=("bench_train.json",),
        expected_s=90, quick_expected_s=20,
        feeds="training speed vs PyTorch table, 1 device(s)",
        needs="torch",
    ),
    Experiment(
        name="train_changes",
        argv=launcher("bench_train", "--ablate", "--devices", "1",
                      "--changes-out", "{results}/bench_train_changes.json"),
        quick_argv=launcher("bench_train", "--ablate", "--devices", "1", *QUICK_STEPS,
                            "--changes-out", "{results}/bench_train_changes.json"),
        outputs=("bench_train_changes.json",),
        expected_s=240, quick_expected_s=30,
        feeds="training step changes table, 1 device(s)",
    ),
    Experiment(
        name="train_changes_8dev",
        argv=launcher("bench_train", "--ablate", "--devices", "8",
                      "--changes-out", "{results}/bench_train_changes.json"),
        quick_argv=launcher("bench_train", "--ablate", "--devices", "8", *QUICK_STEPS,
                            "--changes-out", "{results}/bench_train_changes.json"),
        outputs=("bench_train_changes.json",),
        expected_s=240, quick_expected_s=30,
        feeds="training step changes table, 8 device(s)",
    ),
    # The GPU benchmark: runs only where JAX's backend is an NVIDIA GPU (--tiny: its code paths
    # on tiny shapes, for the quick run).
    Experiment(
        name="bench_gpu",
        argv=launcher("bench_gpu", "--json", "--out", "{results}/bench_gpu.json"),
        quick_argv=launcher("bench_gpu", "--tiny", "--json", "--out", "{results}/bench_gpu.json"),
        outputs=("bench_gpu.json", "bench_gpu.png"),
        expected_s=300, quick_expected_s=60,
        feeds="GPU training MFU, attention and int8 GEMM tables",
        needs="gpu",
    ),
    Experiment(
        name="bench_gpu_no_triton",
        argv=launcher("bench_gpu", "--parts", "training,matmuls",
                      "--variants", "dp/full/xla,dp/save_dots/cudnn", "--json",
                      "--out", "{results}/bench_gpu_no_triton.json"),
        quick_argv=launcher("bench_gpu", "--tiny", "--parts", "training,matmuls", "--json",
                            "--out", "{results}/bench_gpu_no_triton.json"),
        outputs=("bench_gpu_no_triton.json", "bench_gpu_no_triton.png"),
        expected_s=200, quick_expected_s=60,
        feeds="GPU table without XLA's Triton GEMMs",
        needs="gpu",
        env=(("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false"),),
    ),
)
