"""Evaluate a trained checkpoint on the validation split.

  python -m experiments.evaluate --workdir runs/small --json
  python -m experiments.evaluate --workdir runs/small --quant w8a8 --json

Restores the latest (or --step) Orbax checkpoint onto the requested mesh and prints the validation
loss (nats per token) and, for a byte-level run, bits per byte, or, for a run on a pretrained
model's tokens, the perplexity; with --json the last line is one JSON object with at least
val_loss, bits_per_byte (byte runs) or val_perplexity (token runs), param_bytes and step.

--quant MODE evaluates the int8 model: the checkpoint `experiments.quantize` wrote under
WORKDIR/quant/MODE, or (if there is none) a model quantised in memory with that mode's defaults.
param_bytes then counts the parameters as stored (int8 values and their scales), and
quantized_fraction the share of the float parameters that are int8.
"""

from __future__ import annotations

import argparse
import functools
import json

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_devices, fail
from experiments.training import lineage
from experiments.training.config import load_config
from experiments.training.loss_names import describe_loss, loss_measures
from parallel.strategies import STRATEGIES
from quant.modes import ALL_MODES, QuantError

PROG = "experiments.evaluate"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--devices", type=int, default=None, help="fake CPU devices (default 8)")
    p.add_argument("--strategy", default=None, help=f"layout to restore into: {STRATEGIES}")
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quant", default="none",
                   help=f"evaluate the int8 model: {', '.join(ALL_MODES)} (default none)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.devices is not None:  # runtime.start checks it too, after JAX is imported
        try:
            check_devices(args.devices)
        except ConfigError as e:
            fail(PROG, str(e))
    if args.eval_batches is not None and args.eval_batches < 1:
        fail(PROG, f"eval_batches={args.eval_batches}: must be a positive integer")
    if args.quant not in ALL_MODES:
        fail(PROG, f"quant={args.quant!r}: allowed {', '.join(ALL_MODES)}")
    try:
        cfg = load_config(args.workdir)
        byte_tokens = lineage.origin(cfg.train.init).byte_tokens
    except ConfigError as e:
        fail(PROG, str(e))
    # JAX starts here, after the flags and the work dir's config are checked: a refusal never
    # waits for it.
    restore, trainer, flops, stored = startup.begin(
        "experiments.training.restore", "experiments.training.trainer", "model.flops",
        "quant.stored", devices=args.devices)
    try:
        model = restore.restore_params(args.workdir, cfg, step=args.step, devices=args.devices,
                                       strategy=args.strategy)
        val = restore.validation_rows(model.cfg, args.eval_batches)
        if val[0].shape[0] % model.mesh.size:
            raise ConfigError(f"devices={model.mesh.size}: the evaluation batch "
                              f"({val[0].shape[0]} sequences, the run's batch_size) must divide "
                              f"over the devices")
        graphdef, params = model.graphdef, model.params
        quantized_fraction, source = 0.0, None
        if args.quant != "none":
            graphdef, params, quantized_fraction, source = stored.load_or_quantize(
                args.workdir, args.quant, model.cfg.model, graphdef, params, mesh=model.mesh,
                sharded=model.strategy.shards_params, step=model.step,
                calibration=functools.partial(restore.calibration_rows, model.cfg))
    except (ConfigError, QuantError) as e:
        fail(PROG, str(e))
    val_loss = trainer.make_eval_fn(graphdef, model.mesh, val)(params)
    out = {"step": model.step, "val_loss": val_loss,
           **loss_measures(val_loss, byte_tokens, prefix=""),
           "param_bytes": flops.param_bytes(params), "quant": args.quant,
           "quantized_fraction": quantized_fraction, "quant_source": source,
           "devices": model.mesh.size, "strategy": model.strategy.name,
           "eval_tokens": sum(r.shape[0] * (r.shape[1] - 1) for r in val)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"step {model.step}: {describe_loss(val_loss, byte_tokens)} "
              f"({out['param_bytes']:,} parameter bytes)")
    return out


if __name__ == "__main__":
    main()
