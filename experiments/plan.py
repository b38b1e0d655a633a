"""What fits? Compile each training-step candidate abstractly and recommend one.

  python -m experiments.plan --preset 7.5b --devices 64 --device-memory 32GB
  python -m experiments.plan --params 70B --devices 512 --device-memory 80GB --seq 4096
  python -m experiments.plan --d-model 1024 --n-layers 8 --n-heads 8 --n-kv-heads 2 \\
      --d-ff 4096 --devices 8 --device-memory 2GB --json

Candidates: strategy (dp, zero1, zero2, zero3, zero3_prefetch) x mesh data x fsdp x remat (none,
save_dots, full) x micro-batch (sequences per device per micro-step; the rest of the global batch
is gradient accumulation). Each is the trainer's step compiled for fake CPU devices on abstract
inputs (nothing allocated); model state, peak and communication volume are read from the
compiled program (experiments/zero/plan_search.py says how, and how the search avoids compiles).
The table lists what fits, ranked by estimated step time; the recommendation is the cheapest that
fits within the device memory less --headroom. With --json the last line is
{"candidates": [{"strategy", "mesh", "remat", "micro_batch", "model_state_gb", "peak_gb",
"comm_volume_psi", "fits", ...}, ...], "recommended": {...} or null, ...}.

--params 70B picks the member of our GPT family (the GPT-3-style presets' width/depth curve,
head dim 128, d_ff = 4 d_model, byte vocabulary) closest in size, and says which. GB = 1e9 bytes.
The peak is XLA:CPU's (see experiments/zero/plan_estimate.py on what that backend adds in bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from experiments.cli import startup
from experiments.cli.config import (
    ConfigError,
    Parser,
    check_devices,
    check_output_file,
    check_output_folder,
    fail,
)
from experiments.reporting.results_io import command_line, write_result
from experiments.zero.plan_request import (
    GB,
    REMATS,
    STRATEGIES,
    PlanRequest,
    check_fields,
    parse_bytes,
    parse_count,
)
from model.config import MODEL_PRESETS, ModelConfig

PROG = "experiments.plan"
SHAPE_FLAGS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab")
DEFAULT_SEQ = 2048


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="a model preset (model/config.py)")
    p.add_argument("--params", help="a size such as 70B: the GPT-family member closest to it")
    for flag in SHAPE_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=None)
    p.add_argument("--devices", type=int, default=8, help="device count (default 8)")
    p.add_argument("--device-memory", default="80GB", help="per device, e.g. 80GB, 24GiB")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default: the preset's max_len, else 2048)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default 8 per device)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (bf16 params and compute, fp32 "
                   "master and Adam) or float32")
    p.add_argument("--headroom", type=float, default=None,
                   help="fraction of the memory kept free (default 0.1)")
    p.add_argument("--strategies", default=None, help="comma-separated subset")
    p.add_argument("--remats", default=None, help="comma-separated subset")
    p.add_argument("--micro-batches", default=None, help="comma-separated subset")
    p.add_argument("--data-sizes", default=None, help="mesh data sizes to try (default: all)")
    p.add_argument("--tflops", type=float, default=None, help="device rate for the ranking")
    p.add_argument("--link-gb-s", type=float, default=None, help="link rate for the ranking")
    p.add_argument("--budget-s", type=float, default=None,
                   help="compile on after the recommendation is settled until this many "
                        "seconds (default 60)")
    p.add_argument("--cache", default="runs/plan-cache", help="compile results cache folder")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--all", action="store_true", help="list every candidate, not only fits")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    return p


def _ints(text: str | None, field: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{field}={text!r}: expected comma-separated integers") from None


def _names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(x.strip() for x in text.split(","))


def request_from_args(args) -> PlanRequest:
    """The PlanRequest the flags ask for; ConfigError naming the first bad flag. Every flag is
    checked before JAX is imported; only --params then needs it, to find the family member."""
    _check_single_flags(args)
    seq = args.seq or (MODEL_PRESETS[args.preset].max_len if args.preset in MODEL_PRESETS
                       else DEFAULT_SEQ)
    extra = {k: v for k, v in (("headroom", args.headroom), ("tflops", args.tflops),
                               ("link_gb_s", args.link_gb_s)) if v is not None}
    fields = dict(
        devices=args.devices, device_memory=parse_bytes(args.device_memory), seq_len=seq,
        global_batch=args.global_batch if args.global_batch is not None else 8 * args.devices,
        strategies=_names(args.strategies) or STRATEGIES, remats=_names(args.remats) or REMATS,
        micro_batches=_ints(args.micro_batches, "micro-batches"),
        data_sizes=_ints(args.data_sizes, "data-sizes"), **extra)
    check_fields(**fields)
    model, note = _model(args)
    model = dataclasses.replace(model, param_dtype=args.dtype, compute_dtype=args.dtype,
                                max_len=seq)
    req = PlanRequest(model=model, shape_note=note, **fields)
    req.validate()
    return req


def _check_single_flags(args) -> None:
    """The flags whose values are wrong on their own, whatever else is given."""
    for f in SHAPE_FLAGS:
        if getattr(args, f) is not None and getattr(args, f) <= 0:
            raise ConfigError(f"{f.replace('_', '-')}={getattr(args, f)}: must be a positive "
                              f"integer")
    if args.dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"dtype={args.dtype!r}: allowed bfloat16, float32")
    if args.seq is not None and args.seq < 1:
        raise ConfigError(f"seq={args.seq}: must be a positive integer")
    if args.preset is not None and args.preset not in MODEL_PRESETS:
        raise ConfigError(f"preset={args.preset!r}: allowed {', '.join(MODEL_PRESETS)}")
    if args.params is not None:
        parse_count(args.params)
    check_devices(args.devices)  # the plan compiles on this many fake CPU devices
    if args.budget_s is not None and not args.budget_s >= 0:
        raise ConfigError(f"budget-s={args.budget_s}: must be >= 0")
    if args.out is not None:
        check_output_file("out", args.out, "the plan")
    if not args.no_cache:
        check_output_folder("cache", args.cache, "the compile cache")


def _model(args) -> tuple[ModelConfig, str]:
    """(model shape, note) from exactly one of --preset, --params or the shape flags."""
    shape_given = [f for f in SHAPE_FLAGS if getattr(args, f) is not None]
    chosen = [name for name, given in (("--preset", args.preset is not None),
                                       ("--params", args.params is not None),
                                       ("shape flags", bool(shape_given))) if given]
    if len(chosen) != 1:
        raise ConfigError(f"model: give exactly one of --preset, --params or the shape flags "
                          f"(--d-model --n-layers --n-heads --d-ff [--n-kv-heads --vocab]); "
                          f"got {', '.join(chosen) or 'none'}")
    if args.preset is not None:
        return MODEL_PRESETS[args.preset], f"preset {args.preset}"
    if args.params is not None:
        (family,) = startup.load("experiments.zero.plan_family")
        member = family.family_shape(family.family_width_for(parse_count(args.params)))
        return member, f"--params {args.params}: our GPT family's closest member"
    missing = [f for f in ("d_model", "n_layers", "n_heads", "d_ff") if getattr(args, f) is None]
    if missing:
        raise ConfigError(f"shape: --{missing[0].replace('_', '-')} is required with the "
                          f"shape flags (--d-model --n-layers --n-heads --d-ff)")
    return ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                       n_kv_heads=args.n_kv_heads, d_ff=args.d_ff,
                       vocab_size=args.vocab or 256), "shape flags"


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        req = request_from_args(args)
    except ConfigError as e:
        fail(PROG, str(e))

    family, search, estimate = startup.begin(
        "experiments.zero.plan_family", "experiments.zero.plan_search",
        "experiments.zero.plan_estimate", devices=req.devices)
    print(f"model: {family.describe_shape(req.model)} [{req.shape_note}]; "
          f"{req.devices} devices x {req.device_memory / GB:g} GB, usable {req.usable / GB:.3g} GB "
          f"(headroom {req.headroom:.0%}); seq {req.seq_len}, global batch {req.global_batch}, "
          f"{req.model.param_dtype}", file=sys.stderr)
    cache = estimate.CompileCache(None if args.no_cache else args.cache)
    result = search.plan(req, cache=cache, budget_s=args.budget_s if args.budget_s is not None
                         else search.DEFAULT_BUDGET_S,
                         progress=lambda line: print(line, file=sys.stderr, flush=True))
    out = sys.stderr if args.json else sys.stdout
    print(search.format_table(result, show_all=args.all), file=out)
    counts = ", ".join(f"{v} {k}" for k, v in result["counts"].items() if v)
    print(f"{len(result['candidates'])} candidates: {counts}; {result['compiles']} compiles in "
          f"{result['wall_s']} s", file=out)
    rec = result["recommended"]
    if rec is None:
        least = min(result["candidates"], key=lambda r: r["model_state_gb"])
        print(f"nothing fits in {req.usable / GB:.3g} GB usable: the smallest model "
              f"state is {least['model_state_gb']:.3g} GB ({least['strategy']} on "
              f"{least['mesh']}), and no compiled peak was within the memory", file=out)
    else:
        print(f"recommended: {rec['strategy']} on {rec['mesh']}, remat {rec['remat']}, "
              f"micro-batch {rec['micro_batch']} ({rec['micro_steps']} micro-steps): peak "
              f"{rec['peak_gb']:.2f} GB of {req.usable / GB:.3g} GB usable "
              f"({req.headroom:.0%} headroom), {rec['comm_volume_psi']:.2f} Ψ per step, "
              f"estimated {rec['est_step_s']:.2f} s/step at {req.tflops:g} TFLOP/s and "
              f"{req.link_gb_s:g} GB/s" + ("" if result["complete"] else
                                            " (search stopped at its time limit)"), file=out)
    if args.out:
        write_result(args.out, {**result, "command": command_line(PROG, argv)})
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
