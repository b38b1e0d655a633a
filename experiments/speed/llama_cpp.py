"""llama.cpp as a peer of `experiments.bench_decode`: its tools located, its model files
prepared once, `llama-bench` run and its JSON read; and of `experiments.llama_cpp_int8`:
`llama-perplexity` run on a text (perplexity, and KL divergence from a base model's saved
logits) and its report read.

llama.cpp is never a dependency: its tools are built apart (docs/decoding_and_gpu.md) and named
by `--llama-cpp DIR` or $SHARDQ_LLAMA_CPP (a folder holding llama-bench and llama-quantize, or a
build folder with them in bin/). The peer runs our own float32 GGUF export of the benchmarked
model (the weights our float variant runs) and llama.cpp's Q8_0 of that file. This module
imports no JAX: the launcher locates the tools before JAX starts, and the export is a callable
it passes in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from experiments.cli.config import ConfigError

ENV = "SHARDQ_LLAMA_CPP"
TOOLS = ("llama-bench", "llama-quantize")
PERPLEXITY = "llama-perplexity"
PERPLEXITY_TRIES = 4  # runs of llama-perplexity before its report counts as missing
FORMATS = ("F32", "Q8_0")
# What a prepared folder records: a file made for another model, layer count or llama.cpp
# build is made again.
META = "peer.json"
# Fields every llama-bench JSON test holds that this module reads.
BENCH_FIELDS = ("build_commit", "build_number", "n_threads", "n_prompt", "n_gen", "n_depth",
                "avg_ts", "stddev_ts", "samples_ts", "model_size", "model_type")


class PeerError(RuntimeError):
    """A llama.cpp tool failed or printed what this module cannot read (one line)."""


@dataclasses.dataclass(frozen=True)
class Tools:
    bench: Path | None
    quantize: Path
    perplexity: Path | None = None  # found beside the others when built


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _tools_in(folder: Path, need: tuple[str, ...]) -> Tools | None:
    for d in (folder, folder / "bin"):
        if all(_executable(d / t) for t in need):
            found = {t: d / t if _executable(d / t) else None
                     for t in (*TOOLS, PERPLEXITY)}
            return Tools(found["llama-bench"], found["llama-quantize"], found[PERPLEXITY])
    return None


def locate(flag: str | None, environ: Mapping[str, str] = os.environ,
           need: tuple[str, ...] = TOOLS) -> tuple[Tools | None, str]:
    """(the tools, "") from `flag` (else $SHARDQ_LLAMA_CPP), or (None, why the peer rows are
    skipped) when neither names a folder. ConfigError (one line) when the folder named lacks
    the tools `need` names: a peer asked for and absent is bad input, not a silent skip."""
    field, value = ("llama_cpp", flag) if flag else (ENV, environ.get(ENV, ""))
    if not value:
        return None, (f"llama.cpp peer rows skipped: no tools named (give --llama-cpp DIR or set "
                      f"${ENV}; docs/decoding_and_gpu.md says how to build them)")
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{field}={value!r}: no such folder; give the folder holding "
                          f"{' and '.join(need)} (or a llama.cpp build folder with bin/)")
    tools = _tools_in(folder, need)
    if tools is None:
        raise ConfigError(f"{field}={value!r}: holds no executable {' and '.join(need)} (in it "
                          f"or in its bin/); build them: docs/decoding_and_gpu.md")
    return tools, ""


def cores() -> int:
    """The cores this process may run on (its affinity): XLA's CPU threads use them all, so the
    peer gets as many threads."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _run(argv: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as e:
        raise PeerError(f"{what}: cannot run {argv[0]} ({e})") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PeerError(f"{what}: {Path(argv[0]).name} exited {proc.returncode}: {tail}")
    return proc


def parse_bench(text: str) -> list[dict]:
    """The tests of `llama-bench -o json` output: per test its build, threads, shape
    (n_prompt, n_gen, n_depth), tokens/s (avg_ts and each repetition's samples_ts) and the
    model's type and bytes. PeerError when the text is not that."""
    try:
        tests = json.loads(text)
    except ValueError as e:
        raise PeerError(f"llama-bench output is not JSON ({e})") from None
    if not isinstance(tests, list) or not tests:
        raise PeerError("llama-bench output holds no test (expected a non-empty JSON list)")
    rows = []
    for t in tests:
        missing = [f for f in BENCH_FIELDS if not isinstance(t, dict) or f not in t]
        if missing:
            raise PeerError(f"llama-bench output: a test lacks {', '.join(missing)}")
        samples = [float(x) for x in t["samples_ts"]]
        if not samples or min(samples) <= 0:
            raise PeerError("llama-bench output: a test has no positive tokens/s sample")
        rows.append({f: t[f] for f in BENCH_FIELDS} | {"samples_ts": samples})
    return rows


