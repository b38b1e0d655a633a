"""Pretrained weights straight into a sharded training run (ZeRO-3 fine-tuning from any model
reference `train --init` takes: a registered name, a .gguf file or a Hugging Face folder).

The model is built abstractly and its shardings computed first (parallel/sharded_run.py); then
the weights are read one parameter at a time (`model.llama_gguf.iter_params`: one whole tensor,
dequantised, on the host; `model.hf_decoder.iter_params`: one safetensors tensor at a time) and
each is placed into its shards with `jax.make_array_from_callback` and dropped before the next
is read, so loading never holds the whole float model on the host beside the shards. Each
process copies only the slices its own devices hold (the callback is asked for addressable
shards only); a GGUF's quantised blocks are dequantised a tensor at a time, since a Q4_1 block
row is not addressable by column.
"""

from __future__ import annotations

import dataclasses
import gc
import resource
from pathlib import Path

import jax
import numpy as np

from experiments.pretrained import model_ref, registered
from experiments.training.data import load_tokens, pack
from experiments.training.init_config import EXECUTION, ref_model_config
from model import ModelConfig, hf_decoder
from model.gguf import GGUFFile
from model.llama_gguf import (
    config_from_gguf,
    iter_params,
    load_params,
    package_gguf_path,
    set_path,
)
from model.tokenizer import tokenizer_from_gguf

PRETRAINED = ("smollm2",)


@dataclasses.dataclass(frozen=True)
class HFSource:
    """A Hugging Face folder's weights, read by `load_sharded`."""
    folder: Path


def rss_peak_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_model(name: str, cfg: ModelConfig) -> GGUFFile | HFSource:
    """The pretrained model `name` (a model reference that is no run) as a source of weights
    for `load_sharded`, after checking `cfg` is its model (n_layers may keep only the first
    layers; the EXECUTION fields are free). ValueError (one line) otherwise."""
    kind = model_ref.pretrained_kind(name)
    if kind is None:
        model_ref.resolve(name, "init")  # says why it is no model
        raise ValueError(f"init={name!r}: a training run's folder is not pretrained weights")
    try:
        file_cfg = ref_model_config(name, kind, cfg.n_layers)
    except ValueError as e:
        raise ValueError(f"init={name!r}: {str(e).splitlines()[0]}") from None
    diff = [f for f in file_cfg.__dataclass_fields__ if f not in EXECUTION
            and getattr(file_cfg, f) != getattr(cfg, f)]
    if diff:
        how = (f"use --preset {name}" if kind == "name" else
               "train --init takes the model's own config")
        raise ValueError(f"init={name!r}: the model config differs from the pretrained model in "
                         f"{', '.join(diff)} ({how}; --n-layers may truncate)")
    if kind == "hf":
        return HFSource(Path(name))
    return GGUFFile(registered.gguf_path(name) if kind == "name" else name)


def _params_of(source: GGUFFile | HFSource, cfg: ModelConfig):
    if isinstance(source, HFSource):
        return hf_decoder.iter_params(source.folder, cfg)
    return iter_params(source, cfg)


def load_sharded(source: GGUFFile | HFSource, cfg: ModelConfig,
                 param_shardings: dict) -> tuple[dict, dict]:
    """(float32 params placed in `param_shardings`, loading report with the host peak)."""
    before = rss_peak_bytes()
    largest = 0
    params: dict = {}
    for path, array in _params_of(source, cfg):
        sharding = param_shardings
        for key in path.split("/"):
            sharding = sharding[key]
        largest = max(largest, array.nbytes)
        host = np.asarray(array, np.float32)
        set_path(params, path, jax.make_array_from_callback(host.shape, sharding,
                                                            lambda idx, h=host: h[idx]))
        del array, host
        gc.collect()
    jax.block_until_ready(params)
    return params, {"rss_peak_before_gb": before / 1e9, "rss_peak_after_gb": rss_peak_bytes() / 1e9,
                    "largest_tensor_gb": largest / 1e9}


def truncated_model(name: str = "smollm2", n_layers: int = 2, max_len: int = 32,
                    val_percent: int = 20) -> tuple[ModelConfig, dict, np.ndarray]:
    """(config, float32 host params, packed training rows [n, max_len + 1]) of the pretrained
    model's first `n_layers` blocks on the pydoc training topics: small enough to compare
    every strategy against one device, and still the real architecture and weights."""
    if name not in PRETRAINED:
        raise ValueError(f"model={name!r}: allowed {', '.join(PRETRAINED)}")
    g = GGUFFile(package_gguf_path())
    cfg = dataclasses.replace(config_from_gguf(g, n_layers=n_layers), max_len=max_len)
    train, _ = load_tokens(None, val_percent, "pydoc-topics", tokenizer_from_gguf(g).encode)
    return cfg, load_params(g, cfg), pack(train, max_len)
