"""An export's source made int8: the float model quantised by `quant/` as our own int8 commands
quantise it, then handed to the GGUF writer as Q8_0 (model/gguf_q8.py says how a Q8_0 block
holds our int8 weights).

Every Dense of the blocks and the embedding (the tied head; an untied head as well) are
quantised, the embedding in Q8_0's own blocks of 32 (llama.cpp's token_embd may be Q8_0). The
norms (and Qwen2's biases) stay float32. SmoothQuant's factors are already folded when
`quant/` returns the model: into the pre-norms' weights for q/k/v and gate/up (exact up to
rounding; a (1 + w) norm gets (1 + w) / s - 1), into v's output rows for o and into up's output
rows for down (exact: o's input is linear in v's output, down's in up's), so the file's float
norms and int8 kernels are the folded model and llama.cpp needs nothing more. What llama.cpp
does with the activations is its own: a Q8_0 matrix product quantises its input in blocks of
32, whatever our mode's activation scheme (w8's float inputs, w8a8's per-token scales), so w8
and w8a8 write the same file.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cli.config import ConfigError
from experiments.pretrained import loading
from experiments.pretrained.export_checks import Q8_MODES
from experiments.pretrained.exporter import Source
from model.gguf_q8 import QK8_0, Int8Rows, Q8Error, scale_rounding
from model.hf_decoder import expected_shapes
from model.llama_gguf import set_path
from quant.modes import DEFAULT_RULES, QuantConfig


def float_params(source: Source) -> dict:
    """The source's float32 parameters as one pure dict (an int8 model needs them all)."""
    out: dict = {}
    for path in expected_shapes(source.cfg):
        set_path(out, path, jnp.asarray(np.asarray(source.read(path), np.float32)))
    return out


def _lookup(tree: dict, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


def quantized_params(source: Source, mode: str, alpha: float | None = None
                     ) -> tuple[loading.Pretrained, list[str]]:
    """The source's model quantised under `mode` (blocks and embedding, and the head when it is
    untied), and the module paths made int8."""
    if mode not in Q8_MODES:
        raise ConfigError(f"quant={mode!r}: allowed {', '.join(Q8_MODES)}")
    if source.gguf is None and source.hf_folder is None:
        raise ConfigError(f"quant={mode!r}: a Q8_0 GGUF needs a pretrained model's tokenizer; "
                          f"this run is a byte model")
    cfg = source.cfg
    for what, cols in (("d_model", cfg.d_model), ("q_dim", cfg.q_dim), ("d_ff", cfg.d_ff)):
        if cols % QK8_0:  # checked before the long calibration
            raise ConfigError(f"quant={mode!r}: {what}={cols} is not a multiple of {QK8_0}; a "
                              f"Q8_0 row is made of blocks of {QK8_0} values")
    rules = DEFAULT_RULES + (() if cfg.tie_embeddings else ("head",))
    # The table's blocks are Q8_0's: each block's scale becomes its `d`.
    qcfg = QuantConfig(mode=mode, rules=rules, alpha=alpha, embed_block=QK8_0)
    pre = loading.Pretrained(source.label, cfg, loading.abstract_graphdef(cfg),
                             float_params(source), source.tokenizer())
    q = loading.quantize(pre, mode, qcfg)
    return q, sorted(_int8_paths(q.params))


def _int8_paths(params: dict, prefix: str = "") -> list[str]:
    """Module paths holding int8 weights (kernel_q or embedding_q)."""
    out = []
    for key, value in params.items():
        if isinstance(value, dict):
            if "kernel_q" in value or "embedding_q" in value:
                out.append(prefix + key)
            else:
                out += _int8_paths(value, f"{prefix}{key}/")
    return out


def rows_of(params: dict, module: str) -> Int8Rows:
    """A quantised module's int8 rows and scales, in the file's [out, in] orientation."""
    node = _lookup(params, module)
    if "embedding_q" in node:
        scale = node["block_scale"] if "block_scale" in node else node["row_scale"]
        return Int8Rows(np.asarray(node["embedding_q"]), np.asarray(scale, np.float32))
    scale = np.asarray(node["kernel_scale"], np.float32)
    q = np.asarray(node["kernel_q"])
    if scale.shape != q.shape[:-1]:
        raise ConfigError(f"quant: {module} has one scale per tensor; Q8_0 needs one per row "
                          f"(weights='channel')")
    return Int8Rows(q, scale)


def quantized_source(source: Source, mode: str, alpha: float | None = None) -> Source:
    """`source` with its weights int8 under `mode`: `read` gives `Int8Rows` for the quantised
    leaves and the (folded) float32 values for the rest; `q8` names the Q8_0 leaves."""
    q, modules = quantized_params(source, mode, alpha)
    leaf = {m: f"{m}/embedding" if m == "embed" else f"{m}/kernel" for m in modules}
    by_leaf = {v: k for k, v in leaf.items()}
    params = jax.device_get(q.params)
    rounding = 0.0
    for m in modules:
        try:
            rounding = max(rounding, scale_rounding(rows_of(params, m)))
        except Q8Error as e:
            raise ConfigError(str(e)) from None

    def read(path: str):
        if path in by_leaf:
            return rows_of(params, by_leaf[path])
        return np.asarray(_lookup(params, path), np.float32)

    return dataclasses.replace(
        source, read=read, q8=frozenset(by_leaf), quant=mode,
        quant_info={"mode": mode, "int8_modules": modules,
                    "scale_fp16_max_rel_change": rounding,
                    "alpha": alpha if alpha is not None or mode != "smoothquant" else "searched"})
