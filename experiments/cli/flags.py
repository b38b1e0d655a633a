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
from experiments.training.config import PRESETS, Config, TrainConfig, field_type
from model.config import ModelConfig


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
        kind = field_type(cls, f)
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


def config_from_args(args: argparse.Namespace, base: Config | None = None) -> Config:
    """Preset (or `base`: a run's own config, which --resume continues) + the flags given;
    raises ConfigError naming the bad field."""
    if base is None:
        if args.preset not in PRESETS:
            raise ConfigError(f"preset={args.preset!r}: allowed {', '.join(PRESETS)}")
        base = PRESETS[args.preset]
    cfg = Config(base.preset,
                 dataclasses.replace(base.model, **field_overrides(args, ModelConfig)),
                 dataclasses.replace(base.train, **field_overrides(args, TrainConfig)))
    cfg.validate()
    return cfg


