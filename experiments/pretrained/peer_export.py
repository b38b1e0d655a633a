"""The llama.cpp peer's files of a benchmarked model: our float32 GGUF export of it and
llama-quantize's Q8_0 of that, made once per model, layers and llama.cpp build; or none, with
the line saying why, for a model that has no GGUF export (a byte model, or a tokenizer a GGUF
cannot hold), so the benchmark runs on without its peer rows."""

from __future__ import annotations

import re
from pathlib import Path

from experiments.cli.config import ConfigError
from experiments.pretrained import exporter
from experiments.speed import llama_cpp


def peer_files(tools: llama_cpp.Tools, peer_dir: str | Path, model: str, label: str,
               n_layers: int, layers: int | None = None,
               step: int | None = None) -> tuple[dict, str]:
    """({"F32": path, "Q8_0": path}, "") or ({}, the skipped line); `label` and `n_layers`
    are the loaded model's (its name, its blocks as benchmarked)."""
    src = Path(model)
    key = {"model": model, "label": label, "layers": n_layers,
           "source_mtime_ns": src.stat().st_mtime_ns if src.exists() else None,
           **({"step": step} if step is not None else {})}
    tail = "" if step is None else f"-step{step}"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{src.name}{tail}-{n_layers}L")

    def export(out: Path) -> Path:
        exporter.export(exporter.pretrained_source(model, layers, step), "gguf", out,
                        force=True)
        return out / "model.gguf"
    try:
        return llama_cpp.prepare(tools, Path(peer_dir) / slug, key, export), ""
    except ConfigError as e:
        return {}, f"llama.cpp peer rows skipped: the model has no GGUF export ({e})"
