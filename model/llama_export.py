"""`DecoderLM` parameters -> the tensors of a Hugging Face folder or of a llama.cpp GGUF: the
plan of the file (names, shapes, types) and each tensor in the file's layout. The writers are
model/hf_export.py (safetensors and config.json) and model/gguf_export.py.

The inverse of the readers, written one tensor at a time: a caller hands over one parameter
leaf (the embedding, or a per-layer kind stacked on the `layers` axis) through `read`, each of
its layers is written and the leaf is dropped before the next is read, so the whole model is
never held at once.

Names: the readers' own tables inverted (model/hf_decoder.py's for Hugging Face, Gemma's norms
and Phi-3's fused q/k/v and gate/up included; model/llama_gguf.py's for GGUF), so the two
directions cannot drift apart. Dense kernels [in, out] become [out, in] in both formats.

Rotary rows: our q/k kernels are in the rotate-half order, which is Hugging Face's, so they are
written as they are; llama.cpp's Llama converter interleaves the two halves of every head, so a
llama GGUF gets that permutation (`gguf_permute`, the inverse of `llama_gguf._unpermute`); its
Qwen2, Qwen3 and Gemma 3 converters keep the rotate-half order. Gemma's norms multiply by
(1 + w): Hugging Face stores w, llama.cpp stores 1 + w, so a gemma3 GGUF gets every norm plus
one (the reader subtracts it; float32's 1 + w keeps fewer of w's low bits when |w| < 1, so a
random w comes back within an ulp of 1 + w, while a w read from a GGUF comes back exactly).

An int8 model goes to GGUF as Q8_0 (model/gguf_q8.py): `read` then gives a quantised leaf as
`Int8Rows` (int8 [..., out, in] and one scale per row, the layout `quant/` stores), and `plan`
is told which leaves those are, since the header (each tensor's type and size) is written before
any data; the rotary permutation moves whole rows, scales with them, so a block stays in its row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from model import hf_decoder, llama_gguf
from model.config import EXECUTION_FIELDS, ModelConfig
from model.gguf_q8 import Int8Rows, Q8Error, pack, row_bytes
from model.hf_decoder import expected_shapes

FORMATS = ("safetensors", "gguf")
GGUF_FILE = "model.gguf"
SAFETENSORS_FILE = "model.safetensors"
# Hugging Face model_type -> its GGUF architecture (llama.cpp's name, and one our reader reads).
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


class ExportError(ValueError):
    """A model a format has no place for (launchers print it on one line, exit 2)."""


def family(cfg: ModelConfig) -> str:
    """The Hugging Face model_type whose fields the model uses (the writers check that the
    config they write reads back as `cfg`). ExportError for a model no family has."""
    if cfg.mlp == "gelu":
        raise ExportError("mlp='gelu': no exported family has an ungated GELU MLP (allowed: "
                          "swiglu for llama, mistral, qwen2, qwen3, phi3; geglu for "
                          "gemma3_text)")
    if cfg.rotary_dim is not None or cfg.rope_short_factors is not None:
        return "phi3"  # RoPE on part of each head, LongRoPE: Phi-3's fields alone
    if cfg.mlp == "geglu" or cfg.norm_plus_one or cfg.post_norms:
        return "gemma3_text"
    if cfg.qkv_bias:
        return "qwen2"
    if cfg.qk_norm:
        return "qwen3"
    return "mistral" if cfg.sliding_window is not None else "llama"


def described(cfg: ModelConfig) -> ModelConfig:
    """What an exported config describes: the model, not its context length or how it
    computes, with each default spelled out (a head size or query scale equal to the head
    dimension, one key/value head per query head). A written config must read back to the
    same."""
    return dataclasses.replace(
        cfg, max_len=1, param_dtype="float32", compute_dtype="float32", head_size=cfg.head_dim,
        n_kv_heads=cfg.kv_heads,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or float(cfg.head_dim),
        **{f: getattr(ModelConfig(), f) for f in EXECUTION_FIELDS})


def mismatch(cfg: ModelConfig, back: ModelConfig, where: str) -> None:
    """ExportError naming the first field in which `back` (the written config read back)
    describes another model than `cfg`."""
    want, got = dataclasses.asdict(described(cfg)), dataclasses.asdict(described(back))
    for k in want:
        if want[k] != got[k]:
            raise ExportError(f"{k}={want[k]!r}: {where} has no place for it (it would read "
                              f"back as {got[k]!r})")


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """NNX path -> Hugging Face name ("{}" is the layer)."""
    layer = hf_decoder._GEMMA_MAP if cfg.post_norms else hf_decoder._LAYER_MAP
    return ({path: name for name, path in hf_decoder._TOP_MAP.items()}
            | {path: f"model.layers.{{}}.{name}" for name, path in layer.items()})


def fused_names(cfg: ModelConfig, fmt: str) -> dict[tuple[str, ...], str]:
    """NNX paths whose rows one file tensor holds, one after another -> its name ("{}" is the
    layer): Phi-3's q/k/v and gate/up, in a phi3 folder."""
    if fmt != "safetensors" or family(cfg) != "phi3":
        return {}
    return {paths: f"model.layers.{{}}.{name}" for name, paths in hf_decoder._FUSED.items()}


