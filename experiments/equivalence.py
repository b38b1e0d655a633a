"""Every strategy and mesh against a single-device run: same global batch, same seed.

  python -m experiments.equivalence --devices 8 --steps 20 --json

For each strategy (dp, zero1, zero2, zero3, zero3_prefetch, zero3_auto), each device count
1, 2, 4, 8 and a 2x4 (data x fsdp) hybrid mesh, in fp32 and in mixed precision (bf16 working
params and compute, fp32 master weights), reports the largest per-step loss difference and the
largest final-parameter difference against the single-device dp run of the same precision.
Batches are real text from the default corpus. Writes experiments/results/equivalence.json
(--out) and prints its JSON last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from experiments import runtime
from experiments.config import PRESETS, fail

PROG = "experiments.equivalence"
FP32_TOLERANCE = 1e-5


def run_steps(strategy: str, devices: int, batches, mesh: str | None, model, train):
    """Per-step losses and final params (host numpy) of len(batches) training steps.

    `strategy` is one of parallel.strategies.VARIANTS (zero3_prefetch included).
    """
    import jax
    import numpy as np

    from experiments.optim import make_optimizer
    from parallel.mesh import make_mesh
    from parallel.state import abstract_model, init_state
    from parallel.strategies import parse_variant
    from parallel.train_step import StepConfig, make_train_step

    strategy, prefetch = parse_variant(strategy)
    tx = make_optimizer(train)
    graphdef, axes, _ = abstract_model(model)
    abstract_state = jax.eval_shape(lambda: init_state(model, tx, train.seed))
    micro, batch, length = batches[0].shape
    step, shardings, batch_sharding = make_train_step(
        graphdef, axes, abstract_state, model, strategy, make_mesh(devices, mesh), tx,
        StepConfig(global_batch=batch, seq_len=length - 1, micro_steps=micro,
                   clip_norm=train.clip_norm, prefetch=prefetch))
    state = jax.jit(lambda: init_state(model, tx, train.seed), out_shardings=shardings)()
    losses = []
    for b in batches:
        state, metrics = step(state, jax.device_put(b, batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state["params"])


def max_tree_diff(a, b) -> float:
    import jax
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (largest mesh)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-steps", type=int, default=2, help="gradient accumulation")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", default="experiments/results/equivalence.json")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1:
        fail(PROG, f"steps={args.steps}: must be a positive integer")
    if args.devices < 1 or args.devices & (args.devices - 1):
        fail(PROG, f"devices={args.devices}: must be a power of two")
    if args.preset not in PRESETS:
        fail(PROG, f"preset={args.preset!r}: allowed {', '.join(PRESETS)}")
    runtime.start(args.devices)
    import numpy as np
    from tqdm import tqdm

    from experiments.data import SequenceSampler, load_corpus, pack
    from parallel.strategies import VARIANTS

    base = PRESETS[args.preset]
    train = base.train
    rows = pack(load_corpus(None)[0], base.model.max_len)
    sampler = SequenceSampler(rows, seed=0)
    batch = max(train.batch_size, args.devices)
    batches = [sampler.next_batch(batch).reshape(args.micro_steps, -1, rows.shape[1])
               for _ in range(args.steps)]
    meshes = [(n, None) for n in (1, 2, 4, 8) if n <= args.devices]
    if args.devices >= 8:
        meshes.append((8, "data=2,fsdp=4"))
    precisions = {"float32": base.model, "bfloat16": dataclasses.replace(
        base.model, param_dtype="bfloat16", compute_dtype="bfloat16")}
    results = []
    cells = [(d, s, n, m) for d in precisions for s in VARIANTS for n, m in meshes]
    t0 = time.perf_counter()
    refs = {d: run_steps("dp", 1, batches, None, precisions[d], train) for d in precisions}
    for dtype, strategy, n, mesh in tqdm(cells, desc="equivalence"):
        ref_losses, ref_params = refs[dtype]
        losses, params = run_steps(strategy, n, batches, mesh, precisions[dtype], train)
        results.append({"strategy": strategy, "devices": n, "mesh": mesh or f"data=1,fsdp={n}",
                        "dtype": dtype, "max_loss_diff": float(np.abs(losses - ref_losses).max()),
                        "max_param_diff": max_tree_diff(params, ref_params),
                        "final_loss": float(losses[-1])})
    fp32 = [r for r in results if r["dtype"] == "float32"]
    out = {"preset": args.preset, "steps": args.steps, "global_batch": batch,
           "micro_steps": args.micro_steps, "reference": "dp on 1 device, same precision",
           "fp32_tolerance": FP32_TOLERANCE,
           "fp32_max_loss_diff": max(r["max_loss_diff"] for r in fp32),
           "fp32_all_within_tolerance": all(r["max_loss_diff"] <= FP32_TOLERANCE for r in fp32),
           "seconds": time.perf_counter() - t0, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if not args.json:
        for r in results:
            print(f"{r['dtype']:8s} {r['strategy']:10s} {r['mesh']:14s} "
                  f"loss diff {r['max_loss_diff']:.2e}  param diff {r['max_param_diff']:.2e}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
