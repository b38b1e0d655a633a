"""Export a model to a Hugging Face folder (safetensors, the config of its family: llama,
mistral, qwen2, qwen3, gemma3_text or phi3) or to a GGUF file (llama, qwen2, qwen3 or gemma3).

Two sources: a training run's newest intact checkpoint (`run_source`), or a pretrained model as
it ships (`pretrained_source`: a registered name, a .gguf file or a Hugging Face folder, whose
safetensors are read one parameter at a time). A run is read one parameter leaf at a time: each
leaf is restored alone from the Orbax checkpoint (a partial restore onto the host's first CPU
device), written layer by layer, and dropped before the next, so the host never holds the whole
model; of a mixed-precision run the fp32 master weights are exported, not the bf16 working copy.

The tokenizer: a run started from a pretrained model (`train.init`, followed through runs to
the root of the chain) has that model's: a registered model's or a .gguf file's, from its GGUF,
or a Hugging Face folder's tokenizer files, copied as they are. A run from random weights is a
byte model, whose ids are the UTF-8 bytes of the text, exported as a byte-level tokenizer.json
with no merges (id = byte value). GGUF export needs tokenizer metadata: a GGUF's, or a Hugging
Face folder's byte-level BPE converted by model/gguf_tokenizer.py when the folder itself is
exported (llama.cpp has no byte vocabulary without merges; a run from a folder keeps the
folder's files for safetensors only).

`export` writes everything into DIR.tmp-XXXX beside DIR and renames it into place at the end:
an interrupted export leaves no half-written DIR.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from experiments.cli.config import ConfigError
from experiments.pretrained import model_ref, registered
from experiments.pretrained.export_checks import (
    check_layers,
    check_out,
    check_quant,
    folder_tokenizer,
)
from experiments.training import checkpoint as ckpt
from experiments.training import integrity, lineage
from experiments.training.config import load_config
from model.config import ModelConfig
from model.gguf import GGUFFile
from model.gguf_export import check_gguf, write_gguf
from model.hf_decoder import HFError, config_from_hf, expected_shapes, iter_params, read_config
from model.hf_export import (
    byte_tokenizer,
    generation_config,
    hf_config,
    tokenizer_config,
    with_bos_first,
    write_safetensors,
)
from model.hf_tokenizer import HFTokenizer
from model.llama_export import FORMATS, GGUF_FILE, SAFETENSORS_FILE, ExportError, family
from model.llama_gguf import config_from_gguf, load_gguf
from parallel.state import abstract_model, is_mixed

PROVENANCE_FILE = "shardq_export.json"
# What a run from a Hugging Face folder takes from there into its export.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass
class Source:
    """What an export reads: the (possibly truncated) config, one leaf at a time, and the
    pretrained file its tokenizer comes from (None: a byte model)."""
    label: str
    cfg: ModelConfig
    read: Callable[[str], np.ndarray]  # NNX path -> float32 leaf (blocks: first n_layers)
    gguf: GGUFFile | None
    step: int | None = None
    q8: frozenset[str] = frozenset()  # leaves `read` gives as Int8Rows (GGUF Q8_0)
    quant: str = "none"  # the int8 mode (experiments/pretrained/export_q8.py)
    quant_info: dict | None = None
    registered: str | None = None  # the registered model `gguf` belongs to (its tokenizer cache)
    hf_folder: Path | None = None  # a Hugging Face folder, or a run from one: its tokenizer

    def tokenizer(self):
        """The tokenizer of the model (None: a byte model)."""
        if self.gguf is not None:
            return registered.gguf_tokenizer(self.gguf, self.registered)
        if self.hf_folder is not None:
            return HFTokenizer(self.hf_folder)
        return None


def _lookup(tree: dict, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


def hf_reader(folder: Path, cfg: ModelConfig) -> Callable[[str], np.ndarray]:
    """`read(path)` over a Hugging Face folder's safetensors: `iter_params` walks the leaves
    in `expected_shapes` order, the order the writers ask for them, so each leaf is read once
    and dropped before the next; a leaf asked for out of order restarts the walk."""
    walk: list = [None]

    def read(path: str) -> np.ndarray:
        try:
            for _ in range(2):
                if walk[0] is None:
                    walk[0] = iter_params(folder, cfg)
                for found, array in walk[0]:
                    if found == path:
                        return array
                walk[0] = None
        except HFError as e:
            raise ConfigError(str(e)) from None
        raise ConfigError(f"{path}: no such parameter in {str(folder)!r}")

    return read


def hf_source(folder: str | Path, layers: int | None = None) -> Source:
    """A Hugging Face folder as it is, read one parameter at a time."""
    folder = Path(folder)
    where = repr(str(folder / "config.json"))
    try:
        hf = read_config(folder)
        check_layers(layers, config_from_hf(hf, where).n_layers)
        cfg = config_from_hf(hf, where, layers)
    except HFError as e:
        raise ConfigError(str(e)) from None
    return Source(str(folder), cfg, hf_reader(folder, cfg), None, hf_folder=folder)


def pretrained_source(name: str, layers: int | None = None,
                      step: int | None = None) -> Source:
    """A model reference's float32 weights: a registered model or a .gguf file as it is (the
    whole model is dequantised in memory: it is the GGUF file itself that is the streaming
    source here), a Hugging Face folder (`hf_source`), or a run folder's newest intact
    checkpoint (or `step`: `run_source`)."""
    ref = model_ref.resolve(name)
    if ref.kind == "run":
        return run_source(name, layers, step)
    if step is not None:
        raise ConfigError(f"step={step}: only for a training run (model={name!r} has no steps)")
    if ref.kind == "hf":
        return hf_source(ref.ref, layers)
    path = Path(ref.ref) if ref.kind == "gguf" else registered.gguf_path(name)
    check_layers(layers, config_from_gguf(GGUFFile(path)).n_layers)
    cfg, params, g = load_gguf(path, n_layers=layers)
    label = f"{name} ({path.name})" if ref.kind == "name" else ref.ref
    return Source(label, cfg, lambda p: np.asarray(_lookup(params, p), np.float32), g,
                  registered=name if ref.kind == "name" else None)


def _origin(init: str | None) -> dict:
    """Where a run's tokenizer comes from, by the pretrained model at the root of its chain:
    a registered model's or a .gguf file's GGUF, a Hugging Face folder, or nothing (bytes)."""
    origin = lineage.origin(init).pretrained
    if origin is None:
        return {}
    kind = model_ref.resolve(origin, "init").kind
    if kind == "hf":
        return {"hf_folder": Path(origin)}
    if kind == "gguf":
        return {"gguf": GGUFFile(origin)}
    return {"gguf": GGUFFile(registered.gguf_path(origin)), "registered": origin}


def _intact_step(workdir: Path, steps: list[int], step: int | None) -> int:
    if not steps:
        raise ConfigError(f"workdir={str(workdir)!r}: holds no checkpoint")
    if step is not None and step not in steps:
        raise ConfigError(f"step={step}: no such checkpoint; available: {sorted(steps)}")
    reasons = []
    for candidate in [step] if step is not None else sorted(steps, reverse=True):
        reason = integrity.problem(workdir, candidate)
        if reason is None:
            return candidate
        integrity.warn(f"skipping checkpoint {candidate}: {reason}")
        reasons.append(f"{candidate}: {reason}")
    raise ConfigError(f"workdir={str(workdir)!r}: no intact checkpoint ({'; '.join(reasons)})")


def run_source(workdir: str | Path, layers: int | None = None,
               step: int | None = None) -> Source:
    """A training run's newest intact checkpoint (or `step`), read one leaf at a time."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise ConfigError(f"workdir={str(workdir)!r}: no such folder")
    run = load_config(workdir)
    try:
        family(run.model)
    except ExportError as e:
        raise ConfigError(str(e)) from None
    check_layers(layers, run.model.n_layers)
    # set by runs that fine-tune a pretrained model, or a run that did (followed to its root)
    origin = _origin(getattr(run.train, "init", None))
    mngr = ckpt.manager(workdir, read_only=True)
    found = _intact_step(workdir, list(mngr.all_steps()), step)
    _, _, abstract = abstract_model(run.model)
    # Mixed precision keeps fp32 master weights beside the bf16 working copy: the master is the
    # model the optimizer trained.
    root = ("opt", "master") if is_mixed(run.model) else ("params",)
    n = layers or run.model.n_layers

    def read(path: str) -> np.ndarray:
        # Restored as a numpy array (no device buffer beside Orbax's read buffer), cast to
        # float32 on the way.
        item: dict = jax.ShapeDtypeStruct(_lookup(abstract, path).shape, np.float32)
        args: dict = ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float32)
        for key in reversed(root + tuple(path.split("/"))):
            item, args = {key: item}, {key: args}
        try:
            out = mngr.restore(found, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=item, restore_args=args, partial_restore=True)))["state"]
        except Exception as e:  # noqa: BLE001 - any failure to read is a damaged checkpoint
            raise ConfigError(f"checkpoint {found}: {'/'.join(root)}/{path} does not restore "
                              f"({type(e).__name__}: {str(e)[:120]})") from None
        array = _lookup(out, "/".join(root + (path,)))
        return array[:n] if path.startswith("blocks/") else array

    cfg = dataclasses.replace(run.model, n_layers=n)
    return Source(f"run {str(workdir)!r} step {found}", cfg, read, origin.get("gguf"), found,
                  registered=origin.get("registered"), hf_folder=origin.get("hf_folder"))


