"""Hugging Face decoder folders -> `ModelConfig` + float32 parameters of `DecoderLM`.

A folder holds `config.json`, the weights (`model.safetensors`, or shards listed by
`model.safetensors.index.json`) and `tokenizer.json` (model/hf_tokenizer.py reads that). The
families read here differ only in fields of the one decoder:
  llama    the base form (SmolLM2 is one), with Llama 3's RoPE scaling where its
           `rope_parameters` (or `rope_scaling`) say rope_type "llama3";
  mistral  `sliding_window` (None: full attention);
  qwen2    q/k/v biases (`qkv_bias`);
  qwen3    q/k RMSNorm per head (`qk_norm`) and an explicit `head_dim` (`head_size`);
  gemma3_text  q/k norm, (1 + w) norms with post-attention and post-MLP norms, GeGLU, a query
           scale, scaled embeddings, a final soft-cap, and `layer_types` (sliding and global
           layers, each kind with its RoPE base from `rope_parameters`);
  phi3     Mistral's fields (`sliding_window`), with q/k/v stored as one tensor and gate/up as
           another (split on reading, below), RoPE on part of each head where
           `partial_rotary_factor` says so (`rotary_dim`, Phi-4-mini), and LongRoPE where
           rope_type is "longrope" (`rope_short_factors`, Phi-3.5 and Phi-4-mini).

Name mapping (HF -> NNX pure-dict path; per-layer tensors stacked on the `layers` axis). HF
Linear weights are [out, in], Dense kernels [in, out]: every one is transposed. HF stores q and
k in the rotate-half layout `model.layers.rotary` uses, so (unlike a GGUF, see
model/llama_gguf.py's `_unpermute`) no rows are reordered.
  model.embed_tokens.weight                  -> embed/embedding
  lm_head.weight                             -> head/kernel (absent when tied)
  model.norm.weight                          -> final_norm/scale
  model.layers.N.input_layernorm.weight      -> blocks/attn_norm/scale
  model.layers.N.self_attn.{q,k,v,o}_proj.weight -> blocks/attn/{q,k,v,o}/kernel
  model.layers.N.self_attn.{q,k,v}_proj.bias -> blocks/attn/{q,k,v}/bias
  model.layers.N.self_attn.{q,k}_norm.weight -> blocks/attn/{q,k}_norm/scale
  model.layers.N.post_attention_layernorm.weight -> blocks/mlp_norm/scale
  model.layers.N.mlp.{gate,up,down}_proj.weight  -> blocks/mlp/{gate,up,down}/kernel
Phi-3 fuses the products that read one input, their rows one after another:
  model.layers.N.self_attn.qkv_proj.weight   -> blocks/attn/{q,k,v}/kernel (rows q, then k, v)
  model.layers.N.mlp.gate_up_proj.weight     -> blocks/mlp/{gate,up}/kernel (rows gate, then up)
Gemma 3 names its norms differently (`post_attention_layernorm` is its post-attention norm):
  model.layers.N.post_attention_layernorm.weight  -> blocks/post_attn_norm/scale
  model.layers.N.pre_feedforward_layernorm.weight -> blocks/mlp_norm/scale
  model.layers.N.post_feedforward_layernorm.weight -> blocks/post_mlp_norm/scale

Tensors are read one at a time (`safetensors.safe_open`), converted to float32 and written
into one preallocated array per parameter, so the host holds the float32 model plus about one
tensor while loading (of a fused tensor, one part's rows).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from model.config import ModelConfig
from model.llama_gguf import fused_rows, set_path, shortest_f32, stacked_leaf

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
DTYPES = {"F32": np.float32, "BF16": None, "F16": np.float16}  # what a tensor may be stored as
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_MAP = {  # HF name within a layer -> NNX path
    "input_layernorm.weight": "blocks/attn_norm/scale",
    "self_attn.q_proj.weight": "blocks/attn/q/kernel",
    "self_attn.k_proj.weight": "blocks/attn/k/kernel",
    "self_attn.v_proj.weight": "blocks/attn/v/kernel",
    "self_attn.o_proj.weight": "blocks/attn/o/kernel",
    "self_attn.q_proj.bias": "blocks/attn/q/bias",
    "self_attn.k_proj.bias": "blocks/attn/k/bias",
    "self_attn.v_proj.bias": "blocks/attn/v/bias",
    "self_attn.q_norm.weight": "blocks/attn/q_norm/scale",
    "self_attn.k_norm.weight": "blocks/attn/k_norm/scale",
    "post_attention_layernorm.weight": "blocks/mlp_norm/scale",
    "mlp.gate_proj.weight": "blocks/mlp/gate/kernel",
    "mlp.up_proj.weight": "blocks/mlp/up/kernel",
    "mlp.down_proj.weight": "blocks/mlp/down/kernel",
}
_GEMMA_MAP = {**_LAYER_MAP,
              "post_attention_layernorm.weight": "blocks/post_attn_norm/scale",
              "pre_feedforward_layernorm.weight": "blocks/mlp_norm/scale",
              "post_feedforward_layernorm.weight": "blocks/post_mlp_norm/scale"}
# A fused tensor within a layer -> the NNX paths of its parts, in the order of their rows.
_FUSED = {"self_attn.qkv_proj.weight": ("blocks/attn/q/kernel", "blocks/attn/k/kernel",
                                        "blocks/attn/v/kernel"),
          "mlp.gate_up_proj.weight": ("blocks/mlp/gate/kernel", "blocks/mlp/up/kernel")}
_TOP_MAP = {"model.embed_tokens.weight": "embed/embedding", "lm_head.weight": "head/kernel",
            "model.norm.weight": "final_norm/scale"}


class HFError(ValueError):
    """A folder that is not a readable Hugging Face decoder; the message is one line naming
    the folder and what is wrong."""


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFError(f"{str(folder)!r}: no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{str(path)!r}: not readable JSON ({str(e).splitlines()[0]})") from None


# Llama 3's RoPE scaling: rope_parameters key -> ModelConfig field (read here, written by
# model/hf_export.py)
LLAMA3_KEYS = {"factor": "rope_scale_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_len"}
# Phi-3's LongRoPE, by the names transformers reads it under
LONGROPE_TYPES = ("longrope", "su")


def _rope_params(hf: dict) -> dict:
    """The RoPE parameters: `rope_parameters` (transformers 5) or `rope_scaling` (before), which
    transformers takes first where a config has both."""
    return hf.get("rope_scaling") or hf.get("rope_parameters") or {}


def _rope_base(hf: dict, where: str, layer_type: str | None = None,
               kinds: tuple[str, ...] = ("default",)) -> float:
    rope = _rope_params(hf)
    if layer_type is not None:  # Gemma 3: one set of parameters per kind of layer
        rope = rope.get(layer_type) or {}
        if "rope_theta" not in rope:
            default = {"full_attention": ("rope_theta", 1_000_000.0),
                       "sliding_attention": ("rope_local_base_freq", 10_000.0)}[layer_type]
            rope = {**rope, "rope_theta": hf.get(*default)}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in kinds:
        raise HFError(f"{where}: rope_type={kind!r} is not supported (allowed: "
                      f"{', '.join(map(repr, kinds))})")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def _rope_scaling(hf: dict, where: str) -> dict:
    """The config fields of Llama 3's RoPE scaling (rope_type "llama3"); {} for none."""
    rope = _rope_params(hf)
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return {}
    try:
        return {field: (int if field == "rope_original_max_len" else float)(rope[key])
                for key, field in LLAMA3_KEYS.items()}
    except (KeyError, TypeError, ValueError):
        raise HFError(f"{where}: rope_type='llama3' needs numbers for "
                      f"{', '.join(LLAMA3_KEYS)}") from None


