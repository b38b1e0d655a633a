"""`DecoderLM` parameters (Llama options) -> Hugging Face's Llama layout and llama.cpp's GGUF.

The inverse of `model/llama_gguf.py`, written one tensor at a time: a caller hands over one
parameter leaf (the embedding, or a per-layer kind stacked on the `layers` axis) through `read`,
each of its layers is written and the leaf is dropped before the next is read, so the whole
model is never held at once.

Names (NNX path -> Hugging Face / GGUF; N is the layer; Dense kernels [in, out] become
[out, in] in both formats):
  embed/embedding          -> model.embed_tokens.weight              / token_embd.weight
  blocks/attn/{q,k,v,o}    -> model.layers.N.self_attn.{q,k,v,o}_proj / blk.N.attn_{q,k,v,output}
  blocks/mlp/{gate,up,down} -> model.layers.N.mlp.{gate,up,down}_proj / blk.N.ffn_{gate,up,down}
  blocks/attn_norm, mlp_norm -> model.layers.N.{input,post_attention}_layernorm
                              / blk.N.{attn,ffn}_norm
  final_norm/scale         -> model.norm.weight                      / output_norm.weight
  head/kernel (untied)     -> lm_head.weight                         / output.weight

Rotary rows: our q/k kernels are in the rotate-half order, which is Hugging Face's, so they are
written as they are; llama.cpp's converter interleaves the two halves of every head, so the GGUF
gets that permutation (`gguf_permute`, the inverse of `llama_gguf._unpermute`).

An int8 model goes to GGUF as Q8_0 (model/gguf_q8.py): `read` then gives a quantised leaf as
`Int8Rows` (int8 [..., out, in] and one scale per row, the layout `quant/` stores), and `plan`
is told which leaves those are, since the header (each tensor's type and size) is written before
any data; the rotary permutation moves whole rows, scales with them, so a block stays in its row.

The safetensors file is written by hand (an 8-byte header length, a JSON header of names,
dtypes, shapes and byte offsets, then the raw little-endian data) because the format is that
simple and the `safetensors` package only writes a whole in-memory dict.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from model.config import ModelConfig
from model.gguf_q8 import Int8Rows, Q8Error, pack, row_bytes
from model.llama_gguf import _LAYER_MAP, _TOP_MAP, expected_shapes

# NNX path -> Hugging Face name ("{}" is the layer).
HF_NAMES = {
    "embed/embedding": "model.embed_tokens.weight",
    "blocks/attn_norm/scale": "model.layers.{}.input_layernorm.weight",
    "blocks/attn/q/kernel": "model.layers.{}.self_attn.q_proj.weight",
    "blocks/attn/k/kernel": "model.layers.{}.self_attn.k_proj.weight",
    "blocks/attn/v/kernel": "model.layers.{}.self_attn.v_proj.weight",
    "blocks/attn/o/kernel": "model.layers.{}.self_attn.o_proj.weight",
    "blocks/mlp_norm/scale": "model.layers.{}.post_attention_layernorm.weight",
    "blocks/mlp/gate/kernel": "model.layers.{}.mlp.gate_proj.weight",
    "blocks/mlp/up/kernel": "model.layers.{}.mlp.up_proj.weight",
    "blocks/mlp/down/kernel": "model.layers.{}.mlp.down_proj.weight",
    "final_norm/scale": "model.norm.weight",
    "head/kernel": "lm_head.weight",
}
# NNX path -> GGUF name, from the loader's own table so the two directions cannot drift apart.
GGUF_NAMES = {path: name for name, (path, _) in _TOP_MAP.items()} | {
    path: f"blk.{{}}.{stem}.weight" for stem, (path, _) in _LAYER_MAP.items()}
FORMATS = ("safetensors", "gguf")
GGUF_FILE = "model.gguf"
SAFETENSORS_FILE = "model.safetensors"


class ExportError(ValueError):
    """A model that has no Llama layout (launchers print it on one line, exit 2)."""


def check_llama(cfg: ModelConfig) -> None:
    """Only the Llama options have a place in the Llama layout: a GELU MLP has none."""
    if cfg.mlp != "swiglu":
        raise ExportError(f"mlp={cfg.mlp!r}: the Llama layout needs mlp='swiglu' (a GELU MLP "
                          f"has no LlamaForCausalLM or llama.cpp counterpart)")
    # The other families' fields have tensors or metadata the Llama layout has no place for.
    for field in ("qkv_bias", "qk_norm", "sliding_window", "head_size"):
        if getattr(cfg, field):
            raise ExportError(f"{field}={getattr(cfg, field)!r}: the Llama layout has no "
                              f"place for it (only Llama-architecture models are exported)")


@dataclasses.dataclass(frozen=True)
class Planned:
    """One tensor of the exported file."""
    path: str  # NNX path of the parameter leaf it comes from
    layer: int | None  # index on the stacked `layers` axis (None: not a block parameter)
    name: str  # name in the file
    shape: tuple[int, ...]  # numpy shape in the file ([out, in] for a Linear weight)
    qtype: str = "F32"  # or "Q8_0" (GGUF only)

    @property
    def nbytes(self) -> int:
        if self.qtype == "Q8_0":
            return int(np.prod(self.shape[:-1], dtype=np.int64)) * row_bytes(self.shape[-1])
        return 4 * int(np.prod(self.shape, dtype=np.int64))


def plan(cfg: ModelConfig, fmt: str, q8: frozenset[str] | set[str] = frozenset()
         ) -> list[Planned]:
    """Every tensor of the file, grouped by parameter leaf (the order they are written in);
    the leaves named in `q8` are Q8_0 tensors (GGUF only)."""
    names = HF_NAMES if fmt == "safetensors" else GGUF_NAMES
    if q8 and fmt != "gguf":
        raise ExportError(f"format={fmt!r}: int8 weights are written only to GGUF (Q8_0)")
    out = []
    for path, shape in expected_shapes(cfg).items():
        layers = range(cfg.n_layers) if path.startswith("blocks/") else [None]
        qtype = "Q8_0" if path in q8 else "F32"
        out += [Planned(path, i, names[path].format(i), shape, qtype) for i in layers]
    return out


def gguf_permute(w_OxI: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's per-head row order: the rotate-half halves interleaved into pairs."""
    out, cols = w_OxI.shape
    return (w_OxI.reshape(n_heads, 2, out // n_heads // 2, cols).swapaxes(1, 2)
            .reshape(out, cols))


def _q8_tensor(cfg: ModelConfig, t: Planned, leaf: Int8Rows, fmt: str) -> np.ndarray:
    """Q8_0 bytes [out, in / 32 * 34] of `t` from its int8 rows (already [out, in])."""
    rows = leaf if t.layer is None else leaf.layer(t.layer)
    if t.qtype != "Q8_0" or rows.shape != t.shape:
        raise ExportError(f"{t.path}: int8 rows {list(rows.shape)} where the plan has "
                          f"{t.qtype} {list(t.shape)} for {t.name}")
    heads = {"blocks/attn/q/kernel": cfg.n_heads, "blocks/attn/k/kernel": cfg.kv_heads}
    if t.path in heads and not cfg.norm_plus_one:  # llama.cpp's row order (Llama family only)
        q, s = gguf_permute(rows.q, heads[t.path]), gguf_permute(rows.scale[:, None],
                                                                 heads[t.path])[:, 0]
        rows = Int8Rows(q, s)
    try:
        return pack(rows, t.name)
    except Q8Error as e:
        raise ExportError(str(e)) from None


def file_tensor(cfg: ModelConfig, t: Planned, leaf, fmt: str) -> np.ndarray:
    """The tensor `t` as the file stores it (float32, or Q8_0's bytes), from its (stacked)
    parameter leaf."""
    if isinstance(leaf, Int8Rows):
        return _q8_tensor(cfg, t, leaf, fmt)
    if t.qtype != "F32":
        raise ExportError(f"{t.path}: float values where the plan has {t.qtype} for {t.name}")
    a = np.asarray(leaf if t.layer is None else leaf[t.layer], np.float32)
    if t.path.endswith("/kernel"):
        a = a.T
        if fmt == "gguf" and t.path == "blocks/attn/q/kernel":
            a = gguf_permute(a, cfg.n_heads)
        elif fmt == "gguf" and t.path == "blocks/attn/k/kernel":
            a = gguf_permute(a, cfg.kv_heads)
    a = np.ascontiguousarray(a, "<f4")
    if a.shape != t.shape:
        raise ExportError(f"{t.path}: leaf gives shape {list(a.shape)} for {t.name}, the "
                          f"config implies {list(t.shape)}")
    return a


def tensors(cfg: ModelConfig, read: Callable[[str], np.ndarray],
            fmt: str, todo: list[Planned] | None = None) -> Iterator[tuple[Planned, np.ndarray]]:
    """(planned tensor, array) in plan order (`todo`, default `plan(cfg, fmt)`); `read(path)`
    is called once per parameter leaf, and the leaf is released before the next one is read."""
    todo = plan(cfg, fmt) if todo is None else todo
    i = 0
    while i < len(todo):
        path = todo[i].path
        leaf = read(path)
        while i < len(todo) and todo[i].path == path:
            yield todo[i], file_tensor(cfg, todo[i], leaf, fmt)
            i += 1
        del leaf


# --- safetensors ---------------------------------------------------------------------------


class SafetensorsWriter:
    """Streams float32 tensors into one .safetensors file: the header (names, shapes, offsets)
    is written first from the plan, then each tensor's bytes in that order."""

    def __init__(self, path: str | Path, planned: list[Planned], metadata: dict | None = None):
        header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for t in planned:
            n = 4 * int(np.prod(t.shape, dtype=np.int64))
            header[t.name] = {"dtype": "F32", "shape": list(t.shape),
                              "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._pending = list(planned)
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, t: Planned, array: np.ndarray) -> None:
        if not self._pending or self._pending[0] != t:
            raise ValueError(f"{t.name}: written out of the announced order")
        self._pending.pop(0)
        np.ascontiguousarray(array, "<f4").tofile(self._file)

    def abort(self) -> None:
        self._file.close()

    def close(self) -> None:
        self._file.close()
        if self._pending:
            raise ValueError(f"{len(self._pending)} announced tensors were never written, "
                             f"first {self._pending[0].name}")


def write_safetensors(path: str | Path, cfg: ModelConfig,
                      read: Callable[[str], np.ndarray]) -> dict:
    planned = plan(cfg, "safetensors")
    w = SafetensorsWriter(path, planned)
    try:
        for t, a in tensors(cfg, read, "safetensors"):
            w.write(t, a)
    except BaseException:
        w.abort()  # the caller discards the file; its error is the one to report
        raise
    w.close()
    return {"tensors": len(planned), "bytes": Path(path).stat().st_size}


# --- Hugging Face config files ---------------------------------------------------------------


def hf_config(cfg: ModelConfig, *, max_positions: int, bos_id: int | None,
              eos_id: int | None) -> dict:
    """config.json of `LlamaForCausalLM`. rope_theta is given both the classic way and as
    transformers 5's rope_parameters."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "rope_scaling": None, "max_position_embeddings": max_positions,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1,
        "use_cache": True, "torch_dtype": "float32", "bos_token_id": bos_id,
        "eos_token_id": eos_id, "pad_token_id": None,
    }


def generation_config(bos_id: int | None, eos_id: int | None) -> dict:
    return {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}


def tokenizer_config(tok, *, bos_id: int | None, eos_id: int | None, pad_id: int | None,
                     unk_id: int | None, max_len: int, add_bos: bool,
                     chat_template: str | None) -> dict:
    """tokenizer_config.json for a `tokenizers` object: the generic fast tokenizer class (a
    model-specific class would rebuild the pre-tokenizer from its own defaults), no BOS unless
    the model adds one, and the special tokens by their strings."""
    token = lambda i: None if i is None else tok.id_to_token(i)
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
           "add_bos_token": add_bos, "add_eos_token": False, "clean_up_tokenization_spaces": False,
           "bos_token": token(bos_id), "eos_token": token(eos_id), "pad_token": token(pad_id),
           "unk_token": token(unk_id)}
    if chat_template:
        out["chat_template"] = chat_template
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    """A `tokenizers` tokenizer whose ids are the UTF-8 bytes of the text (the byte model's
    vocabulary): byte-level BPE over GPT-2's byte alphabet with no merges, id = byte value."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


# --- GGUF ------------------------------------------------------------------------------------

_ARRAY_TYPES = {"int8": "INT8", "uint8": "UINT8", "int16": "INT16", "uint16": "UINT16",
                "int32": "INT32", "uint32": "UINT32", "int64": "INT64", "uint64": "UINT64",
                "float32": "FLOAT32", "float64": "FLOAT64", "bool": "BOOL"}


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


def write_gguf(path: str | Path, cfg: ModelConfig, read: Callable[[str], np.ndarray], *,
               context_length: int, metadata: dict, q8: frozenset[str] = frozenset()) -> dict:
    """A GGUF of the llama architecture: F32, or with the leaves named in `q8` as Q8_0
    (`read` gives those as `Int8Rows`). `metadata` ({key: (type, value)} as
    `model.gguf.GGUFFile.metadata` holds it) supplies the tokenizer (`tokenizer.*`) and
    descriptive `general.*` keys; the architecture keys come from `cfg`."""
    w = GGUFWriter(str(path), "llama")
    skip = {"general.architecture", "general.file_type", "general.quantization_version",
            "general.alignment"}
    for key, (vtype, value) in metadata.items():
        if key.startswith(("general.", "tokenizer.")) and key not in skip:
            _copy_metadata(w, key, vtype, value)
    w.add_file_type(LlamaFileType.MOSTLY_Q8_0 if q8 else LlamaFileType.ALL_F32)
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
    planned = plan(cfg, "gguf", q8)
    for t in planned:  # the logical shape; a Q8_0 tensor's bytes are its rows' blocks
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes,
                          raw_dtype=GGMLQuantizationType[t.qtype])
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, a in tensors(cfg, read, "gguf", planned):
            w.write_tensor_data(a)  # the writer takes them in the order their infos were added
    finally:
        w.close()
    return {"tensors": len(planned), "q8_0_tensors": sum(t.qtype == "Q8_0" for t in planned),
            "bytes": Path(path).stat().st_size}
