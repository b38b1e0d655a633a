"""Batch-1 decoding and prefill on one accelerator, bf16 against int8 (the `decode` part of
`experiments.bench_gpu`).

Each model runs in three forms: bf16 (weights and arithmetic), `w8` and `w8a8`, both made by
`quant/` from the float32 weights without calibration, their other arithmetic in bf16. `w8`
stores int8 kernels and widens them to float32 inside each product; `w8a8` multiplies int8
activations by the int8 block kernels (int8 × int8 → int32), its tied head a float32 product
of the int8 table. Decoding is `experiments.pretrained.decoding.decode_benchmark`, the program
the CPU tables time (greedy steps from the KV cache in one jitted scan after an untimed
prefill), every form in the stacked layer scan so that the forms differ in their weights alone,
the forms interleaved; prefill is `experiments.pretrained.prefill_speed.PrefillBench` over one
window (scoring's logits at every position, and generation's prefill into a fresh cache).
Where the pretrained model cannot be loaded (its package is not installed on the accelerator's
host), its preset's shapes run with random weights, and its rows say so.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from experiments.cli.config import ConfigError, error_line
from experiments.pretrained import decoding, loading
from experiments.pretrained.loading import Pretrained, abstract_graphdef
from experiments.pretrained.prefill_speed import PrefillBench, window_of
from experiments.training import pydoc_corpus
from model import MODEL_PRESETS, DecoderLM
from model.gguf import GGUFError

FORMS = ("bf16", "w8", "w8a8")  # the float model, then quant/'s modes of the same name
BF16 = "bfloat16"


def forms(pre: Pretrained) -> dict[str, Pretrained]:
    """{form: model} of FORMS; the int8 forms quantise `pre`'s float32 weights and compute the
    rest in bf16 (their scales stay float32)."""
    cfg = dataclasses.replace(pre.cfg, compute_dtype=BF16)
    f32 = dataclasses.replace(pre, cfg=cfg, graphdef=abstract_graphdef(cfg))
    return {"bf16": loading.with_dtype(pre, BF16),
            **{m: loading.quantize(f32, m) for m in FORMS[1:]}}


def preset_model(preset: str, layers: int | None = None) -> Pretrained:
    """A randomly initialised decoder of `preset` (float32 weights; its first `layers`
    layers): its speed is its shapes'."""
    cfg = MODEL_PRESETS[preset]
    if layers is not None:
        cfg = dataclasses.replace(cfg, n_layers=min(layers, cfg.n_layers))
    params = nnx.to_pure_dict(nnx.state(DecoderLM(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    return Pretrained(preset, cfg, abstract_graphdef(cfg), params, tokenizer=None)


def load_model(name: str, shape: dict) -> tuple[Pretrained, str, str]:
    """(model, weights, why): the pretrained model `name` (weights "pretrained", why ""), else,
    where it cannot be loaded here, its preset's shapes (weights "random", why: the reason);
    the preset of `shape` (bench_gpu's FULL; TINY has none) is random by design. ConfigError where
    neither exists."""
    if name == shape["decode_preset"]:
        return preset_model(name), "random", ""
    try:
        return loading.load(name, n_layers=shape.get("decode_layers")), "pretrained", ""
    except (ConfigError, GGUFError, OSError) as e:
        if name not in MODEL_PRESETS:
            raise ConfigError(error_line(e)) from None
        return preset_model(name, shape.get("decode_layers")), "random", error_line(e)


def prompt_ids(pre: Pretrained, n: int) -> list[int]:
    """`n` tokens of the validation text: the model's own tokens, or its bytes for a
    byte-level model (no tokenizer)."""
    text = pydoc_corpus.split_text("validation")
    ids = (pre.tokenizer.encode(text[:8 * n]) if pre.tokenizer is not None
           else [b % pre.cfg.vocab_size for b in text.encode()])
    return window_of(ids, n)


def leading_agreement(tokens: np.ndarray, reference: np.ndarray) -> int:
    """How many tokens `tokens` shares with `reference` before their first difference."""
    differ = np.flatnonzero(tokens != reference)
    return int(differ[0]) if differ.size else int(tokens.size)


def model_rows(pre: Pretrained, shape: dict, weights: str, why: str = "") -> list[dict]:
    """Decode and prefill rows of `pre`'s FORMS, each form's greedy tokens against bf16's;
    `weights` says what the weights are (pretrained or random) and `why` why random ones
    stand in for pretrained ones."""
    models = forms(pre)
    prompt = prompt_ids(pre, shape["decode_prompt"])
    variants = [decoding.DecodeVariant(form, m, per_layer=False) for form, m in models.items()]
    decoded = decoding.decode_benchmark(variants, prompt, shape["decode_tokens"],
                                        shape["decode_repeats"])
    bench = PrefillBench(models, prompt_ids(pre, shape["decode_window"]))
    bench.time_round(shape["decode_repeats"])
    prefill = {r["variant"]: r for r in bench.rows()}
    reference = np.asarray(decoded[0]["tokens"])
    rows = []
    for form, d in zip(FORMS, decoded, strict=True):
        rows.append({
            "model": pre.name, "weights": weights, "weights_why": why, "form": form,
            "layers": pre.cfg.n_layers, "layout": d["layout"],
            "param_bytes": d["weight_bytes_per_token"], "prompt_tokens": d["prompt_tokens"],
            "new_tokens": d["new_tokens"], "decode_tokens_per_s": d["tokens_per_s"],
            "decode_ms_per_token": d["ms_per_token"], "decode_runs_s": d["runs_s"],
            # each token multiplies by every stored weight once: the rate they would be read
            # at (a product that widens its weights first reads more)
            "stored_gb_per_s": d["weight_bytes_per_token"] * d["tokens_per_s"] / 1e9,
            "tokens_agree_between_runs": d["tokens_agree"],
            # greedy tokens equal to bf16's before the first that differs (all: the same reply)
            "tokens_as_bf16": leading_agreement(np.asarray(d["tokens"]), reference),
            "prefill_window": bench.window,
            "prefill_tokens_per_s": prefill[form]["tokens_per_s"],
            "prefill_last_tokens_per_s": prefill[form + "-last"]["tokens_per_s"]})
    return rows