def gguf_names(cfg: ModelConfig) -> dict[str, str]:
    """NNX path -> GGUF name ("{}" is the layer)."""
    layer = llama_gguf.layer_map(GGUF_ARCH.get(family(cfg), "llama"))
    return ({path: name for name, (path, _) in llama_gguf._TOP_MAP.items()}
            | {path: f"blk.{{}}.{name}" for name, (path, _) in layer.items()})


@dataclasses.dataclass(frozen=True)
class Planned:
    """One tensor of the exported file."""
    path: str  # NNX path of the parameter leaf it comes from
    layer: int | None  # index on the stacked `layers` axis (None: not a block parameter)
    name: str  # name in the file
    shape: tuple[int, ...]  # numpy shape in the file ([out, in] for a Linear weight)
    qtype: str = "F32"  # or "Q8_0" (GGUF only)
    # a fused tensor: the paths whose rows it holds, one after another (`path` is the first)
    parts: tuple[str, ...] = ()

    @property
    def leaves(self) -> tuple[str, ...]:
        """The parameter leaves the tensor is made from."""
        return self.parts or (self.path,)

    @property
    def nbytes(self) -> int:
        if self.qtype == "Q8_0":
            return int(np.prod(self.shape[:-1], dtype=np.int64)) * row_bytes(self.shape[-1])
        return 4 * int(np.prod(self.shape, dtype=np.int64))


def plan(cfg: ModelConfig, fmt: str, q8: frozenset[str] | set[str] = frozenset()
         ) -> list[Planned]:
    """Every tensor of the file, grouped by parameter leaf (the order they are written in);
    the leaves named in `q8` are Q8_0 tensors (GGUF only)."""
    names = hf_names(cfg) if fmt == "safetensors" else gguf_names(cfg)
    if q8 and fmt != "gguf":
        raise ExportError(f"format={fmt!r}: int8 weights are written only to GGUF (Q8_0)")
    shapes = expected_shapes(cfg)
    fused = {path: (parts, name) for parts, name in fused_names(cfg, fmt).items()
             for path in parts}
    out = []
    for path, shape in shapes.items():
        parts, name = fused.get(path, ((), names.get(path)))
        if parts and path != parts[0]:
            continue  # in the first part's tensor
        if name is None:
            raise ExportError(f"{path}: format={fmt!r} has no tensor for it")
        if parts:
            shape = (sum(shapes[p][0] for p in parts), *shape[1:])
        layers = range(cfg.n_layers) if path.startswith("blocks/") else [None]
        qtype = "Q8_0" if path in q8 else "F32"
        out += [Planned(path, i, name.format(i), shape, qtype, parts) for i in layers]
    return out


