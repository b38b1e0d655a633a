"""Run configuration: typed dataclasses, named presets, command-line overrides.

Importing this module does not import JAX, so launchers can parse arguments and set XLA_FLAGS
(fake CPU devices) before JAX starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from model.config import MODEL_PRESETS, ModelConfig
from parallel.strategies import STRATEGIES


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
    data: str | None = None  # text file or folder; default: the Python standard library sources
    val_percent: int = 5
    on_nonfinite: str = "stop"  # a NaN/Inf loss or gradient: stop the run, or skip that step

    def validate(self) -> None:
        for name in ("steps", "batch_size", "micro_steps", "eval_every", "eval_batches",
                     "log_every", "ckpt_every", "keep_ckpts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be a positive integer")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps}: must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}: must be positive")
        if self.batch_size % self.micro_steps:
            raise ValueError(f"micro_steps={self.micro_steps}: must divide "
                             f"batch_size={self.batch_size}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r}: allowed {', '.join(STRATEGIES)}")
        if self.prefetch and self.strategy != "zero3":
            raise ValueError(f"prefetch=True: only for strategy zero3, not {self.strategy!r}")
        if self.devices is not None and self.devices < 1:
            raise ValueError(f"devices={self.devices}: must be a positive integer")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}: allowed stop, skip")
        if not 0 < self.val_percent < 100:
            raise ValueError(f"val_percent={self.val_percent}: must be in 1..99")


@dataclasses.dataclass(frozen=True)
class Config:
    preset: str
    model: ModelConfig
    train: TrainConfig

    def validate(self) -> None:
        self.model.validate()
        self.train.validate()

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> Config:
        return Config(d["preset"], ModelConfig(**d["model"]), TrainConfig(**d["train"]))


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
}


def _field_type(cls, field: dataclasses.Field):
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) is not tuple else hint


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")


def _parse_names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_field_flags(parser: argparse.ArgumentParser, cls, *, title: str,
                    skip: set[str] = frozenset(), aliases: dict[str, str] | None = None) -> None:
    """One --flag per dataclass field (`--d-model 256`, `--clip-search`, `--rules a,b`), stored
    as `override_<field>` and None when not given (the preset or the class default then
    holds). A field's `help` metadata becomes its help."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = _field_type(cls, f)
        names = ["--" + f.name.replace("_", "-")]
        if aliases and f.name in aliases:
            names.append(aliases[f.name])
        extra = {}
        if kind is bool:  # `--flag` alone means true; `--flag false` also works
            extra = dict(type=_parse_bool, nargs="?", const=True)
        else:
            extra = dict(type=_parse_names if typing.get_origin(kind) is tuple else kind)
        group.add_argument(*names, dest=f"override_{f.name}", default=None,
                           metavar=f.name.upper(), help=f.metadata.get("help"), **extra)


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


def config_from_args(args: argparse.Namespace) -> Config:
    """Preset + overrides; raises ValueError naming the bad field."""
    if args.preset not in PRESETS:
        raise ValueError(f"preset={args.preset!r}: allowed {', '.join(PRESETS)}")
    base = PRESETS[args.preset]
    cfg = Config(base.preset,
                 dataclasses.replace(base.model, **field_overrides(args, ModelConfig)),
                 dataclasses.replace(base.train, **field_overrides(args, TrainConfig)))
    cfg.validate()
    return cfg


class ConfigError(ValueError):
    """Bad input: the launcher prints it on one line (`fail`) and exits with status 2."""


def fail(prog: str, message: str, code: int = 2) -> typing.NoReturn:
    """The one-line error every launcher prints for bad input."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)


def dumps(cfg: Config) -> str:
    return json.dumps(cfg.to_json(), indent=2, sort_keys=True)
