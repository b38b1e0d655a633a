"""Our int8 models as llama.cpp runs them (the library of `experiments.llama_cpp_int8`).

Every file is measured by llama.cpp's own `llama-perplexity` on one text: our float32 GGUF export
first (its logits are saved and are the reference), then llama.cpp's own Q8_0 of that file
(`llama-quantize`: a scale per block of 32 weights) and our int8 models exported as Q8_0 (a
scale per row, experiments/pretrained/export_q8.py), each with its perplexity and its KL
divergence from the float32 export's next-token distributions. The perplexities and KL
divergences are llama.cpp's arithmetic throughout, so the rows differ only in the weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from experiments.pretrained import eval_text, export_q8, exporter
from experiments.speed import llama_cpp
from model.llama_export import GGUF_FILE

CORPUS = "pydoc"  # the validation topics the perplexity launcher reads by default


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _row(name: str, made_by: str, path: Path, figures: dict) -> dict:
    return {"name": name, "made_by": made_by, "file": path.name,
            "file_bytes": path.stat().st_size, "sha256": _sha256(path), **figures}


def measure(tools: llama_cpp.Tools, model: str, modes: tuple[str, ...], work: Path, *,
            layers: int | None, ctx: int, chunks: int, threads: int,
            say=print) -> dict:
    """The rows (float32 export, llama.cpp's Q8_0, ours per mode) measured in `work`."""
    source = exporter.pretrained_source(model, layers)
    text = work / "text.txt"
    text.write_text(eval_text.text(CORPUS))
    base = work / "f32.kld"
    kw = dict(ctx=ctx, chunks=chunks)

    def gguf(src, name: str) -> Path:
        exporter.export(src, "gguf", work / name, force=True)
        return work / name / GGUF_FILE

    say("exporting float32 and measuring it (the reference logits)")
    f32 = gguf(source, "f32")
    rows = [_row("float32", "ours (export)", f32,
                 llama_cpp.perplexity(tools, f32, threads, base, text=text, **kw))]
    theirs = work / "llama-q8_0.gguf"
    llama_cpp.quantize(tools, f32, theirs, "Q8_0")
    say("llama.cpp's Q8_0")
    rows.append(_row("Q8_0", "llama-quantize", theirs,
                     llama_cpp.perplexity(tools, theirs, threads, base, text=None, **kw)))
    int8 = {}
    for mode in modes:
        say(f"our {mode} as Q8_0")
        q = export_q8.quantized_source(source, mode)
        path = gguf(q, mode)
        int8[mode] = q.quant_info
        rows.append(_row(f"Q8_0 ({mode})", f"ours ({mode})", path,
                         llama_cpp.perplexity(tools, path, threads, base, text=None, **kw)))
        del q
    return {"model": model, "label": source.label, "layers": source.cfg.n_layers,
            "corpus": CORPUS, "text_chars": len(text.read_text()), "ctx": ctx,
            "chunks_asked": chunks, "threads": threads, **llama_cpp.version(tools),
            "rows": rows, "int8": int8}
