"""How faithful is the int8 encoder? Every quant mode against the float embeddings.

  python -m experiments.embed_fidelity --json
  python -m experiments.embed_fidelity --sentences 500 --modes w8a8,smoothquant --json

Corpus: English sentences cut from the docstrings of standard-library modules (real prose that
ships with Python; code-like lines are dropped), so the numbers depend on the Python version,
which is reported. Calibration uses a disjoint slice of the same corpus.

Per mode: mean and min cosine to the float embedding of the same sentence; a retrieval task in
which every sentence queries all the others: top1_agreement = share of queries whose nearest
neighbour is the same as with float embeddings, top10_overlap = mean |top10_int8 & top10_float|
/ 10; param_bytes as stored. Also: per-layer activation outliers of the float model (input
channels of each Dense with the largest |x|, their size against the median channel) and
encoding throughput (sentences/s) float vs int8. The last line is
{"results": [{"mode", "mean_cosine", "min_cosine", "top1_agreement", "top10_overlap",
"param_bytes"}, ...], ...}, also written to experiments/results/embed_fidelity.json.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
import re
import time
from pathlib import Path

from experiments import runtime
from experiments.config import fail

PROG = "experiments.embed_fidelity"
RESULTS = Path(__file__).parent / "results" / "embed_fidelity.json"
DEFAULT_MODES = ("w8", "w8a8-tensor", "w8a8", "w8a8-static", "smoothquant", "w8a8-outlier",
                 "auto")
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
    import numpy as np

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
    import numpy as np

    from quant.calibrate import calibrate

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
    from experiments.embed import encode

    encode(encode_fn, params, tokenizer, texts)
    start = time.perf_counter()
    for _ in range(repeats):
        encode(encode_fn, params, tokenizer, texts)
    return repeats * len(texts) / (time.perf_counter() - start)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=500, help="evaluation sentences (>= 11)")
    p.add_argument("--calib", type=int, default=128, help="calibration sentences (disjoint)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated modes")
    p.add_argument("--json", action="store_true", help="print the results as the last line")
    p.add_argument("--out", default=str(RESULTS), help="results file ('' to skip writing)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from experiments.embed import QUANT_MODES

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in QUANT_MODES or m == "none"]
    if bad or not modes:
        fail(PROG, f"modes={args.modes!r}: allowed {', '.join(QUANT_MODES[1:])}")
    if args.sentences < 11 or args.calib < 1:
        fail(PROG, "sentences must be >= 11 (top-10 retrieval) and calib >= 1")
    runtime.start(1)
    import numpy as np

    from experiments.embed import encode, load_encoder, make_encode_fn, quantize_encoder
    from quant.encoder import calibration_rows
    from quant.pipeline import param_bytes

    try:
        texts = stdlib_sentences(args.sentences)
        calib = stdlib_sentences(args.calib, offset=args.sentences)
    except ValueError as e:
        fail(PROG, str(e))
    graphdef, params, tok = load_encoder()
    float_fn = make_encode_fn(graphdef)
    ref = encode(float_fn, params, tok, texts)
    results, speed = [], {"float": throughput(float_fn, params, tok, texts)}
    for mode in modes:
        qdef, qparams, _ = quantize_encoder(graphdef, params, tok, mode, calib)
        qfn = make_encode_fn(qdef)
        emb = encode(qfn, qparams, tok, texts)
        cos = np.sum(emb * ref, axis=1)  # both unit-norm
        top1, top10 = retrieval(ref, emb)
        results.append({"mode": mode, "mean_cosine": float(cos.mean()),
                        "min_cosine": float(cos.min()), "top1_agreement": top1,
                        "top10_overlap": top10, "param_bytes": param_bytes(qparams)})
        if mode == "w8a8":
            speed["w8a8"] = throughput(qfn, qparams, tok, texts)
        print(json.dumps(results[-1]), flush=True)
    out = {"results": results, "float_param_bytes": param_bytes(params),
           "sentences_per_s": speed, "n_sentences": len(texts), "n_calib": len(calib),
           "python": platform.python_version(),
           "outliers": outlier_table(graphdef, params,
                                     calibration_rows(tok.encode(calib)[0], 32)[:2])}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
