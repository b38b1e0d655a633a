"""A pretrained decoder LM (SmolLM2-135M-Instruct, or any `--model REF`) as the project's own
model, float or int8.

`load` reads what a model reference names (experiments/pretrained/model_ref.py: a Llama GGUF,
the one a Python package ships or another file, a Hugging Face folder or a training run) into
float32 NNX parameters of `DecoderLM` plus its tokenizer; `quantize` runs `quant/` on it,
calibrating on rows from the training topics of `pydoc_data`; `load_quantized` does both from
the values a launcher's model flags hold. The chat template's token ids live here too, beside
the tokenizer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.cli.config import ConfigError
from experiments.pretrained import model_ref, ref_loading
from experiments.pretrained.registered import (  # noqa: F401 - where launchers find them
    ASSEMBLED,
    INSTALL,
    assembled_gguf,
    cache_dir,
    gguf_tokenizer,
)
from experiments.training import pydoc_corpus
from model import DecoderLM, ModelConfig
from model.chat_template import ChatTemplateError
from model.gguf import GGUFError
from model.layers import use_native_float
from model.llama_gguf import load_gguf
from model.tokenizer import BPETokenizer, chat_prompt, tokenizer_from_gguf
from model.transformer import Attention
from quant import quantizers as qz
from quant.convert import ALL_MODES, QuantConfig, quantized_fraction
from quant.pipeline import quantize as run_quantize

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
         gguf_path: str | None = None, step: int | None = None,
         context: int | None = None) -> Pretrained:
    """The float32 model and tokenizer of the reference `name` (a registered name, a .gguf
    file, a Hugging Face folder or a run folder, its checkpoint `step` or else the newest
    intact one; ConfigError naming `model` otherwise), or of the Llama GGUF at `gguf_path`
    (GGUFError, one line, on a bad file), run with a context of `context` tokens (None: the
    model's own). The result is labelled with what was read: the name, or the path."""
    pre = _load(name, n_layers, gguf_path, step)
    return pre if context is None else with_context(pre, context)


def with_context(pre: Pretrained, context: int) -> Pretrained:
    """`pre` run with a context of `context` tokens: the longest text it scores, the longest
    conversation it continues; beyond the model's own, RoPE goes on past the positions it was
    trained at (as `train --max-len` does), and a LongRoPE model takes its long factors past its
    pretraining context."""
    cfg = dataclasses.replace(pre.cfg, max_len=context)
    return dataclasses.replace(pre, cfg=cfg, graphdef=abstract_graphdef(cfg))


def _load(name: str, n_layers: int | None, gguf_path: str | None,
          step: int | None) -> Pretrained:
    ref = model_ref.resolve(name)
    if step is not None and ref.kind != "run":
        model_ref.check_step(name, step)  # one line naming step
    if ref.kind in ("hf", "run"):
        got = (ref_loading.load_run(ref, n_layers, step) if ref.kind == "run"
               else ref_loading.load_ref(ref, n_layers))
        return Pretrained(ref.label, got.cfg, abstract_graphdef(got.cfg),
                          jax.tree.map(jnp.asarray, got.params), got.tokenizer)
    if ref.kind == "gguf":
        if gguf_path is not None and gguf_path != name:
            raise ConfigError(f"gguf={gguf_path!r}: give the file once (model={name!r} names "
                              f"one already)")
        gguf_path = name
    if ref.kind == "name" and name in ASSEMBLED and gguf_path is None:
        path = assembled_gguf(name)
        cfg, params, gguf = load_gguf(path, n_layers=n_layers)
        tokenizer = gguf_tokenizer(gguf, name)  # built once into the cache, rebuilt when stale
        return Pretrained(name, cfg, abstract_graphdef(cfg), jax.tree.map(jnp.asarray, params),
                          tokenizer)
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
    label = name if gguf_path is None else str(gguf_path)
    return Pretrained(label, cfg, abstract_graphdef(cfg), params, tokenizer)


def as_float32(pre: Pretrained) -> Pretrained:
    """`pre` with float32 parameters and arithmetic: a bfloat16 run's weights widened (exactly),
    so that a comparison with its int8 twin measures the int8 rounding, not bfloat16's."""
    return with_dtype(pre, "float32")


def with_dtype(pre: Pretrained, dtype: str) -> Pretrained:
    """`pre` with its floating parameters stored and its arithmetic run in `dtype`."""
    cfg = dataclasses.replace(pre.cfg, param_dtype=dtype, compute_dtype=dtype)
    params = jax.tree.map(lambda a: a.astype(dtype)
                          if jnp.issubdtype(a.dtype, jnp.floating) else a, pre.params)
    return dataclasses.replace(pre, cfg=cfg, graphdef=abstract_graphdef(cfg), params=params)


def off_grid(pre: Pretrained, sigma: float, block: int, seed: int = 0) -> Pretrained:
    """`pre` with Gaussian noise of `sigma` times each block's int8 step (its absmax / 127 over
    `block` values of a row) added to the embedding table: a table on no int8 grid, as a model
    that was never stored quantised has, where a packaged file's table may lie on its blocks'
    grid already (and int8 of it would be exact)."""
    table = pre.params["embed"]["embedding"]
    rows, step = qz.blocked(table.astype(jnp.float32), qz.block_scale(table, block))
    noise = jax.random.normal(jax.random.key(seed), rows.shape, jnp.float32)
    moved = (rows + sigma * step * noise).reshape(table.shape).astype(table.dtype)
    params = {**pre.params, "embed": {**pre.params["embed"], "embedding": moved}}
    return dataclasses.replace(pre, params=params, name=f"{pre.name} (table off-grid, "
                                                        f"sigma {sigma:g})")


def chat_ids(pre: Pretrained, prompt: str, system: str | None = None) -> list[int]:
    """The token ids of one user turn in the model's chat template (a system message first:
    `system`, or the template's default), ending where the assistant's reply begins."""
    return conversation_ids(pre, [{"role": "user", "content": prompt}], system)


def conversation_ids(pre: Pretrained, messages: list[dict[str, str]],
                     system: str | None = None) -> list[int]:
    """The token ids of a conversation (user and assistant turns, the last one the user's) in
    the model's own chat template (model/chat_template.py), after `system` if given, ending
    where the next assistant reply begins; a GGUF vocabulary with ChatML's tokens and no
    template gets SmolLM2's ChatML. A base model (see `has_chat_template`) is given the texts
    themselves, one per line, to continue."""
    head = [{"role": "system", "content": system}] if system else []
    tok = pre.tokenizer
    if not has_chat_template(tok):
        return tok.encode("\n".join(m["content"] for m in head + list(messages)))
    if not getattr(tok, "chat_template", None):
        return tok.encode(chat_prompt(head + list(messages)))
    try:
        return tok.encode(tok.chat_prompt(head + list(messages)), add_bos=False)
    except ChatTemplateError as e:
        raise ConfigError(f"model={pre.name!r}: {e}") from None


def has_chat_template(tokenizer) -> bool:
    """Whether the model chats in a template: its own (a Hugging Face folder's or a GGUF's), or
    a GGUF vocabulary with ChatML's tokens. Without one (Gemma 3 270M, a base model) a prompt
    is plain text the model continues."""
    if getattr(tokenizer, "chat_template", None):
        return True
    return tokenizer.tok.token_to_id("<|im_start|>") is not None


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
    asks for quant.pipeline's per-layer error rows as well: an extra eager pass over those
    rows, slow on the full model, that changes nothing in the model."""
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


def for_decoding(pre: Pretrained, kernels: bool = True, attention: bool = True) -> Pretrained:
    """`pre` with its few-row float32 work in shardq's kernels (`kernels`: the Dense layers'
    products, `model.native_float`, and, with `attention`, attention over the cache at one
    position, `model.native_attention`) or XLA's operations: the model a decoding step reads.
    Never for training: the kernels have no gradient."""
    model = use_native_float(nnx.merge(pre.graphdef, pre.params), kernels)
    if not attention:
        for _, module in nnx.iter_modules(model):
            if isinstance(module, Attention):
                module.native = False
    # the float kernels' layout changes with the switch: the state too, not only the graph
    graphdef, state = nnx.split(model)
    return dataclasses.replace(pre, graphdef=graphdef, params=nnx.to_pure_dict(state))


def load_quantized(name: str = "smollm2", n_layers: int | None = None,
                   gguf_path: str | None = None, mode: str = "none",
                   alpha: float | None = None, step: int | None = None,
                   context: int | None = None) -> Pretrained:
    """`load`, then `quantize` to `mode`; `alpha` (None: the mode's own choice) is SmoothQuant's
    migration strength at every site."""
    qcfg = QuantConfig(mode=mode, alpha=alpha) if alpha is not None else None
    return quantize(load(name, n_layers, gguf_path, step, context), mode, qcfg)
