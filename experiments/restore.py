"""Load a trained run (config + latest Orbax checkpoint) for evaluation or sampling."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from experiments import checkpoint as ckpt
from experiments.config import Config
from experiments.trainer import ConfigError, Run, prepare


def load_config(workdir: str | Path) -> Config:
    path = Path(workdir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"workdir={str(workdir)!r}: no config.json; train a model there first")
    try:
        return Config.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"workdir={str(workdir)!r}: config.json is not a shardq config ({e})") \
            from None


def restore_params(workdir: str | Path, cfg: Config, step: int | None = None,
                   **train_overrides) -> tuple[Run, dict, int]:
    """(run, params, step) with params laid out for the (possibly different) mesh/strategy."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train_overrides))
    run = prepare(cfg)
    mngr = ckpt.manager(workdir, read_only=True)
    try:
        steps = mngr.all_steps()
        if step is not None and step not in steps:
            raise ConfigError(f"step={step}: no such checkpoint; available: {sorted(steps)}")
        restored = ckpt.restore_latest_intact(Path(workdir), mngr, run.abstract_state,
                                              run.shardings, params_only=True, step=step)
    except ckpt.NoIntactCheckpoint as e:
        raise ConfigError(str(e)) from None
    finally:
        mngr.close()
    if restored is None:
        raise ConfigError(f"workdir={str(workdir)!r}: holds no checkpoint")
    state, _, step = restored
    return run, state["params"], step
