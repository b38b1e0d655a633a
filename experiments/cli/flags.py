"""Command-line flags generated from config dataclasses: one --flag per field.

`add_field_flags` makes the flags of any dataclass, `field_overrides` reads back those given;
`add_override_flags` and `config_from_args` do both for a run's model and training config over
a preset. Importing this module does not import JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from experiments.cli.config import ConfigError
from experiments.training import lineage
from experiments.training.config import (
    DATA_CORPUS,
    PRESETS,
    PRETRAINED_INITS,
    Config,
    TrainConfig,
    field_type,
)
from model.config import ModelConfig

# One line of help per config field (`train --help`); the preset's value is added to it.
FIELD_HELP = {
    "vocab_size": "tokens in the vocabulary (256 for bytes)",
    "d_model": "width of the residual stream",
    "n_layers": "transformer blocks",
    "n_heads": "query heads per block",
    "n_kv_heads": "key/value heads (grouped-query attention; none: one per query head)",
    "d_ff": "hidden width of the MLP",
    "mlp": "gelu, swiglu (Llama) or geglu (Gemma 3)",
    "tie_embeddings": "the output head is the embedding transposed",
    "max_len": "context length: the sequence length trained on",
    "rope_base": "rotary position embedding base",
    "norm_eps": "epsilon of RMSNorm",
    "param_dtype": "dtype of the working weights (float32, bfloat16)",
    "compute_dtype": "dtype of activations and matmuls (float32, bfloat16)",
    "remat": "recompute activations in the backward pass: none, full, save_dots",
    "attention": "attention kernel: xla, or cudnn (NVIDIA GPU, bfloat16)",
    "scan_unroll": "layers unrolled per step of the layer scan",
    "head_size": "width of one attention head (none: d_model / n_heads)",
    "qkv_bias": "q, k and v projections carry a bias (Qwen2)",
    "qk_norm": "RMSNorm over each query and key head (Qwen3)",
    "sliding_window": "each query sees only this many keys back (none: the whole prefix)",
    "rotary_dim": "RoPE on this many dimensions of each head (none: all of them)",
    "rope_short_factors": "LongRoPE: one divisor per rotary frequency, comma-separated, used "
                          "while max_len <= rope_original_max_len (none: off)",
    "rope_long_factors": "LongRoPE: the divisors used when max_len is longer",
    "rope_attention_factor": "LongRoPE: sin and cos are multiplied by this (0: off)",
    "steps": "optimizer steps (also the length of the cosine schedule)",
    "batch_size": "sequences per optimizer step (global, over all devices)",
    "micro_steps": "gradient accumulation: micro-batches per step",
    "lr": "peak learning rate",
    "warmup_steps": "linear warm-up steps",
    "min_lr_ratio": "the cosine decays to lr * this at the last step",
    "weight_decay": "AdamW weight decay",
    "b1": "Adam beta1",
    "b2": "Adam beta2",
    "clip_norm": "clip the global gradient norm to this",
    "seed": "seed of the initial weights and the data order",
    "eval_every": "evaluate on the validation split every this many steps",
    "eval_batches": "validation batches per evaluation",
    "log_every": "write a metrics row every this many steps",
    "ckpt_every": "checkpoint every this many steps",
    "keep_ckpts": "checkpoints kept",
    "strategy": "data parallel or ZeRO layout: dp, zero1, zero2, zero3, ...",
    "prefetch": "zero3 only: gather layer i+1 while layer i computes",
    "mesh": "device mesh, e.g. data=2,fsdp=4 (none: every device on fsdp)",
    "devices": "fake CPU devices (none: 8 on a CPU-only machine)",
    "data": "text file or folder to train on (none: the corpus)",
    "corpus": "stdlib (the Python sources) or pydoc-topics, when --data is not given",
    "init": "start from pretrained weights (smollm2, gemma3-270m, a .gguf file or a Hugging "
            "Face folder: its architecture and tokenizer) or a finished run's folder (its newest "
            "intact checkpoint, model and tokenizer; a new schedule)",
    "val_percent": "percent of the data held out for validation",
    "on_nonfinite": "a NaN/Inf loss or gradient: stop or skip the step",
}


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")


def _parse_names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _parse_numbers(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in _parse_names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas"
                                         ) from None


def add_field_flags(parser: argparse.ArgumentParser, cls, *, title: str,
                    skip: set[str] = frozenset(), aliases: dict[str, str] | None = None) -> None:
    """One --flag per dataclass field (`--d-model 256`, `--clip-search`, `--rules a,b`), stored
    as `override_<field>` and None when not given (the preset or the class default then
    holds). A field's `help` metadata becomes its help."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = field_type(cls, f)
        names = ["--" + f.name.replace("_", "-")]
        if aliases and f.name in aliases:
            names.append(aliases[f.name])
        extra = {}
        if kind is bool:  # `--flag` alone means true; `--flag false` also works
            extra = dict(type=_parse_bool, nargs="?", const=True)
        else:
            extra = dict(type=kind if typing.get_origin(kind) is not tuple
                         else _parse_numbers if typing.get_args(kind)[0] is float
                         else _parse_names)
        group.add_argument(*names, dest=f"override_{f.name}", default=None,
                           metavar=f.name.upper(), help=_help(cls, f), **extra)


