"""Loading the model a `--model REF` names when it is not a GGUF: a Hugging Face folder or a
training run's folder (experiments/pretrained/model_ref.py decides which, JAX-free).

Both give what `experiments.pretrained.loading.Pretrained` holds: the decoder's config, its
float32 parameters as a pure dict, and a tokenizer with the interface of
`model.tokenizer.BPETokenizer` (encode / decode / eos_id / token_id).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from experiments.cli.config import ConfigError
from experiments.pretrained.model_ref import ModelRef
from experiments.training import run_tokenizer
from experiments.training.config import load_config
from experiments.training.restore import restore_params
from model.config import ModelConfig
from model.hf_decoder import HFError, load_hf
from model.hf_tokenizer import HFTokenizer, HFTokenizerError


@dataclasses.dataclass
class Loaded:
    cfg: ModelConfig
    params: dict  # float32 numpy, pure dict of DecoderLM(cfg)
    tokenizer: object
    step: int | None = None  # a run's checkpoint step


def _first_layers(params: dict, n: int) -> dict:
    """The stacked block leaves cut to their first `n` layers (a truncated model)."""
    return {**params, "blocks": jax.tree.map(lambda a: a[:n], params["blocks"])}


def load_hf_folder(ref: ModelRef, n_layers: int | None = None) -> Loaded:
    try:
        cfg, params = load_hf(ref.ref, n_layers=n_layers)
        tokenizer = HFTokenizer(ref.ref)
    except (HFError, HFTokenizerError) as e:
        raise ConfigError(f"model={ref.ref!r}: {str(e).splitlines()[0]}") from None
    return Loaded(cfg, params, tokenizer)


def load_run(ref: ModelRef, n_layers: int | None = None, step: int | None = None) -> Loaded:
    """The newest intact checkpoint of a run (or `step`), on one device, with the tokenizer the
    run was trained with; a run on bytes has no tokenizer these commands can use."""
    run_cfg = load_config(ref.ref)
    tokenizer = run_tokenizer.tokenizer_for(run_cfg.train.init)
    if tokenizer is None:
        raise ConfigError(f"model={ref.ref!r}: a run trained on bytes from random weights; "
                          f"these commands need a tokenizer (use experiments.sample/evaluate)")
    restored = restore_params(ref.ref, run_cfg, step, devices=1, strategy="dp")
    params = jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), restored.params)
    cfg = restored.cfg.model
    if n_layers is not None:
        if not 1 <= n_layers <= cfg.n_layers:
            raise ConfigError(f"layers={n_layers}: must be in 1..{cfg.n_layers} (the run's "
                              f"layers)")
        cfg, params = dataclasses.replace(cfg, n_layers=n_layers), _first_layers(params,
                                                                                  n_layers)
    return Loaded(cfg, params, tokenizer, restored.step)


def load_ref(ref: ModelRef, n_layers: int | None = None) -> Loaded:
    if ref.kind == "hf":
        return load_hf_folder(ref, n_layers)
    if ref.kind == "run":
        return load_run(ref, n_layers)
    raise ConfigError(f"model={ref.ref!r}: a {ref.kind} is read by the GGUF loader")
