"""Small synthetic Llama GGUF files written with the format's own package (`gguf.GGUFWriter`),
for loader and fuzz tests that must not depend on the 98 MB model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

D, LAYERS, HEADS, KV_HEADS, FF = 32, 2, 4, 2, 48
# A byte-level BPE vocabulary: the 256 byte symbols, a few merges, two control tokens.
_BYTES = ([chr(c) for c in range(ord("!"), ord("~") + 1)]
          + [chr(c) for c in range(ord("¡"), ord("¬") + 1)]
          + [chr(c) for c in range(ord("®"), ord("ÿ") + 1)])
_BYTES += [chr(256 + i) for i in range(256 - len(_BYTES))]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _BYTES + ["Ġt", "he", "Ġthe"]
VOCAB = len(TOKENS)


def tensors(rng: np.random.Generator, layers: int = LAYERS) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in numpy order ([out, in] for Linear weights)."""
    kv = KV_HEADS * (D // HEADS)
    out = {"token_embd.weight": rng.normal(size=(VOCAB, D)),
           "output_norm.weight": 1 + 0.1 * rng.normal(size=(D,))}
    for i in range(layers):
        shapes = {"attn_norm": (D,), "attn_q": (D, D), "attn_k": (kv, D), "attn_v": (kv, D),
                  "attn_output": (D, D), "ffn_norm": (D,), "ffn_gate": (FF, D),
                  "ffn_up": (FF, D), "ffn_down": (D, FF)}
        for stem, shape in shapes.items():
            scale = 0.2 if len(shape) == 2 else 0.1
            base = 1.0 if len(shape) == 1 else 0.0
            out[f"blk.{i}.{stem}.weight"] = base + scale * rng.normal(size=shape)
    return {k: v.astype(np.float32) for k, v in out.items()}


def write(path: Path, *, seed: int = 0, arch: str = "llama", drop: str | None = None,
          extra: str | None = None, reshape: str | None = None, block_count: int = LAYERS,
          metadata_overrides=None, bos: int | None = None) -> Path:
    """A tiny Llama GGUF; `drop` / `extra` / `reshape` name a tensor to leave out, add or
    give a wrong shape (the loader's error cases); `bos` a BOS id that encoding puts first."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"llama.block_count": block_count, "llama.context_length": 256,
            "llama.embedding_length": D, "llama.feed_forward_length": FF,
            "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0,
            "llama.vocab_size": VOCAB, **(metadata_overrides or {})}
    for key, value in meta.items():  # an override may change a value's type (fuzz cases)
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_merges(MERGES)
    w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    w.add_eos_token_id(2)
    if bos is not None:
        w.add_bos_token_id(bos)
    w.add_add_bos_token(bos is not None)
    for name, a in tensors(rng).items():
        if name == drop:
            continue
        if name == reshape:
            a = a[..., :-1].copy()
        w.add_tensor(name, a)
    if extra:
        w.add_tensor(extra, np.zeros((D,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