def _shown(value) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def _help(cls, f: dataclasses.Field) -> str:
    """The field's description (its `help` metadata, else FIELD_HELP) and its default: the
    presets' value where `cls` is a preset part, else the class default."""
    text = f.metadata.get("help") or FIELD_HELP.get(f.name, f.name.replace("_", " "))
    part = {ModelConfig: "model", TrainConfig: "train"}.get(cls)
    if part is None:
        if f.default is dataclasses.MISSING or "default" in text:  # none, or said already
            return text.replace("%", "%%")
        return f"{text} (default {_shown(f.default)})".replace("%", "%%")
    values = {name: getattr(getattr(p, part), f.name) for name, p in PRESETS.items()}
    if len(set(map(_shown, values.values()))) == 1:
        default = _shown(next(iter(values.values())))
    else:
        default = ", ".join(f"{name} {_shown(v)}" for name, v in values.items())
    return f"{text} (default {default})".replace("%", "%%")


def field_overrides(args: argparse.Namespace, cls) -> dict:
    """{field: value} of the flags `add_field_flags` made for cls that were given."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k[len("override_"):]: v for k, v in vars(args).items()
            if k.startswith("override_") and v is not None and k[len("override_"):] in names}


def add_override_flags(parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> None:
    """One --flag per model and training config field, defaulting to the preset."""
    for cls in (ModelConfig, TrainConfig):
        add_field_flags(parser, cls, skip=skip,
                        title="config overrides (default: the preset's value)")


def config_from_args(args: argparse.Namespace, base: Config | None = None,
                     default_preset: str | None = None) -> Config:
    """Preset (or `base`: a run's own config, which --resume continues; or, with --init RUN,
    that run's model and training config) + the flags given; raises ConfigError naming the bad
    field. `default_preset` stands in for a --preset not given (None: args.preset)."""
    train = field_overrides(args, TrainConfig)
    init = train.get("init")
    new_run = base is None
    if base is None and init is not None and init not in PRETRAINED_INITS:
        lineage.origin(init)  # one line for a folder that is no run, or a broken chain
        base = lineage.config_from_run(init, args.preset)
        train["init"] = base.train.init
    elif base is None:
        preset = args.preset or default_preset
        if preset not in PRESETS:
            raise ConfigError(f"preset={preset!r}: allowed {', '.join(PRESETS)}")
        base = PRESETS[preset]
    if new_run and train.get("data"):
        train["corpus"] = DATA_CORPUS  # the text read is the path, no named corpus
    cfg = Config(base.preset,
                 dataclasses.replace(base.model, **field_overrides(args, ModelConfig)),
                 dataclasses.replace(base.train, **train))
    cfg.validate()
    if new_run and cfg.train.init is not None and cfg.train.init not in PRETRAINED_INITS:
        lineage.check_same_model(cfg.train.init, cfg)
    return cfg