def longrope_fields(hf: dict, where: str) -> dict:
    """The config fields of Phi-3's LongRoPE (rope_type "longrope", once "su"), as transformers
    derives them: the pretraining context is the config's own `original_max_position_embeddings`
    (4096 where absent), the attention factor the given one or sqrt(1 + ln(s) / ln(original))
    for s = max_position_embeddings / original (`factor` where given) above 1; {} for none."""
    rope = _rope_params(hf)
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in LONGROPE_TYPES:
        return {}
    short, long = rope.get("short_factor"), rope.get("long_factor")
    numbers = lambda v: isinstance(v, list) and all(  # noqa: E731
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
    if not (numbers(short) and numbers(long)):
        raise HFError(f"{where}: rope_type={kind!r} needs short_factor and long_factor as "
                      f"lists of numbers")
    try:
        original = int(hf.get("original_max_position_embeddings", 4096))
        factor = rope.get("factor")
        if factor is None:
            factor = int(hf.get("max_position_embeddings", 4096)) / original
        factor = float(factor)
        attention = rope.get("attention_factor")
        if attention is None:
            attention = (1.0 if factor <= 1
                         else math.sqrt(1 + math.log(factor) / math.log(original)))
        attention = shortest_f32(attention)
    except (TypeError, ValueError, ZeroDivisionError):
        raise HFError(f"{where}: rope_type={kind!r} needs a positive "
                      f"original_max_position_embeddings, max_position_embeddings and "
                      f"factor") from None
    # as float32 decimals, which is what RoPE computes with and what a GGUF of the model holds
    return dict(rope_short_factors=tuple(map(shortest_f32, short)),
                rope_long_factors=tuple(map(shortest_f32, long)),
                rope_original_max_len=original, rope_attention_factor=attention)


def _refuse(where: str, hf: dict, key: str, ok) -> None:
    if key in hf and hf[key] not in ok:
        raise HFError(f"{where}: {key}={hf[key]!r} is not supported (allowed: "
                      f"{', '.join(map(repr, ok))})")


def config_from_hf(hf: dict, where: str = "config.json", n_layers: int | None = None,
                   max_len: int | None = None) -> ModelConfig:
    """The decoder's config from a Hugging Face config.json (as a dict); `n_layers` keeps the
    first layers, `max_len` shortens the context (None: max_position_embeddings; with LongRoPE,
    original_max_position_embeddings: a longer one switches to the long factors)."""
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise HFError(f"{where}: model_type={kind!r} is not supported (allowed: "
                      f"{', '.join(MODEL_TYPES)})")
    rope = _rope_params(hf)
    if not isinstance(rope, dict):
        raise HFError(f"{where}: rope_parameters (or rope_scaling) must be an object")
    if kind == "gemma3_text":
        return _validated(where, lambda: _gemma3_config(hf, where, n_layers, max_len))
    _refuse(where, hf, "hidden_act", ("silu",))
    _refuse(where, hf, "mlp_bias", (False,))
    if kind in ("llama", "mistral", "qwen3"):
        _refuse(where, hf, "attention_bias", (False,))  # would put a bias on o as well
    _refuse(where, hf, "use_sliding_window", (False,))  # Qwen's per-layer windows
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if kind != "phi3":  # RoPE on part of each head: Phi-3's field alone
        for fields in (hf, rope):
            _refuse(where, fields, "partial_rotary_factor", (1, 1.0))
    window = hf.get("sliding_window") if kind in ("mistral", "phi3") else None
    types = set(hf.get("layer_types") or ())
    if types and (types - {"full_attention", "sliding_attention"} or len(types) > 1
                  or ("sliding_attention" in types) != (window is not None)):
        raise HFError(f"{where}: layer_types={sorted(types)} is not supported (every layer "
                      f"the same attention, sliding only with a Mistral or Phi-3 "
                      f"sliding_window)")

    def build() -> ModelConfig:
        layers = int(hf["num_hidden_layers"])
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim")
        if n_layers is not None and not 1 <= n_layers <= layers:
            raise HFError(f"n_layers={n_layers}: must be in 1..{layers} (the model's layers)")
        context = int(hf.get("max_position_embeddings", 4096 if kind == "phi3" else 2048))
        cfg = ModelConfig(
            vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=n_layers or layers,
            n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            d_ff=int(hf["intermediate_size"]), mlp="swiglu",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_len=context if max_len is None else min(max_len, context),
            rope_base=_rope_base(hf, where, kinds=("default", *LONGROPE_TYPES) if kind == "phi3"
                                 else ("default", "llama3")),
            # transformers' defaults where the field is missing
            norm_eps=float(hf.get("rms_norm_eps", 1e-5 if kind == "phi3" else 1e-6)),
            **_rope_scaling(hf, where),
            head_size=(None if head_dim is None or heads * int(head_dim) == d and d % heads == 0
                       else int(head_dim)),
            qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
            sliding_window=None if window is None else int(window))
        cfg = dataclasses.replace(cfg, rotary_dim=_rotary_dim(partial, cfg.head_dim, where))
        longrope = longrope_fields(hf, where) if kind == "phi3" else {}
        if longrope and max_len is None:  # the pretraining context, where the short factors hold
            longrope["max_len"] = min(context, longrope["rope_original_max_len"])
        return dataclasses.replace(cfg, **longrope)

    return _validated(where, build)


def _rotary_dim(partial, size: int, where: str) -> int | None:
    """RoPE's dimensions per head of `size` for a `partial_rotary_factor` as transformers takes
    it, int(size * factor); None for the whole head."""
    if partial in (None, 1, 1.0):
        return None
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise HFError(f"{where}: partial_rotary_factor={partial!r}: must be a number in (0, 1]")
    return None if int(size * partial) == size else int(size * partial)


def _validated(where: str, build) -> ModelConfig:
    """`build()`'s config, validated; a missing or malformed field is one HFError line."""
    try:
        cfg = build()
        cfg.validate()
    except KeyError as e:
        raise HFError(f"{where}: missing field {e.args[0]!r}") from None
    except HFError:
        raise
    except (TypeError, ValueError) as e:
        raise HFError(f"{where}: describes no valid model ({e})") from None
    return cfg


def _gemma3_config(hf: dict, where: str, n_layers: int | None,
                   max_len: int | None) -> ModelConfig:
    """A gemma3_text config (unvalidated): `layer_types` (or transformers' default, every
    `sliding_window_pattern`-th layer global) as the layer pattern, each kind's RoPE base."""
    for key, ok in (("hidden_activation", ("gelu_pytorch_tanh",)), ("attention_bias", (False,)),
                    ("attn_logit_softcapping", (None,)),
                    ("use_bidirectional_attention", (False, None))):
        _refuse(where, hf, key, ok)
    layers = int(hf["num_hidden_layers"])
    if n_layers is not None and not 1 <= n_layers <= layers:
        raise HFError(f"n_layers={n_layers}: must be in 1..{layers} (the model's layers)")
    every = int(hf.get("sliding_window_pattern", 6))
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise HFError(f"{where}: layer_types must name full_attention or sliding_attention "
                      f"for each of the {layers} layers")
    pattern = "".join("s" if t == "sliding_attention" else "g" for t in types)
    context = int(hf.get("max_position_embeddings", 131_072))
    cap = hf.get("final_logit_softcapping")
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
        n_layers=n_layers or layers, n_heads=int(hf["num_attention_heads"]),
        n_kv_heads=int(hf["num_key_value_heads"]), d_ff=int(hf["intermediate_size"]),
        mlp="geglu", tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        max_len=context if max_len is None else min(max_len, context),
        rope_base=_rope_base(hf, where, "full_attention"),
        rope_local_base=_rope_base(hf, where, "sliding_attention"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), head_size=int(hf.get("head_dim", 256)),
        qk_norm=True, sliding_window=int(hf["sliding_window"]),
        layer_pattern=pattern[:n_layers or layers], norm_plus_one=True, post_norms=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        embed_scale=True, final_softcap=0.0 if cap is None else float(cap))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF (numpy) shape of each tensor kind ([out, in] for Linear weights), per layer."""
    d, f, q, kv = cfg.d_model, cfg.d_ff, cfg.q_dim, cfg.kv_heads * cfg.head_dim
    shapes = {"embed/embedding": (cfg.vocab_size, d), "final_norm/scale": (d,),
              "blocks/attn_norm/scale": (d,), "blocks/mlp_norm/scale": (d,),
              "blocks/attn/q/kernel": (q, d), "blocks/attn/k/kernel": (kv, d),
              "blocks/attn/v/kernel": (kv, d), "blocks/attn/o/kernel": (d, q),
              "blocks/mlp/gate/kernel": (f, d), "blocks/mlp/up/kernel": (f, d),
              "blocks/mlp/down/kernel": (d, f)}
    if cfg.qkv_bias:
        shapes.update({"blocks/attn/q/bias": (q,), "blocks/attn/k/bias": (kv,),
                       "blocks/attn/v/bias": (kv,)})
    if cfg.qk_norm:
        shapes.update({"blocks/attn/q_norm/scale": (cfg.head_dim,),
                       "blocks/attn/k_norm/scale": (cfg.head_dim,)})
    if cfg.post_norms:
        shapes.update({"blocks/post_attn_norm/scale": (d,), "blocks/post_mlp_norm/scale": (d,)})
    if not cfg.tie_embeddings:
        shapes["head/kernel"] = (cfg.vocab_size, d)
    return shapes


def weight_files(folder: str | Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it}, from the one file or the shard index."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError):
            raise HFError(f"{str(folder / INDEX)!r}: no readable weight_map") from None
        files = {f: folder / f for f in set(index.values())}
        for f, path in files.items():
            if Path(f).name != f or not path.is_file():
                raise HFError(f"{str(folder / INDEX)!r}: lists shard {f!r}, not in the folder")
        return {name: files[f] for name, f in index.items()}
    if not (folder / SINGLE).is_file():
        raise HFError(f"{str(folder)!r}: no {SINGLE} and no {INDEX}")
    try:
        with safe_open(folder / SINGLE, framework="numpy") as f:
            return dict.fromkeys(f.keys(), folder / SINGLE)
    except Exception as e:  # safetensors raises its own error types on a damaged header
        raise HFError(f"{str(folder / SINGLE)!r}: not a safetensors file "
                      f"({str(e).splitlines()[0][:120]})") from None


def _targets(name: str, post_norms: bool) -> tuple[tuple[str, ...], int | None] | None:
    """(the NNX paths a tensor holds, in the order of its rows; its layer or None)."""
    if name in _TOP_MAP:
        return (_TOP_MAP[name],), None
    m = _LAYER.fullmatch(name)
    names = _GEMMA_MAP if post_norms else _LAYER_MAP
    if not m:
        return None
    if m.group(2) in _FUSED and not post_norms:
        return _FUSED[m.group(2)], int(m.group(1))
    return ((names[m.group(2)],), int(m.group(1))) if m.group(2) in names else None


# The tensor a parameter's layer is read from: the HF name and, where the tensor is fused, which
# of its rows (start, stop, the fused tensor's rows); None: all of it.
Source = tuple[str, tuple[int, int, int] | None]


def _plan(files: dict[str, Path], cfg: ModelConfig, where: str) -> dict[str, list[Source]]:
    """{NNX path: [its source per layer]}, every name checked (shapes are checked on
    reading)."""
    want = expected_shapes(cfg)
    plan: dict[str, list] = {p: [None] * (cfg.n_layers if p.startswith("blocks/") else 1)
                             for p in want}
    for name in files:
        target = _targets(name, cfg.post_norms)
        if target is None or not set(target[0]) <= set(want):
            if name == "lm_head.weight" and cfg.tie_embeddings:
                continue  # a tied head saved anyway: the embedding serves
            raise HFError(f"{where}: tensor {name!r} is not part of this decoder")
        paths, layer = target
        if layer is not None and layer >= cfg.n_layers:
            continue  # a truncated model
        total = sum(want[p][0] for p in paths)
        for path, rows in fused_rows(paths, want):
            if plan[path][layer or 0] is not None:
                a, b = sorted((plan[path][layer or 0][0], name))
                raise HFError(f"{where}: tensors {a!r} and {b!r} both hold {path}")
            plan[path][layer or 0] = (name, None if rows is None else (*rows, total))
    for path, names in plan.items():
        for i, name in enumerate(names):
            if name is None:
                at = f" of layer {i}" if path.startswith("blocks/") else ""
                raise HFError(f"{where}: missing tensor for {path}{at}")
    return plan


def _read(handle, source: Source, shape: tuple[int, ...], where: str) -> np.ndarray:
    """One tensor, or one part's rows of a fused one, as float32, checked."""
    name, rows = source
    stored = handle.get_slice(name)
    dtype = stored.get_dtype()
    if dtype not in DTYPES:
        raise HFError(f"{where}: tensor {name!r} is {dtype}; allowed {', '.join(DTYPES)}")
    if rows is None:
        a = handle.get_tensor(name)
    else:  # the fused tensor's shape is what its parts add up to, read one part at a time
        fused = (rows[2], *shape[1:])
        if tuple(stored.get_shape()) != fused:
            raise HFError(f"{where}: tensor {name!r} has shape {list(stored.get_shape())}, "
                          f"config.json implies {list(fused)}")
        a = stored[rows[0]:rows[1]]
        name = f"{name}[{rows[0]}:{rows[1]}]"
    if tuple(a.shape) != shape:
        raise HFError(f"{where}: tensor {name!r} has shape {list(a.shape)}, config.json implies "
                      f"{list(shape)}")
    a = a.astype(np.float32, copy=False)
    if not (np.isfinite(a.min()) and np.isfinite(a.max())):
        raise HFError(f"{where}: tensor {name!r} holds non-finite values")
    return a