def bench_argv(tools: Tools, model: Path, threads: int, *, n_prompt: int, n_gen: int,
               depth: int, reps: int) -> list[str]:
    """One llama-bench test: `n_prompt` tokens of prefill (pp) or `n_gen` decoded tokens (tg)
    after a `depth`-token context that is not timed."""
    return [str(tools.bench), "-m", str(model), "-t", str(threads), "-p", str(n_prompt),
            "-n", str(n_gen), "-d", str(depth), "-r", str(reps), "-o", "json"]


def bench(tools: Tools, model: Path, threads: int, *, n_prompt: int, n_gen: int, depth: int,
          reps: int) -> dict:
    """One llama-bench test's parsed row."""
    argv = bench_argv(tools, model, threads, n_prompt=n_prompt, n_gen=n_gen, depth=depth,
                      reps=reps)
    return parse_bench(_run(argv, f"llama-bench on {model.name}").stdout)[0]


def version(tools: Tools) -> dict:
    """llama.cpp's build: `llama-bench --version`'s text (it may print to either stream), and
    the source package the tools were built in when a PKG-INFO lies above them: a build from a
    source package without git says build 0 and commit unknown, and the package names it."""
    tool = tools.bench or tools.quantize  # every llama.cpp tool answers --version
    proc = _run([str(tool), "--version"], f"{tool.name} --version")
    out = {"llama_cpp_version": " ".join((proc.stdout + proc.stderr).split())}
    for folder in list(tool.resolve().parents)[:5]:
        info = folder / "PKG-INFO"
        if info.is_file():
            fields = dict(line.split(": ", 1) for line in info.read_text().splitlines()[:20]
                          if line.startswith(("Name: ", "Version: ")))
            out["source_package"] = f"{fields.get('Name', '?')} {fields.get('Version', '?')}"
            break
    return out


def quantize(tools: Tools, src: Path, dst: Path, qtype: str) -> None:
    """llama-quantize's `qtype` of `src`, written beside `dst` and renamed into place."""
    tmp = dst.with_name(dst.name + ".tmp")
    _run([str(tools.quantize), str(src), str(tmp), qtype], "llama-quantize")
    os.replace(tmp, dst)


def prepare(tools: Tools, folder: Path, key: dict, export: Callable[[Path], Path]) -> dict:
    """The peer's files in `folder`, made once per `key` (the model, its layers, the llama.cpp
    build): {"F32": path, "Q8_0": path}. `export(dir)` writes our float32 GGUF of the model
    into `dir` and returns the file's path; llama-quantize then makes the Q8_0 file."""
    folder = Path(folder)
    paths = {f: folder / f"model-{f.lower()}.gguf" for f in FORMATS}
    meta = folder / META
    key = {**key, **version(tools)}
    if (meta.exists() and all(p.exists() for p in paths.values())
            and json.loads(meta.read_text()) == key):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    meta.unlink(missing_ok=True)
    exported = export(folder / "export")
    os.replace(exported, paths["F32"])
    quantize(tools, paths["F32"], paths["Q8_0"], "Q8_0")
    meta.write_text(json.dumps(key, indent=1) + "\n")
    return paths


def peer_row(fmt: str, test: str, path: Path, rounds: list[dict]) -> dict:
    """One peer row from its rounds' llama-bench rows: tokens/s of each round (llama-bench's
    mean) and the median of every repetition, as our variants' median of every timed run."""
    first = rounds[0]
    return {"format": fmt, "test": test, "file": path.name, "file_bytes": path.stat().st_size,
            "n_prompt": first["n_prompt"], "n_gen": first["n_gen"], "depth": first["n_depth"],
            "threads": first["n_threads"],
            "rounds_tokens_per_s": [r["avg_ts"] for r in rounds],
            "samples_ts": [r["samples_ts"] for r in rounds],
            "tokens_per_s": statistics.median(x for r in rounds for x in r["samples_ts"])}


def ratios(ours: dict[str, float], int8: list[str], peer: dict[str, float],
           floats: str = "float") -> list[dict]:
    """Our tokens/s over the peer's: `floats` over F32, the best of `int8` and each of them over
    Q8_0 (`ours` and `peer` map a name or a format to tokens/s; absent names give no row)."""
    pairs = []
    if floats in ours and "F32" in peer:
        pairs.append((floats, "F32", f"our {floats} / llama.cpp F32"))
    present = [n for n in int8 if n in ours]
    if present and "Q8_0" in peer:
        best = max(present, key=lambda n: ours[n])
        pairs.append((best, "Q8_0", f"our best int8 ({best}) / llama.cpp Q8_0"))
        pairs += [(n, "Q8_0", f"our {n} / llama.cpp Q8_0") for n in present]
    return [{"ratio": what, "ours": n, "peer": fmt, "value": ours[n] / peer[fmt]}
            for n, fmt, what in pairs]