def check_format(fmt: str, source: Source) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt!r}: allowed {', '.join(FORMATS)}")
    check_quant(source.quant, fmt)
    if fmt == "gguf" and source.gguf is None and source.hf_folder is None:
        raise ConfigError("format='gguf': needs a pretrained model's tokenizer (a run started "
                          "from smollm2, gemma3-270m, a .gguf file or a Hugging Face folder, or "
                          "--model); this run is a byte model (use --format safetensors)")
    if fmt == "gguf":
        gguf_metadata(source)  # a folder's tokenizer a GGUF cannot hold: refused before the work


def _tokenizer_files(folder: Path, source: Source) -> dict:
    """tokenizer.json + tokenizer_config.json; the ids they give and what they hold."""
    g = source.gguf
    if source.hf_folder is not None:  # the folder's own files, as they are
        hf = read_config(source.hf_folder)
        for name in HF_TOKENIZER_FILES:
            if (source.hf_folder / name).is_file():
                shutil.copyfile(source.hf_folder / name, folder / name)
        return {"tokenizer": "hf", "bos_id": hf.get("bos_token_id"),
                "eos_id": hf.get("eos_token_id"), "pad_id": hf.get("pad_token_id")}
    if g is None:
        tok, kind, special = byte_tokenizer(), "bytes", {}
        add_bos, template, max_len = False, None, source.cfg.max_len
    else:
        bpe = source.tokenizer()
        tok, kind = bpe.tok, _tokenizer_kind(g.get_str("tokenizer.ggml.model"))
        ids = {k: g.get_int(f"tokenizer.ggml.{k}_token_id") for k in
               ("bos", "eos", "padding", "unknown") if f"tokenizer.ggml.{k}_token_id" in g.metadata}
        special = {"bos_id": ids.get("bos"), "eos_id": ids.get("eos"),
                   "pad_id": ids.get("padding"), "unk_id": ids.get("unknown")}
        add_bos = bool(bpe.bos)
        template = (g.get_str("tokenizer.chat_template")
                    if "tokenizer.chat_template" in g.metadata else None)
        max_len = _file_context(g)
    if add_bos:
        tok = with_bos_first(tok, special["bos_id"])
    tok.save(str(folder / "tokenizer.json"))
    cfg = tokenizer_config(tok, bos_id=special.get("bos_id"), eos_id=special.get("eos_id"),
                           pad_id=special.get("pad_id"), unk_id=special.get("unk_id"),
                           max_len=max_len, add_bos=add_bos, chat_template=template)
    _write_json(folder / "tokenizer_config.json", cfg)
    return {"tokenizer": kind, **special}


