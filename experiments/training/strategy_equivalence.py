"""Every strategy and mesh against a single-device run: same global batch, same seed.

`grid` runs a preset's model over strategies, device counts (and a 2x4 hybrid mesh) and
precisions; `pretrained` runs the first blocks of a pretrained model over strategies and device
counts in fp32. Each returns the table `experiments.equivalence` writes.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from tqdm import tqdm

from experiments.training.config import PRESETS, Config
from experiments.training.data import SequenceSampler, load_corpus, pack
from experiments.training.optim import make_optimizer
from experiments.training.pretrained_init import truncated_model
from parallel.sharded_run import max_tree_diff, run_label

FP32_TOLERANCE = 1e-5


def _batches(rows: np.ndarray, batch: int, micro_steps: int, steps: int) -> list[np.ndarray]:
    """`steps` global batches of `batch` rows, each split into `micro_steps` micro-batches."""
    sampler = SequenceSampler(rows, seed=0)
    return [sampler.next_batch(batch).reshape(micro_steps, -1, rows.shape[1])
            for _ in range(steps)]


def meshes(devices: int, counts: list[int] | None) -> list[tuple[int, str | None]]:
    """(device count, mesh spec) of each run: powers of two up to `devices`, the 2x4 hybrid
    mesh with 8 or more, only the `counts` given when some are."""
    out: list[tuple[int, str | None]] = [(n, None) for n in (1, 2, 4, 8) if n <= devices]
    if devices >= 8:
        out.append((8, "data=2,fsdp=4"))
    return [(n, m) for n, m in out if n in counts] if counts else out


def grid(base: Config, *, steps: int, micro_steps: int, devices: int, strategies: list[str],
         counts: list[int] | None, precisions: list[str]) -> dict:
    """Each (precision, strategy, mesh) against dp on one device in the same precision, on
    batches of real text from the default corpus."""
    train = base.train
    tx = make_optimizer(train)
    rows = pack(load_corpus(None)[0], base.model.max_len)
    batch = max(train.batch_size, devices)
    batches = _batches(rows, batch, micro_steps, steps)
    models = {"float32": base.model, "bfloat16": dataclasses.replace(
        base.model, param_dtype="bfloat16", compute_dtype="bfloat16")}
    models = {d: m for d, m in models.items() if d in precisions}
    cells = [(d, s, n, m) for d in models for s in strategies for n, m in meshes(devices, counts)]
    t0 = time.perf_counter()
    refs = {d: run_label("dp", 1, batches, models[d], tx, seed=train.seed,
                         clip_norm=train.clip_norm) for d in models}
    results = []
    for dtype, strategy, n, mesh in tqdm(cells, desc="equivalence"):
        ref_losses, ref_params = refs[dtype]
        losses, params = run_label(strategy, n, batches, models[dtype], tx, seed=train.seed,
                                   clip_norm=train.clip_norm, mesh_spec=mesh)
        results.append({"strategy": strategy, "devices": n, "mesh": mesh or f"data=1,fsdp={n}",
                        "dtype": dtype, "max_loss_diff": float(np.abs(losses - ref_losses).max()),
                        "max_param_diff": max_tree_diff(params, ref_params),
                        "final_loss": float(losses[-1])})
    fp32 = [r["max_loss_diff"] for r in results if r["dtype"] == "float32"]
    return {"preset": base.preset, "steps": steps, "global_batch": batch,
            "micro_steps": micro_steps, "reference": "dp on 1 device, same precision",
            "fp32_tolerance": FP32_TOLERANCE,
            # None when the grid has no fp32 run: nothing to hold to the tolerance.
            "fp32_max_loss_diff": max(fp32) if fp32 else None,
            "fp32_all_within_tolerance": all(d <= FP32_TOLERANCE for d in fp32) if fp32 else None,
            "seconds": time.perf_counter() - t0, "results": results}


def pretrained(*, layers: int, steps: int, micro_steps: int, devices: int,
               strategies: list[str], counts: list[int]) -> dict:
    """Each strategy on each device count against dp on one device, from SmolLM2's first
    `layers` pretrained blocks, in fp32."""
    cfg, params, rows = truncated_model("smollm2", layers)
    train = PRESETS["smollm2"].train
    tx = make_optimizer(train)
    batch = devices * micro_steps
    batches = _batches(rows, batch, micro_steps, steps)
    t0 = time.perf_counter()
    ref_losses, ref_params = run_label("dp", 1, batches, cfg, tx, seed=0,
                                       clip_norm=train.clip_norm, init_params=params)
    results = []
    for strategy, n in tqdm([(s, n) for s in strategies for n in counts], desc="equivalence"):
        losses, out = run_label(strategy, n, batches, cfg, tx, seed=0,
                                clip_norm=train.clip_norm, init_params=params)
        results.append({"strategy": strategy, "devices": n,
                        "max_loss_diff": float(np.abs(losses - ref_losses).max()),
                        "max_param_diff": max_tree_diff(out, ref_params),
                        "losses": losses.tolist()})
    return {"model": f"smollm2, first {layers} blocks (pretrained), fp32",
            "steps": steps, "global_batch": batch, "micro_steps": micro_steps,
            "seq_len": cfg.max_len, "reference": "dp on 1 device",
            "reference_losses": ref_losses.tolist(), "fp32_tolerance": FP32_TOLERANCE,
            "max_loss_diff": max(r["max_loss_diff"] for r in results),
            "all_within_tolerance": all(r["max_loss_diff"] <= FP32_TOLERANCE for r in results),
            "seconds": time.perf_counter() - t0, "results": results}
