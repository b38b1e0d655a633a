"""The export's output folder, checked without JAX: `experiments.export` refuses a bad --out
before it starts the runtime, and `exporter.export` checks the same way again."""

from __future__ import annotations

from pathlib import Path

from experiments.cli.config import ConfigError, check_output_folder
from experiments.pretrained import model_ref

PRETRAINED = ("smollm2",)  # the pretrained models an export can start from


def check_source(model: str | None, layers: int | None) -> None:
    """What can be judged of the export's source before anything is read: a model reference
    an export can start from (a registered name, a .gguf file or a run folder; a Hugging Face
    folder already is an export), a positive layer count (its upper bound needs the model)."""
    if model is not None and model_ref.resolve(model).kind == "hf":
        raise ConfigError(f"model={model!r}: a Hugging Face folder is what an export writes; "
                          f"export from {', '.join(PRETRAINED)}, a .gguf file or a run folder")
    if layers is not None and layers < 1:
        raise ConfigError(f"layers={layers}: must be a positive integer")


def check_out(out: str | Path, force: bool) -> Path:
    """`out` as a Path: a folder the export may write (an existing non-empty one only with
    `force`; ConfigError, one line, otherwise)."""
    check_output_folder("out", out, "the export")
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"out={str(out)!r}: exists and is not empty; pass --force to "
                          f"replace it")
    return out