# --- llama-perplexity ------------------------------------------------------------------------

# What a `--kl-divergence` run prints (its "Mean PPL(Q)" and the KLD statistics; nats) and what
# a plain run prints last ("Final estimate: PPL = ...").
_NUMBER = r"\s*([0-9.eE+-]+)"
_KL_LINES = {"perplexity": r"Mean PPL\(Q\)\s*:" + _NUMBER + r"\s*±" + _NUMBER,
             "kl_mean": r"Mean\s+KLD:" + _NUMBER, "kl_median": r"Median\s+KLD:" + _NUMBER,
             "kl_p99": r"99\.0%\s+KLD:" + _NUMBER, "kl_max": r"Maximum KLD:" + _NUMBER,
             "top1_agree": r"Same top p:" + _NUMBER}
_FINAL = r"Final estimate: PPL = ([0-9.eE+-]+) \+/- ([0-9.eE+-]+)"


def perplexity_argv(tools: Tools, model: Path, threads: int, base: Path, *, text: Path | None,
                    ctx: int, chunks: int) -> list[str]:
    """llama-perplexity over `chunks` windows of `ctx` tokens: with `text`, on that file,
    saving the model's logits to `base` (the reference); without, the KL divergence of `model`
    from the logits in `base` (the tokens are read from there too)."""
    argv = [str(tools.perplexity), "-m", str(model), "-c", str(ctx), "--chunks", str(chunks),
            "-t", str(threads), "--kl-divergence-base", str(base)]
    return argv + (["-f", str(text)] if text is not None else ["--kl-divergence"])


def parse_perplexity(text: str, kl: bool) -> dict:
    """perplexity (and its ± uncertainty) from llama-perplexity's report; with `kl`, the KL
    divergence from the base too (mean, median, 99th percentile, max, in nats) and the share
    of positions whose most likely token is the base's. PeerError when a figure is missing."""
    out = {}
    patterns = _KL_LINES if kl else {"perplexity": _FINAL}
    for key, pattern in patterns.items():
        m = re.search(pattern, text)
        if m is None:
            raise PeerError(f"llama-perplexity printed no {key} (expected a line matching "
                            f"{pattern!r})")
        out[key] = float(m.group(1))
        if key == "perplexity":
            out["perplexity_uncertainty"] = float(m.group(2))
    if kl:
        out["top1_agree"] /= 100.0  # printed as a percentage
    chunks = re.search(r"over (\d+) chunks, n_ctx=(\d+)", text)
    if chunks is None:
        raise PeerError("llama-perplexity printed no chunk count ('over N chunks, n_ctx=C')")
    out["chunks"], out["ctx"] = int(chunks.group(1)), int(chunks.group(2))
    return out


def perplexity(tools: Tools, model: Path, threads: int, base: Path, *, text: Path | None,
               ctx: int, chunks: int) -> dict:
    """One llama-perplexity run's parsed figures (see `perplexity_argv`, `parse_perplexity`)."""
    if tools.perplexity is None:
        raise PeerError(f"{PERPLEXITY} is not among the tools found")
    argv = perplexity_argv(tools, model, threads, base, text=text, ctx=ctx, chunks=chunks)
    # llama.cpp logs from a thread it does not join at exit, so a run's last lines (the report)
    # are sometimes lost; the computation is deterministic, so a lost report is run again.
    for attempt in range(PERPLEXITY_TRIES):
        proc = _run(argv, f"llama-perplexity on {model.name}")
        try:
            return parse_perplexity(proc.stdout + proc.stderr, kl=text is None)
        except PeerError:
            if attempt + 1 == PERPLEXITY_TRIES:
                raise
    raise AssertionError("unreachable")


def base_tokens(base: Path) -> list[list[int]]:
    """The windows of token ids a `perplexity(..., text=...)` run scored, from the logits file it
    saved: "_logits_", then int32 context, vocabulary size and window count, then every
    window's ids (llama.cpp's tokenization of the text, before it puts BOS first). PeerError
    when the file is not one."""
    raw = Path(base).read_bytes()
    header = 8 + 3 * 4
    if len(raw) < header or raw[:8] != b"_logits_":
        raise PeerError(f"{str(base)!r}: not a llama-perplexity logits file")
    ctx, _, windows = (int.from_bytes(raw[i:i + 4], "little", signed=True)
                       for i in range(8, header, 4))
    if ctx <= 0 or windows <= 0 or len(raw) < header + 4 * ctx * windows:
        raise PeerError(f"{str(base)!r}: header says {windows} windows of {ctx} tokens, the "
                        f"file is shorter")
    ids = [int.from_bytes(raw[i:i + 4], "little", signed=True)
           for i in range(header, header + 4 * ctx * windows, 4)]
    return [ids[w * ctx:(w + 1) * ctx] for w in range(windows)]
