"""Fine-tune a pretrained model under ZeRO-3 on 8 fake devices (default SmolLM2-135M-Instruct).

  python -m experiments.finetune --json                     # the documented defaults
  python -m experiments.finetune --steps 48 --lr 5e-5 --workdir runs/ft2 --json
  python -m experiments.finetune --preset gemma3-270m --workdir runs/ft-gemma --json
  python -m experiments.finetune --init path/to/hf_folder --workdir runs/ft-mine --json

The `smollm2` preset of experiments/training/config.py (every field a flag, as for `train`): the
GGUF's weights placed one tensor at a time straight into their ZeRO-3 shards, the training topics
of `pydoc_data` tokenized with the model's tokenizer, bf16 working weights and compute with fp32
master weights and Adam moments, full remat, context 128, 8 sequences per step, 24 steps of AdamW
(warm-up 2, cosine to 10%). It is the ordinary trainer (`experiments/training/trainer.py`:
checkpoints, exact --resume, the non-finite guard, SIGTERM), so this launcher only adds the
measurements: validation loss and perplexity on the held-out topics before and after, tokens/s, the
per-device model state read from the compiled step, the host memory peak of loading, and a
loss-curve plot. With --json the last line holds them (`perplexity_before`, `perplexity_after`,
`val_loss_before`, `val_loss_after`, `devices`, `strategy`, `steps`, `tokens_per_s`,
`load_peak_rss_gb`, ...); the same goes to experiments/results/finetune_<model>.json.
--preset gemma3-270m fine-tunes Gemma 3 270M the same way (its own preset: a shorter context);
--init REF any model `--model` accepts (experiments/training/init_config.py: REF's architecture
and tokenizer, the fine-tuning defaults above).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import (
    ConfigError,
    Parser,
    check_output_file,
    check_output_folder,
    fail,
)
from experiments.cli.flags import add_override_flags, config_from_args
from experiments.pretrained import model_ref
from experiments.reporting.results_io import project_relative, results_path, write_result
from experiments.training.init_config import pretrained_base

PROG = "experiments.finetune"
DEFAULT_PRESET = "smollm2"


def model_label(init: str) -> str:
    """What the results name the model by: the registered name, or the folder or file name."""
    return init if init in model_ref.REGISTERED else Path(init).name


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None,
                   help="the run's folder (default runs/finetune-<model>)")
    p.add_argument("--preset", default=None,
                   help=f"a preset with init (default {DEFAULT_PRESET}; with --init REF the "
                        f"preset named like REF, else the fine-tuning defaults)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON last")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default=None,
                   help="the results file (default experiments/results/finetune_<model>.json)")
    add_override_flags(p)
    args = p.parse_args(argv)
    try:
        base = None
        if args.override_init is not None:
            base = pretrained_base(args.override_init, args.preset, args.override_n_layers,
                                   args.override_data)
            if base is not None:
                args.override_init = base.train.init
        cfg = config_from_args(args, base=base, default_preset=DEFAULT_PRESET)
        if cfg.train.init is None:
            raise ConfigError(f"preset={cfg.preset!r}: fine-tuning needs pretrained weights "
                              f"(--init REF)")
        label = model_label(cfg.train.init)
        args.out = args.out or str(results_path(f"finetune_{label}.json"))
        args.workdir = args.workdir or f"runs/finetune-{label}"
        check_output_file("out", args.out)
        check_output_folder("workdir", args.workdir, "the fine-tuning run")
        if Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
            raise ConfigError(f"workdir={args.workdir!r}: not empty; give a new folder")
    except ConfigError as e:
        fail(PROG, str(e))
    guards, trainer, step_memory, machine, plots = startup.begin(
        "experiments.training.guards", "experiments.training.trainer",
        "experiments.training.step_memory", "experiments.speed.machine",
        "experiments.reporting.plots", devices=cfg.train.devices or 8, model=cfg.model)
    try:
        summary = trainer.train_and_evaluate(cfg, args.workdir, progress=not args.no_progress)
        memory = step_memory.state_memory(cfg)
    except ConfigError as e:
        fail(PROG, str(e))
    except guards.RunStopped as e:
        fail(PROG, str(e), code=1)
    metrics = (Path(args.workdir) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in metrics if line.strip()]
    train_rows = [r for r in rows if "loss" in r]
    speeds = [r["tokens_per_s"] for r in train_rows[1:]] or [train_rows[0]["tokens_per_s"]]
    plot = plots.loss_curve(Path(args.workdir) / "metrics.jsonl",
                            Path(args.out).with_suffix(".png"), per_token=True,
                            title=f"{label} fine-tuning, {cfg.train.strategy} on "
                                  f"{summary['devices']} devices")
    result = {"model": label, "devices": summary["devices"], "strategy": summary["strategy"],
              "steps": summary["step"], "tokens_per_step": cfg.train.batch_size * cfg.model.max_len,
              "val_loss_before": summary["val_loss_before"], "val_loss_after": summary["val_loss"],
              "perplexity_before": math.exp(summary["val_loss_before"]),
              "perplexity_after": math.exp(summary["val_loss"]),
              "tokens_per_s": statistics.median(speeds), "train_seconds": summary["train_seconds"],
              "load_peak_rss_gb": summary["load"]["rss_peak_after_gb"],
              "load_rss_before_gb": summary["load"]["rss_peak_before_gb"],
              "largest_tensor_gb": summary["load"]["largest_tensor_gb"], **memory,
              "config": cfg.to_json(), "workdir": project_relative(args.workdir),
              "plot": project_relative(plot), "machine": machine.describe(),
              "losses": [[r["step"], r["loss"]] for r in train_rows]}
    result["perplexity_drop_pct"] = 100 * (1 - result["perplexity_after"]
                                           / result["perplexity_before"])
    write_result(args.out, result)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k not in ("config", "losses")}))
    else:
        print(f"perplexity {result['perplexity_before']:.3f} -> {result['perplexity_after']:.3f} "
              f"({result['perplexity_drop_pct']:.1f}% lower) in {result['steps']} steps")
    return result


if __name__ == "__main__":
    main()
