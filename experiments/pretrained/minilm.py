"""The pretrained sentence encoder all-MiniLM-L6-v2: conversion to an Orbax checkpoint, loading,
int8 quantisation, batched encoding, and the fidelity measures of experiments.embed_fidelity
(a fixed set of standard-library sentences, retrieval agreement, activation outliers, speed).
Library code of the embed, embed_fidelity and convert_minilm commands and their tests."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from experiments.pretrained.minilm_layout import CKPT, TOKENIZER, check_out, is_converted
from model.bert import BertConfig, BertEncoder, sentence_embeddings
from model.hf_bert import CheckpointError, Tokenizer, load_pretrained, package_model_dir
from parallel.mesh import make_mesh
from parallel.rules import BATCH_AXES
from parallel.state import place_model_params
from parallel.strategies import get_strategy
from quant.calibrate import calibrate
from quant.convert import QuantConfig
from quant.encoder import calibration_rows, quantize

FORMAT = "shardq-bert/1"


def save(out: str | Path, cfg, params: dict, tokenizer: Path, source: Path) -> Path:
    check_out(out)
    out = Path(out).absolute()
    stage = out.with_name(out.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            ckptr.save(stage / CKPT, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                meta=ocp.args.JsonSave({"format": FORMAT, "config": cfg.to_json(),
                                        "source": str(source),
                                        "source_bytes": source.stat().st_size})))
        shutil.copyfile(tokenizer, stage / TOKENIZER)
        shutil.rmtree(out, ignore_errors=True)
        stage.rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def load(path: str | Path):
    """(BertConfig, params, tokenizer.json path) of a converted checkpoint."""

    path = Path(path).absolute()
    if not is_converted(path):
        raise CheckpointError(f"{str(path)!r}: holds no converted encoder; run "
                              f"experiments.convert_minilm --out DIR")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        meta = ckptr.restore(path / CKPT,
                             args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{str(path)!r}: format {meta.get('format')!r}, expected "
                                  f"{FORMAT!r}")
        cfg = BertConfig(**meta["config"])
        abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
            lambda: BertEncoder(cfg, rngs=nnx.Rngs(0)))))
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract)
        params = ckptr.restore(path / CKPT, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target)))["params"]
    return cfg, params, path / TOKENIZER


def convert(out: str | Path, model_dir: str | Path | None = None) -> Path:
    model_dir = Path(model_dir) if model_dir else package_model_dir()
    cfg, params = load_pretrained(model_dir)  # raises before anything is written
    return save(out, cfg, params, model_dir / "tokenizer.json", model_dir / "model.safetensors")


STDLIB_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions",
    "functools", "heapq", "http.client", "http.server", "importlib", "inspect", "ipaddress",
    "itertools", "json", "logging", "mailbox", "multiprocessing", "os", "pathlib", "pickle",
    "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest",
    "urllib.request", "uuid", "xml.etree.ElementTree", "zipfile", "smtplib", "ftplib",
    "calendar", "locale", "gettext", "codecs", "io", "selectors", "doctest", "pdb", "trace",
    "weakref", "copy", "pprint", "reprlib", "graphlib", "sched", "optparse", "configparser",
    "netrc", "plistlib", "hashlib", "hmac", "secrets", "base64", "quopri", "html.parser",
    "wave", "colorsys", "imaplib", "poplib", "xmlrpc.client", "socketserver", "cmd", "shlex",
    "bdb", "timeit", "pstats", "gzip", "bz2", "lzma", "glob", "fnmatch", "filecmp", "tokenize",
    "ast", "pkgutil", "runpy", "types", "abc", "numbers", "bisect", "platform", "warnings",
    "traceback", "site")


_CODE = re.compile(r"[<>=(){}\[\]_`|\\#@*]|\.\.\.|::|->|\b(def|self|None|True|False)\b")


def _docstrings(module_name: str):
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # a stripped-down Python may lack a module: skip it
        return
    yield inspect.getdoc(module) or ""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", module_name) != module_name:
            continue
        yield inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for _, member in sorted(vars(obj).items()):
                if inspect.isfunction(member):
                    yield inspect.getdoc(member) or ""


def stdlib_sentences(n: int, offset: int = 0) -> list[str]:
    """n distinct prose sentences (6..40 words, no code) from stdlib docstrings, in a fixed
    order; `offset` skips that many first (calibration takes a disjoint slice)."""
    seen, out = set(), []
    for module_name in STDLIB_MODULES:
        for doc in _docstrings(module_name):
            text = re.sub(r"\s+", " ", doc)
            for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
                words = s.split()
                if not (6 <= len(words) <= 40) or not s[0].isupper() or not s.endswith("."):
                    continue
                if _CODE.search(s) or sum(c.isalpha() for c in s) < 0.75 * len(s):
                    continue
                if s not in seen:
                    seen.add(s)
                    out.append(s)
    if len(out) < n + offset:
        raise ValueError(f"stdlib docstrings give {len(out)} sentences; asked for {n + offset}")
    return out[offset:offset + n]


def retrieval(ref, emb, k: int = 10) -> tuple[float, float]:
    """(top-1 agreement, top-k overlap): every sentence queries all the others."""

    def ranks(e):
        sims = e @ e.T
        np.fill_diagonal(sims, -np.inf)
        return np.argsort(-sims, axis=1, kind="stable")[:, :k]

    r, q = ranks(ref), ranks(emb)
    top1 = float(np.mean(r[:, 0] == q[:, 0]))
    overlap = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(r, q, strict=True)]))
    return top1, overlap


def outlier_table(graphdef, params, batches, top: int = 3) -> list[dict]:
    """Per Dense input and layer: the largest channels by |x| and their size vs the median."""

    stats = calibrate(graphdef, params, batches)
    rows = []
    for path, amax in sorted(stats["absmax"].items()):
        for layer, a in enumerate(np.atleast_2d(amax)):
            idx = np.argsort(-a, kind="stable")[:top]
            med = float(np.median(a))
            rows.append({"input_of": path, "layer": layer, "median_absmax": med,
                         "top_channels": [int(i) for i in idx],
                         "top_absmax": [float(a[i]) for i in idx],
                         "top_over_median": float(a[idx[0]] / max(med, 1e-12)),
                         "outlier_col_fraction": float(np.atleast_1d(
                             stats["outlier_cols"][path])[layer])})
    return rows


def throughput(encode_fn, params, tokenizer, texts, repeats: int = 2) -> float:
    """Sentences per second, after one warm-up pass (compilation excluded)."""

    encode(encode_fn, params, tokenizer, texts)
    start = time.perf_counter()
    for _ in range(repeats):
        encode(encode_fn, params, tokenizer, texts)
    return repeats * len(texts) / (time.perf_counter() - start)


BATCH = 64


def load_encoder(checkpoint: str | None = None):
    """(graphdef, float params, Tokenizer) from a converted checkpoint or the package."""

    if checkpoint:
        cfg, params, tok_path = load(checkpoint)
    else:
        cfg, params = load_pretrained()
        tok_path = package_model_dir() / "tokenizer.json"
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: BertEncoder(cfg, rngs=nnx.Rngs(0))))
    return graphdef, params, Tokenizer(tok_path, pad_id=cfg.pad_id)


def quantize_encoder(graphdef, params, tokenizer, mode: str, calib_texts: list[str] | None = None,
                     error_report: bool = False):
    """(graphdef, params, report) of the int8 encoder. Modes that calibrate (static, smoothquant,
    auto) read `calib_texts` (default: stdlib sentences); the others need no texts unless
    error_report asks for quant.pipeline's per-layer error rows (eager passes: slow)."""

    qcfg = QuantConfig(mode=mode)

    def batches():  # built only if a pass of quant.pipeline reads them
        tokens, _ = tokenizer.encode(calib_texts if calib_texts is not None
                                     else stdlib_sentences(64, offset=1000))
        return calibration_rows(tokens, 16)[:qcfg.calib_batches]

    qdef, qparams, _plan, report = quantize(graphdef, params, qcfg, batches, error_report)
    return qdef, qparams, report


