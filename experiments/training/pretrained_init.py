"""Pretrained weights straight into a sharded training run (ZeRO-3 fine-tuning from a GGUF).

The model is built abstractly and its shardings computed first (parallel/sharded_run.py); then
the GGUF is read one parameter at a time (`model.llama_gguf.iter_params`: one whole tensor,
dequantised, on the host) and each is placed into its shards with `jax.make_array_from_callback`
and dropped before the next is read, so loading never holds the whole float model on the host
beside the shards. Each process copies only the slices its own devices hold (the callback is
asked for addressable shards only); the GGUF's quantised blocks are dequantised a tensor at a
time, since a Q4_1 block row is not addressable by column.
"""

from __future__ import annotations

import dataclasses
import gc
import resource

import jax
import numpy as np

from experiments.training.data import load_tokens, pack
from model import ModelConfig
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


def rss_peak_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_model(name: str, cfg: ModelConfig, gguf_path: str | None = None) -> GGUFFile:
    """The open file, after checking `cfg` is the file's model (n_layers may keep only the
    first layers; max_len and dtypes are free). ValueError (one line) otherwise."""
    if name not in PRETRAINED:
        raise ValueError(f"init={name!r}: allowed {', '.join(PRETRAINED)}")
    g = GGUFFile(gguf_path or package_gguf_path())
    file_cfg = config_from_gguf(g, n_layers=cfg.n_layers, max_len=cfg.max_len)
    free = {"param_dtype", "compute_dtype", "remat", "scan_unroll", "max_len"}
    diff = [f for f in file_cfg.__dataclass_fields__ if f not in free
            and getattr(file_cfg, f) != getattr(cfg, f)]
    if diff:
        raise ValueError(f"init={name!r}: the model config differs from the pretrained model in "
                         f"{', '.join(diff)} (use --preset {name}; --n-layers may truncate)")
    return g


def load_sharded(g: GGUFFile, cfg: ModelConfig, param_shardings: dict) -> tuple[dict, dict]:
    """(float32 params placed in `param_shardings`, loading report with the host peak)."""
    before = rss_peak_bytes()
    largest = 0
    params: dict = {}
    for path, array in iter_params(g, cfg):
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
