"""`DecoderLM` parameters -> a llama.cpp GGUF (architecture llama, qwen2, qwen3 or gemma3): the
metadata llama.cpp reads, the tensors of model/llama_export.py's plan (float32, or Q8_0 for an
int8 model), the tokenizer's keys copied from the GGUF the model came from.

What a GGUF cannot say is refused in one line rather than written as another model: a family
with no GGUF architecture that shardq reads back (mistral's sliding window), and, for Gemma 3,
anything off the conventions its readers assume rather than read (which layers slide, the query
scale; see model/llama_gguf.py). The file is read back once written and its config compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from model.config import ModelConfig
from model.gguf import GGUFFile
from model.llama_export import GGUF_ARCH, ExportError, family, mismatch, plan, tensors
from model.llama_gguf import (
    GEMMA3_GLOBAL_EVERY,
    ROPE_FREQS,
    config_from_gguf,
    gemma3_layer_pattern,
    gemma3_query_scalar,
    llama3_divisors,
)

_ARRAY_TYPES = {"int8": "INT8", "uint8": "UINT8", "int16": "INT16", "uint16": "UINT16",
                "int32": "INT32", "uint32": "UINT32", "int64": "INT64", "uint64": "UINT64",
                "float32": "FLOAT32", "float64": "FLOAT64", "bool": "BOOL"}
# Keys of the source file that describe it, not the model written now.
_SKIP = {"general.architecture", "general.file_type", "general.quantization_version",
         "general.alignment"}


def _copy_metadata(w, key: str, vtype, value) -> None:
    """One metadata entry of a `model.gguf.GGUFFile`, with its original value type."""
    if isinstance(vtype, tuple):  # (ARRAY, element kind)
        if isinstance(value, list):
            sub, items = GGUFValueType.STRING, value
        else:
            sub, items = GGUFValueType[_ARRAY_TYPES[value.dtype.name]], value.tolist()
        if items:  # GGUF cannot hold an empty array
            w.add_key_value(key, items, GGUFValueType.ARRAY, sub_type=sub)
    else:
        w.add_key_value(key, value, GGUFValueType(vtype))


def gguf_arch(cfg: ModelConfig) -> str:
    """The GGUF architecture the model is written as (ExportError when none fits)."""
    kind = family(cfg)
    if kind == "mistral":  # the llama layout with a window (Mistral's, Phi-3's)
        raise ExportError(f"sliding_window={cfg.sliding_window}: format='gguf' has no window "
                          f"for the llama layout (llama.cpp would attend over the whole "
                          f"context); use --format safetensors")
    if kind not in GGUF_ARCH:
        raise ExportError(f"model_type={kind!r}: format='gguf' is written for "
                          f"{', '.join(GGUF_ARCH)} (the architectures shardq's GGUF reader "
                          f"reads back); use --format safetensors")
    return GGUF_ARCH[kind]


def check_gguf(cfg: ModelConfig) -> str:
    """The GGUF architecture, and for gemma3 the conventions its readers assume checked
    without writing anything (ExportError naming the first field off them); `write_gguf` still
    compares the written file's config."""
    arch = gguf_arch(cfg)
    if arch == "gemma3":
        assumed = dataclasses.replace(
            cfg, layer_pattern=gemma3_layer_pattern(cfg.n_layers),
            query_pre_attn_scalar=gemma3_query_scalar(cfg.n_layers, cfg.d_model, cfg.n_heads,
                                                      cfg.head_dim))
        mismatch(cfg, assumed, "a gemma3 GGUF")
    return arch


def _architecture_keys(w: GGUFWriter, cfg: ModelConfig, arch: str, context_length: int) -> None:
    w.add_context_length(context_length)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern(GEMMA3_GLOBAL_EVERY)  # what llama.cpp assumes anyway
        w.add_rope_freq_base_swa(cfg.rope_local_base)
        if cfg.final_softcap:
            w.add_final_logit_softcapping(cfg.final_softcap)


def write_gguf(path: str | Path, cfg: ModelConfig, read: Callable[[str], np.ndarray], *,
               context_length: int, metadata: dict, q8: frozenset[str] = frozenset()) -> dict:
    """A GGUF of the model's architecture: F32, or with the leaves named in `q8` as Q8_0
    (`read` gives those as `Int8Rows`). `metadata` ({key: (type, value)} as
    `model.gguf.GGUFFile.metadata` holds it) supplies the tokenizer (`tokenizer.*`) and
    descriptive `general.*` keys; the architecture keys come from `cfg`."""
    arch = gguf_arch(cfg)
    planned = plan(cfg, "gguf", q8)
    w = GGUFWriter(str(path), arch)
    for key, (vtype, value) in metadata.items():
        if key.startswith(("general.", "tokenizer.")) and key not in _SKIP:
            _copy_metadata(w, key, vtype, value)
    w.add_file_type(LlamaFileType.MOSTLY_Q8_0 if q8 else LlamaFileType.ALL_F32)
    _architecture_keys(w, cfg, arch, context_length)
    for t in planned:  # the logical shape; a Q8_0 tensor's bytes are its rows' blocks
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes,
                          raw_dtype=GGMLQuantizationType[t.qtype])
    divisors = llama3_divisors(cfg) if cfg.rope_scale_factor else None
    if divisors is not None:  # Llama 3's RoPE scaling, as llama.cpp's converter writes it
        w.add_tensor_info(ROPE_FREQS, divisors.shape, divisors.dtype, divisors.nbytes)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, a in tensors(cfg, read, "gguf", planned):
            w.write_tensor_data(a)  # the writer takes them in the order their infos were added
        if divisors is not None:
            w.write_tensor_data(divisors)
    finally:
        w.close()
    mismatch(cfg, config_from_gguf(GGUFFile(path)), f"a {arch} GGUF")
    return {"tensors": len(planned) + (divisors is not None),
            "q8_0_tensors": sum(t.qtype == "Q8_0" for t in planned),
            "bytes": Path(path).stat().st_size}
