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
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.cli.config import ConfigError
from experiments.cli.model_flags import MODELS
from experiments.pretrained import divergence, eval_text
from experiments.training import pydoc_corpus
from model import DecoderLM, ModelConfig
from model.flops import param_bytes
from model.generate import decode_steps, default_per_layer, prefill, sample_token
from model.gguf import GGUFError
from model.llama_gguf import load_gguf
from model.tokenizer import BPETokenizer, chat_prompt, tokenizer_from_gguf
from parallel.inference import gather_all_but_layers, gathered_runner, mesh_of
from quant.calibrate import calibrate
from quant.convert import ALL_MODES, QuantConfig, quantized_fraction
from quant.kv_cache import init_int8_cache
from quant.pipeline import quantize as run_quantize

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
    report: dict | None = None  # quant/pipeline's report of an int8 model (see quantize)


def abstract_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    return nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))))[0]


def load(name: str = "smollm2", n_layers: int | None = None,
         gguf_path: str | None = None) -> Pretrained:
    """The float32 model and tokenizer: the named model's packaged file, or another Llama GGUF
    at `gguf_path` (GGUFError, one line, on a bad file)."""
    if name not in MODELS:
        raise ConfigError(f"model={name!r}: allowed {', '.join(MODELS)}")
    try:
        cfg, params, gguf = load_gguf(gguf_path, n_layers=n_layers)
        tokenizer = tokenizer_from_gguf(gguf)
    except GGUFError as e:
        if gguf_path is None:  # the packaged file: no flag to name
            raise
        where = repr(str(Path(gguf_path)))  # the reader's messages start with the file
        said = str(e).removeprefix(where).removeprefix(": ")
        raise GGUFError(f"gguf={where}: {said}") from None
    params = jax.tree.map(jnp.asarray, params)
    return Pretrained(name, cfg, abstract_graphdef(cfg), params, tokenizer)


def chat_ids(pre: Pretrained, prompt: str, system: str | None = None) -> list[int]:
    """The token ids of one user turn in the model's ChatML template (a system message first:
    `system`, or the model's default), ending where the assistant's reply begins."""
    return conversation_ids(pre, [{"role": "user", "content": prompt}], system)


def conversation_ids(pre: Pretrained, messages: list[dict[str, str]],
                     system: str | None = None) -> list[int]:
    """The token ids of a conversation (user and assistant turns, the last one the user's) in
    the ChatML template, after `system` or the model's default system message, ending where
    the next assistant reply begins."""
    head = [{"role": "system", "content": system}] if system else []
    return pre.tokenizer.encode(chat_prompt(head + list(messages)))