def iter_params(folder: str | Path, cfg: ModelConfig):
    """Yield (NNX path, float32 array) one parameter at a time: a caller that places each
    array and drops it holds one parameter (plus one tensor being read) on the host."""
    where = repr(str(folder))
    files = weight_files(folder)
    want = expected_shapes(cfg)
    handles: dict[Path, object] = {}
    try:
        def read(path: str, source: Source) -> np.ndarray:
            file = files[source[0]]
            if file not in handles:
                handles[file] = safe_open(file, framework="numpy")
            a = _read(handles[file], source, want[path], where)
            return a.T if path.endswith("/kernel") else a

        for path, names in _plan(files, cfg, where).items():
            stacked = stacked_leaf(path, names, lambda name, p=path: read(p, name))
            yield path, stacked
            del stacked
    finally:
        handles.clear()


def load_params(folder: str | Path, cfg: ModelConfig) -> dict:
    """Pure-dict float32 params of `DecoderLM(cfg)`, matching `nnx.to_pure_dict(nnx.state(...))`."""
    out: dict = {}
    for path, array in iter_params(folder, cfg):
        set_path(out, path, array)
    return out


def load_hf(folder: str | Path, n_layers: int | None = None,
            max_len: int | None = None) -> tuple[ModelConfig, dict]:
    """(config, float32 params) of a Hugging Face decoder folder; HFError (one line) on a bad
    one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFError(f"{str(folder)!r}: not a folder")
    cfg = config_from_hf(read_config(folder), repr(str(folder / "config.json")), n_layers,
                         max_len)
    return cfg, load_params(folder, cfg)