@functools.cache
def make_encode_fn(graphdef):
    """jitted (params, tokens, mask) -> unit-norm embeddings [B, D] float32; one per graphdef
    (cached, so encoding with the same model again reuses its compiled shapes)."""

    return jax.jit(lambda p, t, m: sentence_embeddings(nnx.merge(graphdef, p), t, m))


# Padded lengths: every multiple of 8 up to 128 (where sentences live), then steps of 16, 32 and
# 64. Rounding a batch's longest text up wastes at most 7 positions below 128 and an eighth above,
# for at most len(BUCKETS) compiled lengths (times the row counts of `batch_rows`). Sparser
# lengths would compile fewer programs but pad more positions: a compile is paid once, padding
# on every pass (bench_encoder's ablation compares the two; docs/inference_speed.md).
BUCKETS = (tuple(range(8, 129, 8)) + tuple(range(144, 257, 16)) + tuple(range(288, 385, 32))
           + tuple(range(448, 513, 64)))


def bucket_length(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    return next((b for b in buckets if b >= n), buckets[-1])


def batch_rows(n: int, batch: int, multiple: int = 1) -> int:
    """Rows a batch of n texts is padded to: the next power of two up to `batch`, rounded up to
    a multiple of `multiple` (the devices a batch is split over): few shapes, little waste."""
    rows = min(1 << max(n - 1, 0).bit_length(), batch)
    return -(-max(rows, n) // multiple) * multiple


def plan_batches(lengths: list[int], batch: int, buckets: tuple[int, ...] = BUCKETS
                 ) -> list[tuple[list[int], int]]:
    """[(text indices, padded length)]: texts sorted by length (longest first), cut into
    batches, each padded to the bucket of its longest text."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [(idx, bucket_length(lengths[idx[0]], buckets))
            for idx in (order[s:s + batch] for s in range(0, len(order), batch))]


def batch_sharding(mesh) -> jax.sharding.NamedSharding:
    """Token batches split over every device of the mesh (data parallel)."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_AXES))


def encode(encode_fn, params, tokenizer, texts: list[str], batch: int = BATCH, mesh=None,
           buckets: tuple[int, ...] = BUCKETS):
    """Unit-norm embeddings [len(texts), D] float32, in the order of `texts`.

    Texts are grouped by length into padded buckets (`plan_batches`); every batch is dispatched
    before any result is read, so the host pads the next batch while the device computes and
    there is one wait at the end. With `mesh`, each batch is split over its devices (data
    parallel; without it a mesh-replicated model would compute every batch on every device)."""
    ids = tokenizer.ids(texts)
    multiple, sharding = 1, None
    if mesh is not None:
        multiple, sharding = mesh.size, batch_sharding(mesh)
    pending = []
    for idx, length in plan_batches([len(r) for r in ids], batch, buckets):
        tokens, mask = tokenizer.pad([ids[i] for i in idx], length,
                                     batch_rows(len(idx), batch, multiple))
        if sharding is not None:
            tokens, mask = jax.device_put((tokens, mask), sharding)
        pending.append((idx, encode_fn(params, tokens, mask)))
    out = None
    for idx, emb in pending:
        emb = np.asarray(emb, np.float32)
        if out is None:
            out = np.empty((len(texts), emb.shape[1]), np.float32)
        out[idx] = emb[:len(idx)]
    return out


def place(params, graphdef, devices: int | None, strategy: str):
    """(params on a mesh of `devices` devices, the mesh): sharded by their logical axes where
    the strategy shards parameters (zero3), replicated otherwise (dp)."""
    mesh = make_mesh(devices)
    return place_model_params(graphdef, params, mesh, get_strategy(strategy)), mesh
