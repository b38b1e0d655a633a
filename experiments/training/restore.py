"""Load a trained run's parameters (config + an Orbax checkpoint) for evaluation, sampling or
quantisation.

Only what that needs is built: the model config, the abstract parameters and their shardings on
the requested mesh. No corpus is read, no optimizer or train step is built, and only the
parameters are read from the checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from jax.sharding import Mesh

from experiments.cli.config import ConfigError
from experiments.cli.runtime import attention_here
from experiments.training import checkpoint as ckpt
from experiments.training.config import Config, load_config
from experiments.training.data import (
    SequenceSampler,
    bos_of,
    load_tokens,
    pack,
    validation_batches,
)
from experiments.training.run_tokenizer import tokenizer_for
from model import ModelConfig
from parallel.mesh import make_mesh
from parallel.state import abstract_model, check_divisible, logical_shardings
from parallel.strategies import Strategy, get_strategy


@dataclasses.dataclass(frozen=True)
class Restored:
    """A trained model placed on a mesh: what evaluation and sampling need."""
    cfg: Config
    mesh: Mesh
    strategy: Strategy
    graphdef: object
    axes: dict  # logical axis names of every parameter
    params: dict
    step: int


def restore_params(workdir: str | Path, cfg: Config | None = None, step: int | None = None, *,
                   devices: int | None = None, strategy: str | None = None,
                   mesh: str | None = None) -> Restored:
    """The run's parameters (the newest intact checkpoint, or `step`) laid out for the given
    device count and strategy (default: the run's strategy, all devices on one fsdp axis)."""
    cfg = cfg or load_config(workdir)
    cfg = dataclasses.replace(cfg, model=attention_here(cfg.model))
    try:
        device_mesh = make_mesh(devices * jax.process_count() if devices else None, mesh)
        strat = get_strategy(strategy or cfg.train.strategy)
        graphdef, axes, abstract_params = abstract_model(cfg.model)
        check_divisible(abstract_params, axes, device_mesh, strat)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    shardings = {"params": logical_shardings(axes, device_mesh, strat.shards_params)}
    mngr = ckpt.manager(workdir, read_only=True)
    try:
        steps = mngr.all_steps()
        if step is not None and step not in steps:
            raise ConfigError(f"step={step}: no such checkpoint; available: {sorted(steps)}")
        check_written_with(mngr, sorted(steps, reverse=True) if step is None else [step],
                           cfg.model)
        restored = ckpt.restore_latest_intact(Path(workdir), mngr, {"params": abstract_params},
                                              shardings, params_only=True, step=step)
    except ckpt.NoIntactCheckpoint as e:
        raise ConfigError(str(e)) from None
    finally:
        mngr.close()
    if restored is None:
        raise ConfigError(f"workdir={str(workdir)!r}: holds no checkpoint")
    state, _, found = restored
    return Restored(cfg, device_mesh, strat, graphdef, axes, state["params"], found)


# The model fields a checkpoint's parameters were trained for: their shapes and types, and the
# function they compute. Left out: how it is computed or for how long a context (compute_dtype,
# remat, attention, scan_unroll, max_len), which a reader may choose. kv_heads, not n_kv_heads:
# None and n_heads are the same model.
WRITTEN_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "kv_heads", "d_ff", "mlp",
                  "tie_embeddings", "rope_base", "norm_eps", "param_dtype", "head_size",
                  "qkv_bias", "qk_norm", "sliding_window", "rotary_dim", "rope_scale_factor",
                  "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len",
                  "rope_short_factors", "rope_long_factors", "rope_attention_factor")


def check_written_with(mngr, steps: list[int], model) -> None:
    """The model config a checkpoint's metadata records against the run's config.json, before
    any array is read: a config.json edited after training is named field by field (reading
    the arrays would fail deep inside Orbax instead). The newest checkpoint whose metadata
    reads decides; one that does not read is left to the integrity checks."""
    for step in steps:
        try:
            written = ckpt.read_meta(mngr, step).get("model")
        except Exception:  # noqa: BLE001 - a damaged checkpoint: restore_latest_intact says so
            continue
        if not isinstance(written, dict):
            return  # written before checkpoints recorded their model
        try:
            written_model = ModelConfig(**written)
        except TypeError:  # fields this version does not know: the arrays' own check decides
            return
        for field in WRITTEN_FIELDS:
            ours, theirs = getattr(model, field), getattr(written_model, field)
            if ours != theirs:
                if field == "kv_heads":  # the config field is n_kv_heads (None: one per head)
                    field, ours, theirs = ("n_kv_heads", f"{model.n_kv_heads!r} ({ours} key/value "
                                           f"heads)", f"{theirs} key/value heads")
                else:
                    ours, theirs = repr(ours), f"{field}={theirs!r}"
                raise ConfigError(f"{field}={ours}: config.json does not match checkpoint "
                                  f"{step}, written with {theirs} (was config.json edited after "
                                  f"training?)")
        return


def run_rows(cfg: Config) -> tuple:
    """(train, val) rows of a run as its trainer packed them: bytes, or its pretrained model's
    token ids, each row starting with the tokenizer's BOS where it has one."""
    t = cfg.train
    tokenizer = tokenizer_for(t.init)
    parts = load_tokens(t.data, t.val_percent, t.corpus,
                        None if tokenizer is None else tokenizer.encode)
    return tuple(pack(part, cfg.model.max_len, bos_of(tokenizer)) for part in parts)


def validation_rows(cfg: Config, eval_batches: int | None = None) -> list:
    """The run's fixed validation batches (token rows), as its trainer evaluated them."""
    t = cfg.train
    try:  # the corpus may have changed since training: it is read again here
        _, val_rows = run_rows(cfg)
        return validation_batches(val_rows, t.batch_size // t.micro_steps,
                                  eval_batches or t.eval_batches)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def calibration_rows(cfg: Config, n: int) -> tuple[list, dict]:
    """The run's first n training batches from a fresh sampler (same seed), and where they came
    from: pinned, reproducible calibration data for quantisation."""
    t = cfg.train
    try:
        train_rows, _ = run_rows(cfg)
        sampler = SequenceSampler(train_rows, t.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    batch = t.batch_size // t.micro_steps
    rows = [sampler.next_batch(batch) for _ in range(n)]
    return rows, {"source": "train split", "sampler_seed": t.seed, "start_position": 0,
                  "batches": n, "batch_size": batch, "seq_len": cfg.model.max_len}