def gguf_permute(w_OxI: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's per-head row order: the rotate-half halves interleaved into pairs."""
    out, cols = w_OxI.shape
    return (w_OxI.reshape(n_heads, 2, out // n_heads // 2, cols).swapaxes(1, 2)
            .reshape(out, cols))


def _permuted_heads(cfg: ModelConfig, path: str, fmt: str) -> int | None:
    """The head count whose rows llama.cpp interleaves for this tensor (None: none)."""
    if fmt != "gguf" or GGUF_ARCH.get(family(cfg)) not in llama_gguf.PERMUTED_ARCHITECTURES:
        return None
    return {"blocks/attn/q/kernel": cfg.n_heads, "blocks/attn/k/kernel": cfg.kv_heads}.get(path)


def _q8_tensor(cfg: ModelConfig, t: Planned, leaf: Int8Rows, fmt: str) -> np.ndarray:
    """Q8_0 bytes [out, in / 32 * 34] of `t` from its int8 rows (already [out, in])."""
    rows = leaf if t.layer is None else leaf.layer(t.layer)
    if t.qtype != "Q8_0" or rows.shape != t.shape:
        raise ExportError(f"{t.path}: int8 rows {list(rows.shape)} where the plan has "
                          f"{t.qtype} {list(t.shape)} for {t.name}")
    heads = _permuted_heads(cfg, t.path, fmt)
    if heads is not None:
        rows = Int8Rows(gguf_permute(rows.q, heads), gguf_permute(rows.block_scales, heads))
    try:
        return pack(rows, t.name)
    except Q8Error as e:
        raise ExportError(str(e)) from None


def file_tensor(cfg: ModelConfig, t: Planned, leaf, fmt: str) -> np.ndarray:
    """The tensor `t` as the file stores it (float32, or Q8_0's bytes), from its (stacked)
    parameter leaf; of a fused tensor, from {path: leaf} of its parts."""
    if t.parts:
        shapes = expected_shapes(cfg)
        return np.concatenate([file_tensor(cfg, Planned(p, t.layer, t.name, shapes[p], t.qtype),
                                           leaf[p], fmt) for p in t.parts])
    if isinstance(leaf, Int8Rows):
        return _q8_tensor(cfg, t, leaf, fmt)
    if t.qtype != "F32":
        raise ExportError(f"{t.path}: float values where the plan has {t.qtype} for {t.name}")
    a = np.asarray(leaf if t.layer is None else leaf[t.layer], np.float32)
    if t.path.endswith("/kernel"):
        a = a.T
        heads = _permuted_heads(cfg, t.path, fmt)
        if heads is not None:
            a = gguf_permute(a, heads)
    elif fmt == "gguf" and cfg.norm_plus_one and t.path.endswith("norm/scale"):
        a = a + np.float32(1.0)  # llama.cpp's Gemma norms hold 1 + w
    a = np.ascontiguousarray(a, "<f4")
    if a.shape != t.shape:
        raise ExportError(f"{t.path}: leaf gives shape {list(a.shape)} for {t.name}, the "
                          f"config implies {list(t.shape)}")
    return a


def tensors(cfg: ModelConfig, read: Callable[[str], np.ndarray],
            fmt: str, todo: list[Planned] | None = None) -> Iterator[tuple[Planned, np.ndarray]]:
    """(planned tensor, array) in plan order (`todo`, default `plan(cfg, fmt)`); `read(path)`
    is called once per parameter leaf, and the leaf is released before the next one is read
    (a fused tensor's parts are read together)."""
    todo = plan(cfg, fmt) if todo is None else todo
    i = 0
    while i < len(todo):
        leaves = todo[i].leaves
        leaf = {p: read(p) for p in leaves} if todo[i].parts else read(todo[i].path)
        while i < len(todo) and todo[i].leaves == leaves:
            yield todo[i], file_tensor(cfg, todo[i], leaf, fmt)
            i += 1
        del leaf