def _tokenizer_kind(model: str) -> str:
    """The summary's name of a GGUF's `tokenizer.ggml.model`."""
    return {"gpt2": "bpe", "llama": "sentencepiece"}.get(model, model)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _context_length(source: Source) -> int:
    """The positions the model handles: the pretrained file's context (fine-tuning on a shorter
    one does not shorten it: rotary has no learned positions), else the run's max_len."""
    if source.gguf is not None:
        return max(source.cfg.max_len, _file_context(source.gguf))
    if source.hf_folder is not None:
        return max(source.cfg.max_len, int(read_config(source.hf_folder).get(
            "max_position_embeddings", source.cfg.max_len)))
    return source.cfg.max_len


def _file_context(g: GGUFFile) -> int:
    return g.get_int(f"{g.get_str('general.architecture')}.context_length")


def gguf_metadata(source: Source) -> dict:
    """The GGUF keys the written file copies (the tokenizer's): the source GGUF's, or the
    Hugging Face folder's tokenizer converted (ConfigError, one line, when it cannot be)."""
    if source.gguf is not None:
        return source.gguf.metadata
    return folder_tokenizer(source.hf_folder, source.cfg)


def _write(folder: Path, source: Source, fmt: str) -> dict:
    cfg = source.cfg
    ctx = _context_length(source)
    if fmt == "safetensors":
        tok = _tokenizer_files(folder, source)
        config = hf_config(cfg, max_positions=ctx, bos_id=tok.get("bos_id"),
                           eos_id=tok.get("eos_id"))  # checked before the tensors are written
        written = write_safetensors(folder / SAFETENSORS_FILE, cfg, source.read)
        _write_json(folder / "config.json", config)
        _write_json(folder / "generation_config.json",
                    generation_config(tok.get("bos_id"), tok.get("eos_id")))
        written["tokenizer"] = tok["tokenizer"]
        written["model_type"] = config["model_type"]
    else:
        meta = gguf_metadata(source)
        written = write_gguf(folder / GGUF_FILE, cfg, source.read, context_length=ctx,
                             metadata=meta, q8=source.q8)
        written["tokenizer"] = _tokenizer_kind(meta["tokenizer.ggml.model"][1])
    return written


