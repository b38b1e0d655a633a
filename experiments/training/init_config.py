"""The configuration of a run started from pretrained weights (`train --init REF`): the model
is REF's own architecture, read from its file (a GGUF's metadata or a Hugging Face config.json),
and only how it is computed and for how long a context come from a preset. JAX-free: a launcher
builds it, and refuses a bad REF naming `init`, before JAX starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from experiments.cli.config import ConfigError
from experiments.pretrained import model_ref, registered
from experiments.training.config import (
    DATA_CORPUS,
    FINETUNE,
    FINETUNE_MODEL,
    FINETUNE_TRAIN,
    PRESETS,
    Config,
)
from model.config import ModelConfig
from model.gguf import GGUFFile
from model.hf_decoder import config_from_hf, read_config
from model.llama_gguf import config_from_gguf

# The model fields a preset sets over a pretrained model's own: how it is computed, and the
# context it is trained at. Every other field is the model's.
EXECUTION = ("max_len", "param_dtype", "compute_dtype", "remat", "attention", "scan_unroll")


def ref_model_config(init: str, kind: str, n_layers: int | None = None) -> ModelConfig:
    """The architecture of the pretrained model `init` (of model_ref kind `kind`: name, gguf or
    hf), its first `n_layers` blocks when given. ValueError (one line) on a file that does not
    read; GGUFError and HFError are ones."""
    if kind == "hf":
        return config_from_hf(read_config(init), repr(str(Path(init) / "config.json")), n_layers)
    path = registered.gguf_path(init) if kind == "name" else Path(init)
    return config_from_gguf(GGUFFile(path), n_layers)


def stored_init(init: str, kind: str) -> str:
    """What a run records as its `init`: a registered name as is, a path absolute (the run finds
    its model and tokenizer from any working folder)."""
    return init if kind == "name" else str(Path(init).resolve())


def pretrained_base(init: str, preset: str | None, n_layers: int | None = None,
                    data: str | None = None) -> Config | None:
    """The base config of a new run from the pretrained model `init` (None when `init` is a
    training run's folder, or no file or folder at all: experiments/training/lineage.py builds
    the one and refuses the other). The model is
    `init`'s architecture with the execution fields (EXECUTION) and the training config of
    `preset`; without one, of the preset named like the model (smollm2, gemma3-270m), else the
    fine-tuning defaults (config.FINETUNE_MODEL and FINETUNE_TRAIN); with `data`, the corpus is
    that text. ConfigError naming `init` (or `preset`) otherwise."""
    try:
        kind = model_ref.resolve(init, "init").kind
    except ConfigError:
        if not (Path(init) / "config.json").is_file():
            return None  # neither a model nor a run: lineage.origin says what is allowed
        raise
    if kind == "run":
        return None
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"preset={preset!r}: allowed {', '.join(PRESETS)}")
    if n_layers is not None and n_layers < 1:
        raise ConfigError(f"n_layers={n_layers}: must be a positive integer")
    try:
        model = ref_model_config(init, kind, n_layers)
    except ValueError as e:
        raise ConfigError(f"init={init!r}: {str(e).splitlines()[0]}") from None
    name = preset or (init if init in PRESETS else None)
    if name is not None:
        execution = {f: getattr(PRESETS[name].model, f) for f in EXECUTION}
        train = PRESETS[name].train
    else:
        name, execution, train = FINETUNE, FINETUNE_MODEL, FINETUNE_TRAIN
    train = dataclasses.replace(train, init=stored_init(init, kind))
    if data:  # the text read is the path, no named corpus
        train = dataclasses.replace(train, corpus=DATA_CORPUS)
    return Config(name, dataclasses.replace(model, **execution), train)
