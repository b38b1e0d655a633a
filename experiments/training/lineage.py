"""Where a run's weights and tokens come from: random weights on bytes, a pretrained model, or
another run (`init` names a run folder), followed back to the first run of the chain.

A run started from another run keeps that run's model and tokenizer, so what its tokens are is
decided by the run at the root: bytes when it trained from random weights, the pretrained
model's vocabulary when it started from one. Importing this module does not import JAX.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from experiments.cli.config import ConfigError
from experiments.training.config import PRESETS, PRETRAINED_INITS, Config, load_config
from model.config import differing_fields

# A chain longer than this is almost surely runs that name each other.
MAX_CHAIN = 64


@dataclasses.dataclass(frozen=True)
class Origin:
    """`pretrained`: the registered model at the root of the chain (None: trained on bytes);
    `runs`: the run folders followed, nearest first."""
    pretrained: str | None
    runs: tuple[str, ...] = ()

    @property
    def byte_tokens(self) -> bool:
        return self.pretrained is None


def is_run_folder(init: str) -> bool:
    return (Path(init) / "config.json").is_file()


def source_config(init: str) -> Config:
    """The config of the run folder `init` names; ConfigError naming `init` otherwise."""
    try:
        return load_config(init)
    except ConfigError as e:
        raise ConfigError(f"init={init!r}: {str(e).split(': ', 1)[-1]}") from None


def origin(init: str | None) -> Origin:
    """Follow `init` through run folders to a registered model or to a run from scratch."""
    runs: list[str] = []
    while init is not None and init not in PRETRAINED_INITS:
        if len(runs) >= MAX_CHAIN or init in runs:
            raise ConfigError(f"init={runs[0]!r}: its runs name each other as init in a loop")
        if not is_run_folder(init):
            first = f" (started from {runs[0]!r})" if runs else ""
            raise ConfigError(f"init={init!r}{first}: not a run folder (no config.json) nor "
                              f"one of {', '.join(PRETRAINED_INITS)}; the run's weights and "
                              f"tokenizer come from there")
        runs.append(init)
        init = source_config(init).train.init
    return Origin(init, tuple(runs))


def config_from_run(init: str, preset: str | None) -> Config:
    """The base of a new run started from the run folder `init`: its model (and so its
    tokenizer), and its training config (or `preset`'s) with `init` pointing at it. The path is
    recorded absolute, so the new run finds its source from any working folder."""
    src = source_config(init)
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"preset={preset!r}: allowed {', '.join(PRESETS)}")
    train = PRESETS[preset].train if preset is not None else src.train
    return Config(src.preset, src.model,
                  dataclasses.replace(train, init=str(Path(init).resolve())))


def check_same_model(init: str, cfg: Config) -> None:
    """A run started from another run trains that run's model: only how it is computed
    (EXECUTION_FIELDS), its context and its compute dtype may change."""
    src = source_config(init)
    free = {"max_len", "compute_dtype"}
    diff = [f for f in differing_fields(dataclasses.asdict(src.model), cfg.model)
            if f not in free]
    if diff:
        f = diff[0]
        raise ConfigError(f"init={init!r}: {f}={getattr(cfg.model, f, None)!r} differs from the "
                          f"run's {getattr(src.model, f, None)!r}; a run started from another "
                          f"keeps its model")