def export(source: Source, fmt: str, out: str | Path, force: bool = False) -> dict:
    """Write the export folder atomically; returns a summary (tensors, bytes, host peak)."""
    check_format(fmt, source)
    out = check_out(out, force)
    try:
        family(source.cfg)
        if fmt == "gguf":
            check_gguf(source.cfg)
    except ExportError as e:
        raise ConfigError(str(e)) from None
    rss_before = _peak_rss()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0o22)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's private 0700 is not what a model folder wants
    old = None
    try:
        try:
            written = _write(tmp, source, fmt)
        except ExportError as e:
            raise ConfigError(str(e)) from None
        summary = {"out": str(out), "format": fmt, "source": source.label, "step": source.step,
                   "layers": source.cfg.n_layers, "quant": source.quant,
                   **({"int8": source.quant_info} if source.quant_info else {}), **written,
                   "model_bytes_float32": model_bytes(source.cfg),
                   "largest_tensor_bytes": largest_leaf_bytes(source.cfg),
                   "peak_rss_before_bytes": rss_before, "peak_rss_bytes": _peak_rss()}
        _write_json(tmp / PROVENANCE_FILE, {k: summary[k] for k in
                                            ("format", "source", "step", "layers", "quant",
                                             "tokenizer")})
        if out.exists():  # --force: move the old folder aside, swap the new one in
            old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
        try:
            os.replace(tmp, out)
        except OSError:
            if old is not None:  # put the old folder back: a failed export changes nothing
                os.replace(old / out.name, out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not (old / out.name).exists():
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return summary


def _leaf_bytes(cfg: ModelConfig) -> list[int]:
    """Bytes of each float32 parameter leaf (a block leaf stacks all layers)."""
    return [4 * int(np.prod(s)) * (cfg.n_layers if p.startswith("blocks/") else 1)
            for p, s in expected_shapes(cfg).items()]


def model_bytes(cfg: ModelConfig) -> int:
    return sum(_leaf_bytes(cfg))


def largest_leaf_bytes(cfg: ModelConfig) -> int:
    """The most a leaf-by-leaf export holds of the model at once (plus its transposed copy)."""
    return max(_leaf_bytes(cfg))


def _peak_rss() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