def calibration_rows(tokenizer: BPETokenizer, n: int, length: int = CALIB_LEN) -> list:
    """n rows [1, length + 1] of consecutive tokens from the training topics (never the
    validation topics perplexity reads)."""
    ids = np.asarray(tokenizer.encode(pydoc_corpus.split_text("train")), np.int32)
    step = max(1, (len(ids) - length - 1) // max(n, 1))
    return [ids[i * step:i * step + length + 1][None] for i in range(n)]


# The Llama block's Dense layers grouped by the input they read: leaving one group in float
# under plain w8a8 shows how much of w8a8's perplexity change that input's int8 rounding causes.
SENSITIVITY_GROUPS = {"q/k/v": ("blocks/attn/q", "blocks/attn/k", "blocks/attn/v"),
                      "o": ("blocks/attn/o",), "gate/up": ("blocks/mlp/gate", "blocks/mlp/up"),
                      "down": ("blocks/mlp/down",)}


def rules_without(group: str) -> tuple[str, ...]:
    """Quantisation rules selecting every block Dense layer except `group`'s."""
    return tuple(p for g, paths in SENSITIVITY_GROUPS.items() if g != group for p in paths)


def quantize(pre: Pretrained, mode: str, qcfg: QuantConfig | None = None,
             error_report: bool = False) -> Pretrained:
    """The int8 model (`mode` of quant/convert.py; `none` returns the float model). Only the
    modes that calibrate (w8a8-static, smoothquant, auto) read calibration rows; error_report
    asks for quant.pipeline's per-layer error rows as well, an eager pass over those rows that
    costs the full model about half a minute and changes nothing in the model."""
    if mode not in ALL_MODES:
        raise ConfigError(f"quant={mode!r}: allowed {', '.join(ALL_MODES)}")
    if mode == "none":
        return pre
    qcfg = qcfg or QuantConfig(mode=mode)
    graphdef, qparams, plan, report = run_quantize(
        pre.graphdef, jax.device_get(pre.params), qcfg,
        lambda: calibration_rows(pre.tokenizer, qcfg.calib_batches), error_report)
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


def make_score_fn(graphdef: nnx.GraphDef, mesh=None):
    """jit(params, tokens [1, T]) -> (log p of each next token [T - 1], argmax [T]): only what
    scoring reads leaves the device, not the [T, vocab] log-probabilities (3 GB in float64 at
    8,000 tokens of a 49,152-token vocabulary)."""
    logprobs = make_logprob_fn(graphdef, mesh)

    @jax.jit
    def fn(params, tokens):
        logp = logprobs(params, tokens)
        picked = jnp.take_along_axis(logp[:-1], tokens[0, 1:, None], axis=-1)[:, 0]
        return picked, jnp.argmax(logp, axis=-1)

    return fn


def score_ids(pre: Pretrained, token_lists: list[list[int]], tail: int = 0) -> list[dict]:
    """Per text: {"tokens", "mean_nll" (nats over positions 1..n-1; None for one token),
    "next_token" (argmax after the whole text)}, and with `tail` "mean_nll_last" over the last
    `tail` of those positions (as experiments/reference/reference_scoring.py). Causal: right padding
    changes nothing."""
    fn = make_score_fn(pre.graphdef, mesh_of(pre.params))
    rows = []
    for i, ids in enumerate(token_lists):
        if not ids:
            raise ConfigError(f"text {i}: no tokens; give a non-empty text")
        if len(ids) > pre.cfg.max_len:
            raise ConfigError(f"text {i}: {len(ids)} tokens; at most {pre.cfg.max_len} fit the "
                              f"context")
        picked, argmax = fn(pre.params, padded(ids, pre.cfg.max_len))
        n = len(ids)
        nlls = -np.asarray(picked[:n - 1], np.float64)
        row = {"tokens": list(map(int, ids)), "mean_nll": float(np.mean(nlls)) if n > 1 else None,
               "next_token": int(argmax[n - 1])}
        if tail and n > 1:
            row["mean_nll_last"] = float(np.mean(nlls[-tail:]))
        rows.append(row)
    return rows


def score_texts(pre: Pretrained, texts: list[str]) -> list[dict]:
    for i, t in enumerate(texts):
        if not t:
            raise ConfigError(f"text {i}: empty; give at least one character")
    return score_ids(pre, [pre.tokenizer.encode(t) for t in texts])


def validation_ids(pre: Pretrained, tokens: int, window: int,
                   corpus: str = "pydoc") -> np.ndarray:
    """The token ids perplexity reads: the first whole windows of `window` tokens among the
    first `tokens` tokens of the corpus (`eval_text`: pydoc's validation topics by default;
    ConfigError, one line, if they don't fit)."""
    if window < 2 or window > pre.cfg.max_len:
        raise ConfigError(f"window={window}: must be in 2..{pre.cfg.max_len}")
    ids = np.asarray(pre.tokenizer.encode(eval_text.text(corpus)), np.int32)
    if not window <= tokens <= len(ids):
        raise ConfigError(f"tokens={tokens}: must be in {window}..{len(ids)} (the {corpus} "
                          f"text holds {len(ids)} tokens)")
    return ids[:tokens // window * window]


@functools.lru_cache(maxsize=8)
def make_divergence_fn(graphdef: nnx.GraphDef, ref_graphdef: nnx.GraphDef, mesh=None,
                       ref_mesh=None):
    """jit(params, ref_params, tokens [1, T]) -> (log p of each next token [T - 1], and at the
    same T - 1 positions the KL divergence KL(reference || model) of the next-token
    distributions in nats and whether both models' most likely next token agree). Only these
    three vectors leave the device, not the two [T, vocab] log-probability arrays."""
    logprobs = make_logprob_fn(graphdef, mesh)
    ref_logprobs = make_logprob_fn(ref_graphdef, ref_mesh)

    @jax.jit
    def fn(params, ref_params, tokens):
        logq = logprobs(params, tokens)[:-1]
        picked = jnp.take_along_axis(logq, tokens[0, 1:, None], axis=-1)[:, 0]
        return picked, *divergence.per_position(ref_logprobs(ref_params, tokens)[:-1], logq)

    return fn


def perplexity(pre: Pretrained, tokens: int, window: int, corpus: str = "pydoc",
               reference: Pretrained | None = None) -> dict:
    """NLL and perplexity on the first `tokens` tokens of the corpus (pydoc's validation topics
    by default), read in non-overlapping windows of `window` tokens (each window's first token
    has no context and is not scored, so `tokens - windows` positions are). With a `reference`
    model (the float one of an int8 model), the row also holds "divergence": how far this
    model's next-token distributions lie from the reference's at the same positions
    (`experiments.pretrained.divergence.summary`); the reference runs again window by window beside
    it, so nothing of vocabulary size is held for the whole text."""
    ids = validation_ids(pre, tokens, window, corpus)
    mesh = mesh_of(pre.params)
    if reference is None:
        score = make_score_fn(pre.graphdef, mesh)
    else:
        diverge = make_divergence_fn(pre.graphdef, reference.graphdef, mesh,
                                     mesh_of(reference.params))
    total, count, windows, kls, agrees = 0.0, 0, len(ids) // window, [], []
    for start in range(0, len(ids), window):
        tok = ids[None, start:start + window]
        if reference is None:
            picked, _ = score(pre.params, tok)
        else:
            picked, kl, agree = diverge(pre.params, reference.params, tok)
            kls.append(np.asarray(kl, np.float64))
            agrees.append(np.asarray(agree))
        total -= float(np.sum(np.asarray(picked, np.float64)))
        count += window - 1
    nll = total / count
    row = {"model": pre.name, "quant": pre.quant, "corpus": corpus, "tokens": windows * window,
           "scored": count, "window": window, "nll": nll, "perplexity": math.exp(nll),
           "param_bytes": param_bytes(pre.params),
           "quantized_fraction": pre.quantized_fraction}
    if reference is not None:
        row["divergence"] = divergence.summary(np.concatenate(kls), np.concatenate(agrees),
                                               reference.quant)
    return row


def quant_config_from_flags(args) -> QuantConfig | None:
    """The launchers' --alpha as a QuantConfig (None: the mode's defaults)."""
    return (QuantConfig(mode=args.quant, alpha=args.alpha)
            if getattr(args, "alpha", None) is not None else None)


def load_from_flags(args) -> Pretrained:
    return quantize(load(args.model, args.layers, args.gguf), args.quant,
                    quant_config_from_flags(args))


@dataclasses.dataclass(frozen=True)
class DecodeVariant:
    """One way to decode: a (possibly int8) model, its KV cache kind and its layer layout."""
    name: str
    model: Pretrained
    kv_int8: bool = False
    per_layer: bool | None = None  # False: the layer scan; None: model.generate's default


def decode_programs(v: DecodeVariant, prompt: list[int], new_tokens: int):
    """(timed, args): a jitted call that decodes `new_tokens` greedy tokens after the prompt's
    prefill (run here, once, untimed), and its arguments. The call starts from the same cache
    every time (nothing is donated), so repeated calls do identical work."""
    pre, ids = v.model, jnp.asarray([prompt], jnp.int32)
    make_cache = init_int8_cache if v.kv_int8 else None
    per_layer = (default_per_layer(nnx.merge(pre.graphdef, pre.params)) if v.per_layer is None
                 else v.per_layer)

    @jax.jit
    def run_prompt(params, ids):
        model = nnx.merge(pre.graphdef, params)
        logits, cache, layers = prefill(model, ids, new_tokens, make_cache=make_cache,
                                        per_layer=per_layer)
        return sample_token(logits, None, 0.0, 0), cache, layers

    @jax.jit
    def steps(params, first, cache, layers):
        return decode_steps(nnx.merge(pre.graphdef, params), first, cache, layers, len(prompt),
                            new_tokens, jax.random.key(0))

    first, cache, layers = run_prompt(pre.params, ids)
    return steps, (pre.params, first, cache, layers)


def decode_benchmark(variants: list[DecodeVariant], prompt: list[int], new_tokens: int,
                     repeats: int = 5) -> list[dict]:
    """Batch-1 greedy decoding speed of each variant: `repeats` timed calls of `new_tokens`
    cached steps each (one jitted `lax.scan`, the prefill excluded), the variants interleaved
    (A, B, C, A, B, C, ...) so that a change in the machine's load hits them alike; the median
    is reported. Every variant writes the same tokens' worth of work; `tokens` lets a caller
    check they agree."""
    if not prompt or len(prompt) + new_tokens > variants[0].model.cfg.max_len:
        raise ConfigError(f"prompt ({len(prompt)} tokens) + new_tokens={new_tokens}: must fit "
                          f"the context of {variants[0].model.cfg.max_len}")
    progs = [decode_programs(v, prompt, new_tokens) for v in variants]
    tokens = [np.asarray(jax.block_until_ready(fn(*args)))[0] for fn, args in progs]  # compile
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(repeats):
        for (fn, args), t in zip(progs, times, strict=True):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            t.append(time.perf_counter() - t0)
    rows = []
    for v, t, toks, (_, args) in zip(variants, times, tokens, progs, strict=True):
        sec, cache, layers = float(np.median(t)), args[2], args[3]
        rows.append({"variant": v.name, "quant": v.model.quant, "kv_int8": v.kv_int8,
                     "layout": "per_layer" if layers is not None else "layer_scan",
                     "prompt_tokens": len(prompt), "new_tokens": new_tokens,
                     "tokens_per_s": new_tokens / sec, "ms_per_token": 1e3 * sec / new_tokens,
                     "runs_s": [round(x, 5) for x in t],
                     # A step multiplies by every block weight and (tied) the whole embedding
                     # table, so each token reads all the parameters once; the cache on top.
                     "weight_bytes_per_token": param_bytes(v.model.params),
                     "kv_cache_bytes": param_bytes(cache),
                     "tokens": toks.tolist()})
    return rows


def decode_speeds(models: list[Pretrained], prompt: list[int], new_tokens: int,
                  repeats: int = 5) -> list[dict]:
    """Batch-1 greedy decoding speed of each model with a float and an int8 KV cache, all in
    one interleaved `decode_benchmark` (timed one after another, separate runs moved with the
    machine's load: float's speed changed by a quarter between two modes' turns)."""
    variants = [DecodeVariant(f"{m.quant}{'+kv8' if kv else ''}", m, kv)
                for m in models for kv in (False, True)]
    return [{"quant": r["quant"], "kv_int8": r["kv_int8"], "prompt_tokens": r["prompt_tokens"],
             "new_tokens": new_tokens, "seconds": r["ms_per_token"] * new_tokens / 1e3,
             "tokens_per_s": r["tokens_per_s"], "runs_s": r["runs_s"]}
            for r in decode_benchmark(variants, prompt, new_tokens, repeats)]


def activation_outliers(pre: Pretrained, rows: list, top: int = 10) -> dict:
    """Where the float model's Dense inputs have outlier channels, on calibration rows: per
    module the largest channel absmax and its ratio to the median channel's (per layer), and
    the `top` (module, layer, channel) entries overall; `per_layer` keeps each layer's largest
    channel and that ratio for the plot, `peak` the module's largest entry.

    Each entry also says which tokens carry it (`carriers`): the tokens whose largest
    input is in that channel and reaches a tenth of its peak, how many of them are the first
    token of their row, and their text. Beside it, `median_token_absmax`, the median over
    tokens of a token's largest input in that layer: what a per-token int8 scale is set by
    on an ordinary token, against the carriers' peak."""
    stats = calibrate(pre.graphdef, jax.device_get(pre.params), rows)
    ids = np.concatenate([np.asarray(r)[0, :-1] for r in rows])
    row_len = int(rows[0].shape[1] - 1)
    per_module, entries = {}, []
    for path, a in sorted(stats["absmax"].items()):
        a = np.asarray(a).reshape(-1, a.shape[-1])  # [layers, in]
        tok_max = np.asarray(stats["token_absmax"][path]).reshape(a.shape[0], -1)
        tok_arg = np.asarray(stats["token_argmax"][path]).reshape(a.shape[0], -1)
        med = np.median(a, axis=-1)
        worst = int(np.argmax(a.max(-1) / med))
        per_module[path] = {"max": float(a.max()), "worst_layer": worst,
                            "worst_ratio_to_median": float(a[worst].max() / med[worst]),
                            "median_ratio": float(np.median(a.max(-1) / med)),
                            "per_layer": {"max": a.max(-1).tolist(),
                                          "ratio_to_median": (a.max(-1) / med).tolist()}}
        mine = []
        for layer in range(a.shape[0]):
            ch = int(np.argmax(a[layer]))
            mine.append({"module": path, "layer": layer, "channel": ch,
                         "absmax": float(a[layer, ch]),
                         "ratio_to_median": float(a[layer, ch] / med[layer]),
                         "median_token_absmax": float(np.median(tok_max[layer])),
                         "carriers": _carriers(tok_max[layer], tok_arg[layer], ch,
                                               float(a[layer, ch]), ids, row_len,
                                               pre.tokenizer)})
        per_module[path]["peak"] = max(mine, key=lambda e: e["absmax"])
        entries += mine
    entries.sort(key=lambda e: -e["absmax"])
    return {"per_module": per_module, "top": entries[:top],
            "calibration": {"rows": len(rows), "tokens_per_row": row_len}}


def _carriers(tok_max: np.ndarray, tok_arg: np.ndarray, channel: int, peak: float,
              ids: np.ndarray, row_len: int, tokenizer: BPETokenizer) -> dict:
    """The tokens whose largest input is `channel` at a tenth of `peak` or more."""
    where = np.flatnonzero((tok_arg == channel) & (tok_max >= peak / 10))
    texts = Counter(tokenizer.decode([int(ids[i])]) for i in where)
    return {"tokens": int(where.size), "of": int(tok_max.size),
            "first_of_row": int(np.sum(where % row_len == 0)),
            "texts": [{"text": t, "count": c} for t, c in texts.most_common(5)]}
