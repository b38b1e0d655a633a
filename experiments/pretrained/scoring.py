"""What a pretrained LM's scores are: per-text NLL and next token, and perplexity on a corpus.

`score_ids`/`score_texts` are what `experiments.score` prints; `perplexity` reads a corpus in
windows and, given the float model as a reference, also measures how far an int8 model's
next-token distributions lie from it (`experiments.pretrained.divergence`). Everything is batch
1 and jitted once per padded length; only per-position vectors leave the device.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.cli.config import ConfigError
from experiments.pretrained import divergence, eval_text
from experiments.pretrained.loading import Pretrained
from model import native_argmax, native_logsumexp
from model.flops import param_bytes
from parallel.inference import gather_all_but_layers, gathered_runner, mesh_of

PAD_MULTIPLE = 64  # texts are padded to a multiple of this: few distinct compiled lengths


@functools.lru_cache(maxsize=8)
def make_logits_fn(graphdef, mesh=None):
    """jitted (params, tokens [1, T]) -> logits [T, vocab] (fp32). With the `mesh` the
    parameters are sharded over, each layer is gathered right before it runs
    (parallel/inference.py), so the scores are the single-device ones bit for bit. Cached per
    model and mesh: scoring the same model again reuses its compiled programs."""

    @jax.jit
    def fn(params, tokens):
        if mesh is None:
            logits = nnx.merge(graphdef, params)(tokens)
        else:
            model = nnx.merge(graphdef, gather_all_but_layers(params, mesh))
            logits = model(tokens, runner=gathered_runner(mesh))
        return logits[0].astype(jnp.float32)

    return fn


@functools.lru_cache(maxsize=8)
def make_logprob_fn(graphdef, mesh=None):
    """jitted (params, tokens [1, T]) -> log-probabilities [T, vocab] (fp32), from
    `make_logits_fn`'s logits."""
    logits = make_logits_fn(graphdef, mesh)
    return jax.jit(lambda params, tokens: jax.nn.log_softmax(logits(params, tokens), axis=-1))


def padded(ids: list[int], max_len: int) -> np.ndarray:
    n = min(max_len, PAD_MULTIPLE * math.ceil(len(ids) / PAD_MULTIPLE))
    out = np.zeros((1, n), np.int32)
    out[0, :len(ids)] = ids
    return out


def make_score_fn(graphdef: nnx.GraphDef, mesh=None):
    """jit(params, tokens [1, T]) -> (log p of each next token [T - 1], argmax [T]): only what
    scoring reads leaves the device, not the [T, vocab] log-probabilities, which outgrow host
    memory at long texts and large vocabularies."""
    logits_of = make_logits_fn(graphdef, mesh)

    @jax.jit
    def fn(params, tokens):
        logits = logits_of(params, tokens)
        # log p(next) = its logit - the row's logsumexp, and the argmax of the logits is the
        # log-probabilities': on a CPU both run in shardq's kernels, which go through each
        # vocabulary-wide row far faster than XLA:CPU's exp-sum and argmax
        lse = native_logsumexp.logsumexp(logits)
        picked = jnp.take_along_axis(logits[:-1], tokens[0, 1:, None], axis=-1)[:, 0] - lse[:-1]
        return picked, native_argmax.argmax(logits)

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
