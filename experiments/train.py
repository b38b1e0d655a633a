"""Train a language model on a (fake or real) device mesh.

  python -m experiments.train --workdir runs/small --preset small --steps 1500 --devices 8

  python -m experiments.train --workdir runs/small --resume --devices 4 --strategy zero3
  python -m experiments.train --workdir runs/more --init runs/small --steps 500 --lr 1e-3
  python -m experiments.train --workdir runs/ft --init path/to/hf_folder --steps 20

Writes WORKDIR/config.json, WORKDIR/metrics.jsonl (one JSON object per logged step), Orbax
checkpoints under WORKDIR/checkpoints/, and at the end WORKDIR/summary.json with its loss curve
WORKDIR/summary.png. Prints the same JSON summary on its last line. --resume
continues the run from its newest intact checkpoint with the run's own config.json; the flags
given over it may change the layout and the logging, evaluation and checkpoint cadence, and a
flag that would change the model or the optimisation is refused, naming the field. A finished
run is extended by a new one: --init RUN starts a new run (new workdir, new schedule) from the
run's newest intact checkpoint, with its model, tokenizer and training config (the flags given
change it; --preset takes that preset's training config instead).

--init REF also takes any pretrained model `--model` accepts (experiments/pretrained/model_ref.py:
smollm2, gemma3-270m, a .gguf file, a Hugging Face folder): the run trains REF's own
architecture on text tokenized with REF's tokenizer, its weights placed one tensor at a time
into their shards. The dtypes, remat, context and training config come from --preset (default:
the preset named like the model, else the fine-tuning defaults: zero3, bf16, context 128, the
pydoc topics); config.json records REF (a path made absolute), so `--model RUN` later reads the
run with REF's architecture and tokenizer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_output_folder, fail
from experiments.cli.flags import add_override_flags, config_from_args
from experiments.training.config import PRESETS, Config, load_config
from experiments.training.init_config import pretrained_base

PROG = "experiments.train"
DEFAULT_PRESET = "small"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="where config, metrics and checkpoints go")
    p.add_argument("--preset", default=None,
                   help=f"one of {', '.join(PRESETS)} (default {DEFAULT_PRESET}; with --resume "
                        "the run's own)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in WORKDIR, with its config.json; flags given change "
                        "only what a resumed run may change (the layout, how often it logs, "
                        "evaluates and checkpoints)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_override_flags(p)
    return p


def base_config(args: argparse.Namespace) -> Config | None:
    """The config the flags given are applied over: with --resume, the run's own; with --init
    naming a pretrained model, that model's (init_config.pretrained_base; args.override_init
    becomes what the run records); else None: the preset's (default DEFAULT_PRESET), or with
    --init RUN that run's."""
    resumed = _resumed_config(args)
    if resumed is not None or args.override_init is None or args.resume:
        return resumed
    base = pretrained_base(args.override_init, args.preset, args.override_n_layers,
                           args.override_data)
    if base is not None:
        args.override_init = base.train.init
    return base


def _resumed_config(args: argparse.Namespace) -> Config | None:
    if not (args.resume and (Path(args.workdir) / "config.json").exists()):
        return None
    run = load_config(args.workdir)
    if args.preset not in (None, run.preset):
        raise ConfigError(f"preset={args.preset!r}: the run in {args.workdir} is "
                          f"{run.preset!r}; --resume continues it with its own configuration "
                          f"(give only the flags that change)")
    return run


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args, base=base_config(args), default_preset=DEFAULT_PRESET)
        check_output_folder("workdir", args.workdir, "the run")
    except ConfigError as e:
        fail(PROG, str(e))
    # JAX starts here, after the flags are checked: a refused flag never waits for it.
    jax, guards, trainer, run_summary = startup.begin(
        "jax", "experiments.training.guards", "experiments.training.trainer",
        "experiments.training.run_summary", devices=cfg.train.devices, model=cfg.model)
    try:
        summary = trainer.train_and_evaluate(cfg, args.workdir, resume=args.resume,
                                             progress=not args.no_progress)
    except ConfigError as e:
        fail(PROG, str(e))
    except guards.RunStopped as e:  # a non-finite step, a checkpoint that could not be written
        fail(PROG, str(e), code=1)

    if jax.process_index() == 0:
        byte_tokens = summary["tokens"] == "bytes"
        title = (f"{cfg.preset}: {summary['bits_per_byte']:.3f} bits/byte" if byte_tokens else
                 f"{cfg.preset}: perplexity {summary['val_perplexity']:.3f}")
        run_summary.write_summary(args.workdir, summary, f"{title} at step {summary['step']}",
                                  byte_tokens=byte_tokens)
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
