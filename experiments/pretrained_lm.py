"""Pretrained decoder LMs (SmolLM2-135M-Instruct) for scoring, perplexity and chat.

`load(name)` reads the GGUF shipped by a Python package into float32 NNX parameters of the
project's own `DecoderLM` plus its tokenizer; `quantize` runs `quant/` on it with calibration
rows from the training topics of `pydoc_data`; `score` and `perplexity` are the measurements the
launchers print. Everything is batch-1 friendly and jitted once per padded length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import pydoc_corpus
from experiments.config import ConfigError
from model import DecoderLM, ModelConfig
from model.flops import param_bytes
from model.generate import generate
from model.llama_gguf import load_gguf
from model.tokenizer import BPETokenizer, tokenizer_from_gguf
from parallel.inference import gather_all_but_layers, gathered_runner, mesh_of
from quant.calibrate import calibrate
from quant.convert import ALL_MODES, QuantConfig, quantized_fraction
from quant.kv_cache import init_int8_cache
from quant.pipeline import quantize as run_quantize

MODELS = ("smollm2",)
PAD_MULTIPLE = 64  # texts are padded to a multiple of this: few distinct compiled lengths
CALIB_LEN = 256  # tokens per calibration row


@dataclasses.dataclass
class Pretrained:
    name: str
    cfg: ModelConfig
    graphdef: nnx.GraphDef
    params: dict
    tokenizer: BPETokenizer
    quant: str = "none"
    quantized_fraction: float = 0.0
    report: dict | None = None  # quant/pipeline's per-layer report of an int8 model


def abstract_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    return nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))))[0]


def load(name: str = "smollm2", n_layers: int | None = None,
         gguf_path: str | None = None) -> Pretrained:
    """The float32 model and tokenizer: the named model's packaged file, or another Llama GGUF
    at `gguf_path` (GGUFError, one line, on a bad file)."""
    if name not in MODELS:
        raise ConfigError(f"model={name!r}: allowed {', '.join(MODELS)}")
    cfg, params, gguf = load_gguf(gguf_path, n_layers=n_layers)
    tokenizer = tokenizer_from_gguf(gguf)
    params = jax.tree.map(jnp.asarray, params)
    return Pretrained(name, cfg, abstract_graphdef(cfg), params, tokenizer)


def calibration_rows(tokenizer: BPETokenizer, n: int, length: int = CALIB_LEN) -> list:
    """n rows [1, length + 1] of consecutive tokens from the training topics (never the
    validation topics perplexity reads)."""
    ids = np.asarray(tokenizer.encode(pydoc_corpus.split_text("train")), np.int32)
    step = max(1, (len(ids) - length - 1) // max(n, 1))
    return [ids[i * step:i * step + length + 1][None] for i in range(n)]


def quantize(pre: Pretrained, mode: str, qcfg: QuantConfig | None = None) -> Pretrained:
    """The int8 model (`mode` of quant/convert.py; `none` returns the float model)."""
    if mode not in ALL_MODES:
        raise ConfigError(f"quant={mode!r}: allowed {', '.join(ALL_MODES)}")
    if mode == "none":
        return pre
    qcfg = qcfg or QuantConfig(mode=mode)
    batches = calibration_rows(pre.tokenizer, qcfg.calib_batches)
    graphdef, qparams, plan, report = run_quantize(pre.graphdef, jax.device_get(pre.params),
                                                   qcfg, batches)
    return dataclasses.replace(pre, graphdef=graphdef, params=qparams, quant=mode,
                               quantized_fraction=quantized_fraction(pre.params, plan),
                               report=report)


@functools.lru_cache(maxsize=8)
def make_logprob_fn(graphdef, mesh=None):
    """jitted (params, tokens [1, T]) -> log-probabilities [T, vocab] (fp32). With the `mesh`
    the parameters are sharded over, each layer is gathered right before it runs
    (parallel/inference.py), so the scores are the single-device ones bit for bit. Cached per
    model and mesh: scoring the same model again reuses its compiled programs."""

    @jax.jit
    def fn(params, tokens):
        if mesh is None:
            logits = nnx.merge(graphdef, params)(tokens)
        else:
            model = nnx.merge(graphdef, gather_all_but_layers(params, mesh))
            logits = model(tokens, runner=gathered_runner(mesh))
        return jax.nn.log_softmax(logits[0], axis=-1)

    return fn


def padded(ids: list[int], max_len: int) -> np.ndarray:
    n = min(max_len, PAD_MULTIPLE * math.ceil(len(ids) / PAD_MULTIPLE))
    out = np.zeros((1, n), np.int32)
    out[0, :len(ids)] = ids
    return out


def score_ids(pre: Pretrained, token_lists: list[list[int]]) -> list[dict]:
    """Per text: {"tokens", "mean_nll" (nats over positions 1..n-1; None for one token),
    "next_token" (argmax after the whole text)}. Causal: right padding changes nothing."""
    fn = make_logprob_fn(pre.graphdef, mesh_of(pre.params))
    rows = []
    for i, ids in enumerate(token_lists):
        if not ids:
            raise ConfigError(f"text {i}: no tokens; give a non-empty text")
        if len(ids) > pre.cfg.max_len:
            raise ConfigError(f"text {i}: {len(ids)} tokens; at most {pre.cfg.max_len} fit the "
                              f"context")
        logp = np.asarray(fn(pre.params, padded(ids, pre.cfg.max_len)), np.float64)
        n = len(ids)
        nll = float(-np.mean(logp[np.arange(n - 1), ids[1:]])) if n > 1 else None
        rows.append({"tokens": list(map(int, ids)), "mean_nll": nll,
                     "next_token": int(np.argmax(logp[n - 1]))})
    return rows


def score_texts(pre: Pretrained, texts: list[str]) -> list[dict]:
    for i, t in enumerate(texts):
        if not t:
            raise ConfigError(f"text {i}: empty; give at least one character")
    return score_ids(pre, [pre.tokenizer.encode(t) for t in texts])


def perplexity(pre: Pretrained, tokens: int, window: int) -> dict:
    """NLL and perplexity on the first `tokens` tokens of the validation topics, read in
    non-overlapping windows of `window` tokens (each window's first token has no context and is
    not scored, so `tokens - windows` positions are)."""
    if window < 2 or window > pre.cfg.max_len:
        raise ConfigError(f"window={window}: must be in 2..{pre.cfg.max_len}")
    ids = np.asarray(pre.tokenizer.encode(pydoc_corpus.split_text("validation")), np.int32)
    if not window <= tokens <= len(ids):
        raise ConfigError(f"tokens={tokens}: must be in {window}..{len(ids)} (the validation "
                          f"topics hold {len(ids)} tokens)")
    fn = make_logprob_fn(pre.graphdef, mesh_of(pre.params))
    total, count, windows = 0.0, 0, tokens // window
    for start in range(0, windows * window, window):
        chunk = ids[start:start + window]
        logp = np.asarray(fn(pre.params, chunk[None]), np.float64)
        total -= float(np.sum(logp[np.arange(window - 1), chunk[1:]]))
        count += window - 1
    nll = total / count
    return {"model": pre.name, "quant": pre.quant, "tokens": windows * window, "scored": count,
            "window": window, "nll": nll, "perplexity": math.exp(nll),
            "param_bytes": param_bytes(pre.params),
            "quantized_fraction": pre.quantized_fraction}


def add_model_flags(p) -> None:
    """--model, --quant, --layers: how every pretrained-LM launcher picks its model."""
    p.add_argument("--model", default="smollm2", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--quant", default="none", help=f"one of {', '.join(ALL_MODES)}")
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N blocks (a truncated model, for quick checks)")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="another Llama-architecture GGUF file (default: the model's package)")


def check_model_flags(args) -> None:
    """Refuse bad flags before anything is loaded (ConfigError, one line)."""
    if args.model not in MODELS:
        raise ConfigError(f"model={args.model!r}: allowed {', '.join(MODELS)}")
    if args.quant not in ALL_MODES:
        raise ConfigError(f"quant={args.quant!r}: allowed {', '.join(ALL_MODES)}")
    if args.layers is not None and args.layers < 1:
        raise ConfigError(f"layers={args.layers}: must be a positive integer")


def load_from_flags(args) -> Pretrained:
    return quantize(load(args.model, args.layers, args.gguf), args.quant)


def decode_speed(pre: Pretrained, prompt: list[int], new_tokens: int, kv_int8: bool,
                 repeats: int = 3) -> dict:
    """Batch-1 greedy decoding speed: the best of `repeats` timed runs of the jitted
    prefill + `new_tokens` cached steps (compiled once beforehand), prefill time subtracted."""
    make_cache = init_int8_cache if kv_int8 else None
    gen = jax.jit(generate, static_argnums=(0, 3, 5, 6, 7, 8))
    ids = jnp.asarray([prompt], jnp.int32)
    key = jax.random.key(0)

    def run(n):
        t = time.perf_counter()
        jax.block_until_ready(gen(pre.graphdef, pre.params, ids, n, key, 0.0, 0, None,
                                  make_cache))
        return time.perf_counter() - t

    run(1), run(new_tokens)  # compile both programs
    prefill = min(run(1) for _ in range(repeats))
    total = min(run(new_tokens) for _ in range(repeats))
    return {"quant": pre.quant, "kv_int8": kv_int8, "prompt_tokens": len(prompt),
            "new_tokens": new_tokens, "seconds": total - prefill,
            "tokens_per_s": (new_tokens - 1) / max(total - prefill, 1e-9)}


def activation_outliers(pre: Pretrained, rows: list, top: int = 10) -> dict:
    """Where the float model's Dense inputs have outlier channels, on calibration rows: per
    module the largest channel absmax and its ratio to the median channel's (per layer), and
    the `top` (module, layer, channel) entries overall."""
    absmax = calibrate(pre.graphdef, jax.device_get(pre.params), rows)["absmax"]
    per_module, entries = {}, []
    for path, a in sorted(absmax.items()):
        a = np.asarray(a).reshape(-1, a.shape[-1])  # [layers, in]
        med = np.median(a, axis=-1)
        worst = int(np.argmax(a.max(-1) / med))
        per_module[path] = {"max": float(a.max()), "worst_layer": worst,
                            "worst_ratio_to_median": float(a[worst].max() / med[worst]),
                            "median_ratio": float(np.median(a.max(-1) / med))}
        for layer in range(a.shape[0]):
            ch = int(np.argmax(a[layer]))
            entries.append({"module": path, "layer": layer, "channel": ch,
                            "absmax": float(a[layer, ch]),
                            "ratio_to_median": float(a[layer, ch] / med[layer])})
    entries.sort(key=lambda e: -e["absmax"])
    return {"per_module": per_module, "top": entries[:top],
            "calibration": {"rows": len(rows), "tokens_per_row": int(rows[0].shape[1] - 1)}}
