"""`DecoderLM` parameters -> a Hugging Face folder: model.safetensors (float32, the tensors of
model/llama_export.py's plan), config.json of the model's family (llama, mistral, qwen2, qwen3,
gemma3_text, or phi3 for RoPE on part of each head and LongRoPE), generation_config.json, and
the tokenizer files.

config.json is checked before anything is written: model/hf_decoder.py must read it back as the
exported config (the context length aside), so a model whose fields no family holds together
(a Gemma norm without Gemma's other fields, a Qwen2 bias beside a sliding window) is refused in
one line instead of written as another model.

The safetensors file is written by hand (an 8-byte header length, a JSON header of names,
dtypes, shapes and byte offsets, then the raw little-endian data) because the format is that
simple and the `safetensors` package only writes a whole in-memory dict.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from model.config import ModelConfig
from model.hf_decoder import LLAMA3_KEYS, HFError, config_from_hf, longrope_fields
from model.llama_export import ExportError, Planned, family, mismatch, plan, tensors

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


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


# --- config.json -------------------------------------------------------------------------------


def _rope(base: float) -> dict:
    return {"rope_type": "default", "rope_theta": base}


def _whole(x: float) -> int | float:
    """An integral value as an int (transformers' Gemma 3 config takes its query scalar as one)."""
    return int(x) if float(x).is_integer() else x


def _family_fields(cfg: ModelConfig, kind: str, max_positions: int) -> dict:
    """The config.json keys that differ between the families."""
    full = ["full_attention"] * cfg.n_layers
    if kind == "gemma3_text":
        pattern = cfg.layer_pattern or "g" * cfg.n_layers
        return {"hidden_activation": "gelu_pytorch_tanh",
                "layer_types": ["sliding_attention" if c == "s" else "full_attention"
                                for c in pattern],
                "sliding_window": cfg.sliding_window,
                "rope_parameters": {"full_attention": _rope(cfg.rope_base),
                                    "sliding_attention": _rope(cfg.rope_local_base)},
                "query_pre_attn_scalar": _whole(cfg.query_pre_attn_scalar or cfg.head_dim),
                "final_logit_softcapping": cfg.final_softcap or None,
                "attn_logit_softcapping": None, "attention_bias": False,
                "use_bidirectional_attention": False}
    if kind == "phi3":
        return _phi3_fields(cfg, max_positions)
    rope = _rope(cfg.rope_base)
    if cfg.rope_scale_factor:  # Llama 3's scaling
        rope = {**rope, "rope_type": "llama3",
                **{key: getattr(cfg, field) for key, field in LLAMA3_KEYS.items()}}
    out = {"hidden_act": "silu", "rope_theta": cfg.rope_base, "rope_parameters": rope}
    if kind == "llama":
        return {**out, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
                "pretraining_tp": 1}
    if kind == "mistral":
        return {**out, "sliding_window": cfg.sliding_window}
    # qwen2 (q/k/v biases: transformers' Qwen2 always has them) and qwen3 (q/k norm, no bias)
    return {**out, "use_sliding_window": False, "sliding_window": None, "layer_types": full,
            "max_window_layers": cfg.n_layers,
            **({"attention_bias": False} if kind == "qwen3" else {})}


def _phi3_fields(cfg: ModelConfig, max_positions: int) -> dict:
    """Phi-3's RoPE: on int(head size x partial_rotary_factor) dimensions of each head, and
    LongRoPE's factors and pretraining context as transformers saves them, with the attention
    factor spelled out where the one transformers derives from max_positions differs."""
    rope = _rope(cfg.rope_base)
    if cfg.rotary_dim is not None:
        rope["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    out = {"hidden_act": "silu", "sliding_window": cfg.sliding_window, "resid_pdrop": 0.0,
           "embd_pdrop": 0.0, "attention_bias": False}
    if cfg.rope_short_factors is not None:
        if cfg.head_dim * cfg.n_heads != cfg.d_model:
            # transformers counts LongRoPE's factors from hidden_size / num_attention_heads
            raise ExportError(f"head_size={cfg.head_size}: phi3's config.json takes LongRoPE "
                              f"only with the head size d_model / n_heads "
                              f"({cfg.d_model // cfg.n_heads})")
        original = cfg.rope_original_max_len
        rope.update(rope_type="longrope", short_factor=list(cfg.rope_short_factors),
                    long_factor=list(cfg.rope_long_factors),
                    original_max_position_embeddings=original)
        plain = {**out, "rope_parameters": rope, "original_max_position_embeddings": original,
                 "max_position_embeddings": max_positions}
        if longrope_fields(plain, "")["rope_attention_factor"] != cfg.rope_attention_factor:
            rope["attention_factor"] = cfg.rope_attention_factor
        out["original_max_position_embeddings"] = original
    return {**out, "rope_parameters": rope}


def hf_config(cfg: ModelConfig, *, max_positions: int, bos_id: int | None,
              eos_id: int | None) -> dict:
    """config.json of the model's family; ExportError (one line) when model/hf_decoder.py
    would read it back as another model."""
    kind = family(cfg)
    out = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": max_positions, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": "float32", "bos_token_id": bos_id, "eos_token_id": eos_id,
        "pad_token_id": None, **_family_fields(cfg, kind, max_positions)}
    try:
        back = config_from_hf(out)
    except HFError as e:
        raise ExportError(f"model_type={kind!r}: {str(e).splitlines()[0]}") from None
    mismatch(cfg, back, f"{kind}'s config.json")
    return out


def generation_config(bos_id: int | None, eos_id: int | None) -> dict:
    return {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}


# --- tokenizer files -----------------------------------------------------------------------------


def with_bos_first(tok: Tokenizer, bos_id: int) -> Tokenizer:
    """A copy of `tok` whose post-processor puts the BOS before a text (and before each text of
    a pair, the second as type 1): transformers 5 adds what the post-processor says, whatever
    add_bos_token says. Written in tokenizer.json's own form, so any token text is taken as
    it is."""
    bos = tok.id_to_token(bos_id)

    def first(text: str, type_id: int) -> list[dict]:
        return [{"SpecialToken": {"id": bos, "type_id": type_id}},
                {"Sequence": {"id": text, "type_id": type_id}}]

    data = json.loads(tok.to_str())
    data["post_processor"] = {
        "type": "TemplateProcessing", "single": first("A", 0),
        "pair": first("A", 0) + first("B", 1),
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    return Tokenizer.from_str(json.dumps(data))


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
