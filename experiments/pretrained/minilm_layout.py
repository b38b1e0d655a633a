"""The folder convert_minilm writes (no JAX here: launchers check their output folder before
JAX starts).

  OUT/ckpt/            Orbax checkpoint: the encoder's params and its meta (format, config)
  OUT/tokenizer.json   the tokenizer, copied so the checkpoint is self-contained
"""

from __future__ import annotations

from pathlib import Path

from experiments.cli.config import check_replaceable_folder

CKPT = "ckpt"
TOKENIZER = "tokenizer.json"


def is_converted(path: str | Path) -> bool:
    """Whether `path` holds a conversion (the only non-empty folder a conversion replaces)."""
    return (Path(path) / CKPT).is_dir() and (Path(path) / TOKENIZER).is_file()


def check_out(out: str | Path, field: str = "out") -> None:
    """ConfigError, one line naming `field` (the flag), unless `out` is missing, empty or an
    earlier conversion."""
    check_replaceable_folder(field, out, "a converted encoder", is_converted)
