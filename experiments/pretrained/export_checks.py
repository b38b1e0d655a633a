"""The export's output folder, checked without JAX: `experiments.export` refuses a bad --out
before it starts the runtime, and `exporter.export` checks the same way again."""

from __future__ import annotations

import functools
from pathlib import Path

from experiments.cli.config import ConfigError, check_output_folder
from experiments.pretrained import model_ref
from model.gguf_export import check_gguf, gguf_arch
from model.gguf_tokenizer import TokenizerExportError, tokenizer_metadata
from model.hf_decoder import HFError, config_from_hf, read_config
from model.llama_export import ExportError

# The int8 modes whose model a GGUF holds as Q8_0: per-row int8 weights with the smoothing
# folded into float norms and kernels. The others need what llama.cpp's graph has no place for.
Q8_MODES = ("w8", "w8a8", "smoothquant")
_NO_Q8 = {"w8a8-rotated": "its Hadamard rotation of every int8 product's input",
          "w8a8-outlier": "its float product of the outlier columns",
          "auto": "its layers kept in bf16 beside the int8 ones",
          "w8a8-static": "its calibrated activation scales",
          "w8a8-tensor": "its per-tensor activation scale"}


def check_source(model: str | None, layers: int | None, step: int | None = None,
                 workdir: str | None = None, fmt: str = "safetensors") -> None:
    """What can be judged of the export's source before anything is read: a model reference
    (a registered name, a .gguf file, a Hugging Face folder or a run folder), a positive layer
    count (its upper bound needs the model, a Hugging Face folder's config says it), a step
    only for a training run (--workdir RUN or --model RUN), and one of its intact checkpoints;
    a Hugging Face folder to GGUF: an architecture a GGUF holds and a tokenizer it can hold."""
    kind = model_ref.resolve(model).kind if model is not None else "run"
    if step is not None and kind != "run":
        raise ConfigError(f"step={step}: only for a training run (--workdir RUN or --model RUN); "
                          f"model={model!r} has no steps")
    run = model if model is not None else workdir
    if step is not None and run is not None and (Path(run) / "config.json").is_file():
        model_ref.check_step(run, step)
    if layers is not None and layers < 1:
        raise ConfigError(f"layers={layers}: must be a positive integer")
    if kind == "hf":
        _check_hf(Path(model), layers, fmt)


def check_layers(layers: int | None, available: int) -> None:
    """`layers` (None: all) against the model's own count."""
    if layers is not None and not 1 <= layers <= available:
        raise ConfigError(f"layers={layers}: must be in 1..{available} (the model's layers)")


def _check_hf(folder: Path, layers: int | None, fmt: str) -> None:
    where = repr(str(folder / "config.json"))
    try:
        hf = read_config(folder)
        available = config_from_hf(hf, where).n_layers
        check_layers(layers, available)
        if fmt == "gguf":
            cfg = config_from_hf(hf, where, layers)
            check_gguf(cfg)
            folder_tokenizer(folder, cfg)
    except (HFError, ExportError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def folder_tokenizer(folder: Path, cfg) -> dict:
    """The GGUF tokenizer keys of a Hugging Face folder's tokenizer for the model `cfg`
    (ConfigError, one line, where a GGUF cannot hold it); converted once per folder state, so
    the check before JAX and the export share the work."""
    stamp = tuple((folder / name).stat().st_mtime_ns if (folder / name).is_file() else None
                  for name in ("tokenizer.json", "tokenizer_config.json", "config.json",
                               "chat_template.jinja"))
    try:
        return _converted(str(folder), cfg.vocab_size, gguf_arch(cfg) == "gemma3", stamp)
    except (TokenizerExportError, ExportError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


@functools.lru_cache(maxsize=4)
def _converted(folder: str, vocab_size: int, by_position: bool, stamp: tuple) -> dict:
    return tokenizer_metadata(folder, vocab_size, by_position)


def check_quant(quant: str, fmt: str) -> None:
    """An int8 export: a mode whose model Q8_0 can hold, written to GGUF (one line otherwise)."""
    if quant == "none":
        return
    if quant not in Q8_MODES:
        why = f" ({_NO_Q8[quant]} has no place in llama.cpp's graph)" if quant in _NO_Q8 else ""
        raise ConfigError(f"quant={quant!r}: allowed none, {', '.join(Q8_MODES)}{why}")
    if fmt != "gguf":
        raise ConfigError(f"quant={quant!r}: only with --format gguf (Q8_0 tensors); a Hugging "
                          f"Face folder is written in float32")


def check_out(out: str | Path, force: bool) -> Path:
    """`out` as a Path: a folder the export may write (an existing non-empty one only with
    `force`; ConfigError, one line, otherwise)."""
    check_output_folder("out", out, "the export")
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"out={str(out)!r}: exists and is not empty; pass --force to "
                          f"replace it")
    return out
