"""Batch-1 greedy decoding speed of SmolLM2-135M-Instruct: float, int8 weights, int8 KV cache.

  python -m experiments.bench_decode --json       # writes experiments/results/bench_decode.json
  python -m experiments.bench_decode --variants float,w8 --new-tokens 32 --repeats 3

Each variant decodes `--new-tokens` tokens after the same prompt (the first 400 characters of the
validation topics, cut to fit a shorter context): one jitted `lax.scan` over the tokens, the
prefill excluded, timed `--repeats` times with the variants interleaved; the median is reported
with the per-token latency and the bytes of weights every token reads. Besides the main variants
(float, w8, w8a8, float + int8 cache, w8 + int8 cache, and w8a8-rotated, which pays for its input
rotations at every step, each in the layer layout `model.generate` picks by default and with
quant's default rules: the embedding table and tied head in int8 blocks of 32) the layer scan of
float, w8 and w8a8 is timed too, w8a8 with the table in float (`-float-head`) and with one scale
per row (`-row-head`), float and each int8 path with XLA's products instead of shardq's kernels
(`-xla`), and float and w8a8 as `experiments.chat` decodes them (`-chat`: the prompt's call, then
short loops whose tokens reach the host loop by loop, stopping at the end-of-turn token; timed from
the first token as chat times it), so the file records what the layout, the table, the kernel and
chat's path change, measured in the same run. The long-context rows time float, w8a8 and w8a8 with
an int8 KV cache (`+kv8`) after a `--long-prompt-tokens` prompt, each with shardq's attention
kernel and with XLA's attention (`-xla-attention`). Prefill is timed too: one forward over a
`--prefill-tokens` window per model, as scoring runs it. The machine and its load average are
recorded beside.

With llama.cpp's tools (`--llama-cpp DIR` or $SHARDQ_LLAMA_CPP, docs/decoding_and_gpu.md) the
run adds the peer: llama-bench on our own float32 GGUF export of the model (F32) and on
llama-quantize's Q8_0 of it, made once in `--peer-dir`, at as many threads as this process has
cores; decoding at the same depth (the prompt) and prefill of the same window. Everything runs
in `--rounds` alternating rounds (ours, then the peer's, then ours again ...) so that a change in
the machine's load hits both sides; the file records the peer rows, its build and our ratios to
it. After the rounds, float and w8a8 meet F32 and Q8_0 again in `--pairs` back-to-back pairs (one
run of each, the order reversed every other pair), each pair's ratio recorded: a drift in the
host's memory bandwidth between rounds moves the rounds' ratio, not a pair's. Without the tools,
or for a model with no GGUF export, one line says the peer rows are skipped and why.

Float and w8a8 are also timed in child processes that start with glibc's malloc asking for
transparent huge pages and without (experiments/speed/huge_page_runs.py), and w8a8 under XLA:CPU
flag sets (experiments/speed/xla_flag_runs.py).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import NamedTuple

from experiments.cli import startup
from experiments.cli.config import (
    ConfigError,
    Parser,
    check_output_file,
    check_output_folder,
    fail,
)
from experiments.pretrained import model_ref
from experiments.reporting.results_io import command_line, results_path, write_result
from experiments.speed import llama_cpp
from model.gguf import GGUFError
from quant.modes import EMBED_BLOCK, QuantConfig, QuantError

PROG = "experiments.bench_decode"
OUT = results_path("bench_decode.json")


class Variant(NamedTuple):
    """A benchmarked way to decode: its int8 mode, int8 KV cache, layer layout (None:
    model.generate's default: per-layer, except the layer scan for int8 kernels whose products
    XLA runs; "probe": the faster of the two on this host, by a short timed run when the model
    is loaded), the embedding table and tied head (TABLES), devices each step is split over
    (parallel/decode_split.py), few-row products in shardq's kernels (quant.native_int8,
    model.native_float; False: XLA's), as experiments.chat decodes (True: tokens streamed to
    the host from short loops, model.generate.stream) instead of one scan over the tokens, and
    the kernels that read one input multiplied in one kernel call (True: q/k/v, gate/up;
    quant.dense.QuantDense.shared_call) or one call each."""
    mode: str
    kv8: bool
    layout: bool | str | None
    table: str
    devices: int = 1
    kernel: bool = True
    streamed: bool = False
    grouped: bool = True


VARIANTS = {
    "float": Variant("none", False, None, "float"),
    "w8": Variant("w8", False, None, "block"),
    "w8a8": Variant("w8a8", False, None, "block"),
    "float+kv8": Variant("none", True, None, "float"),
    "w8+kv8": Variant("w8", True, None, "block"),
    "w8a8-rotated": Variant("w8a8-rotated", False, None, "block"),
    "w8a8-float-head": Variant("w8a8", False, None, "float"),
    "w8a8-row-head": Variant("w8a8", False, None, "row"),
    "float-scan": Variant("none", False, False, "float"),
    "w8-scan": Variant("w8", False, False, "block"),
    "w8a8-scan": Variant("w8a8", False, False, "block"),
    "w8a8-probed": Variant("w8a8", False, "probe", "block"),
    "float-split2": Variant("none", False, None, "float", devices=2),
    "w8a8-split2": Variant("w8a8", False, None, "block", devices=2),
    "float-xla": Variant("none", False, None, "float", kernel=False),
    "w8-xla": Variant("w8", False, None, "block", kernel=False),
    "w8a8-xla": Variant("w8a8", False, None, "block", kernel=False),
    "w8-ungrouped": Variant("w8", False, None, "block", grouped=False),
    "w8a8-ungrouped": Variant("w8a8", False, None, "block", grouped=False),
    "w8a8-per-layer-xla": Variant("w8a8", False, True, "block", kernel=False),
    "w8a8-float-head-xla": Variant("w8a8", False, None, "float", kernel=False),
    "float-chat": Variant("none", False, None, "float", streamed=True),
    "w8a8-chat": Variant("w8a8", False, None, "block", streamed=True),
}
# table -> (quant rules, values per scale of the int8 table; 0: one per row): "block" is quant's
# default (the table in int8 blocks of 32, its tied head weight-only); "row" one scale per row
# (its head an int8 x int8 product with per-token activations); "float" the blocks alone.
TABLES = {"float": (("blocks/*",), 0), "row": (("blocks/*", "embed"), 0),
          "block": (("blocks/*", "embed"), EMBED_BLOCK)}
# The long-context rows: a prompt this long, float and the default int8 mode, and the int8 mode
# with an int8 KV cache, each with shardq's attention kernel and with XLA's attention over the
# cache (the rest of the step unchanged): (name, int8 mode, shardq's attention, int8 KV cache).
LONG_PROMPT = 1024
LONG_VARIANTS = (("float", "none", True, False), ("float-xla-attention", "none", False, False),
                 ("w8a8", "w8a8", True, False), ("w8a8-xla-attention", "w8a8", False, False),
                 ("w8a8+kv8", "w8a8", True, True),
                 ("w8a8+kv8-xla-attention", "w8a8", False, True))
# the variant the decode breakdown and the XLA flag runs look at: the default int8 mode
PROFILED = ("float", "w8a8")
FLAGS_VARIANT = "w8a8"
# (our variant, the peer's format) timed in back-to-back pairs (experiments/speed/paired_runs.py)
PAIRED = (("float", "F32"), ("w8a8", "Q8_0"))
# the variants timed with and without transparent huge pages (experiments/speed/huge_page_runs.py)
HUGE_PAGE_VARIANTS = ("float", "w8a8")
# (what changed, variant before, variant after): ratios the results file records
CHANGES = (
    ("per-layer weights instead of the stacked layer scan (float)", "float-scan", "float"),
    ("per-layer weights instead of the stacked layer scan (w8)", "w8-scan", "w8"),
    ("per-layer weights instead of the stacked layer scan (w8a8)", "w8a8-scan", "w8a8"),
    ("layer layout by a timed probe instead of the fixed rule (w8a8)", "w8a8", "w8a8-probed"),
    ("each step split over 2 devices by output features (float)", "float", "float-split2"),
    ("each step split over 2 devices by output features (w8a8)", "w8a8", "w8a8-split2"),
    ("shardq's kernels (float products, attention, greedy pick) instead of XLA's operations "
     "(float, per-layer weights)", "float-xla", "float"),
    ("shardq's kernels (int8 products, attention, greedy pick) instead of XLA's operations "
     "(w8, layer scan)", "w8-xla", "w8-scan"),
    ("shardq's kernels (int8 products, attention, greedy pick) instead of XLA's operations "
     "(w8a8, layer scan)", "w8a8-xla", "w8a8-scan"),
    ("shardq's kernels (int8 products, attention, greedy pick) instead of XLA's operations "
     "(w8a8, per-layer weights)", "w8a8-per-layer-xla", "w8a8"),
    ("one kernel call for q/k/v and one for gate/up, each input quantised once, instead of "
     "one call per kernel (w8)", "w8-ungrouped", "w8"),
    ("one kernel call for q/k/v and one for gate/up, each input quantised once, instead of "
     "one call per kernel (w8a8)", "w8a8-ungrouped", "w8a8"),
    ("the default int8 path (the kernels, per-layer weights, the table in int8 blocks) instead "
     "of the float-head path in XLA's operations and the layer scan (w8a8)",
     "w8a8-float-head-xla", "w8a8"),
    ("int8 weights (w8) against float", "float", "w8"),
    ("int8 weights and activations (w8a8) against float", "float", "w8a8"),
    ("int8 KV cache (float weights)", "float", "float+kv8"),
    ("int8 KV cache (w8 weights)", "w8", "w8+kv8"),
    ("tied embedding and head in int8 blocks of 32 instead of float (w8a8)", "w8a8-float-head",
     "w8a8"),
    ("one scale per row of the int8 table (an int8 x int8 head) instead of blocks of 32 (w8a8)",
     "w8a8", "w8a8-row-head"),
    ("rotated int8 inputs (w8a8-rotated against w8a8)", "w8a8", "w8a8-rotated"),
    ("streamed to the host as experiments.chat decodes, instead of one scan (float)",
     "float", "float-chat"),
    ("streamed to the host as experiments.chat decodes, instead of one scan (w8a8)",
     "w8a8", "w8a8-chat"),
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
    p.add_argument("--model", default="smollm2", metavar="REF",
                   help=f"the model: {model_ref.ALLOWED} (default: smollm2)")
    model_ref.add_step_flag(p)
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N blocks (a truncated model, for quick checks)")
    p.add_argument("--rounds", type=int, default=2,
                   help="alternating rounds of our timed runs and the peer's (default 2)")
    p.add_argument("--long-prompt-tokens", type=int, default=LONG_PROMPT,
                   help="prompt of the long-context rows (float, w8a8, w8a8+kv8, each with "
                        "shardq's attention kernel and with XLA's attention); 0: none")
    p.add_argument("--prefill-tokens", type=int, default=512,
                   help="the window each prefill row reads in one forward (default 512)")
    p.add_argument("--pairs", type=int, default=6,
                   help="back-to-back pairs of one run of ours and one of the peer's (float / "
                        "F32, w8a8 / Q8_0) after the rounds, each pair's ratio recorded "
                        "(default 6)")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help=f"llama.cpp's tools (llama-bench, llama-quantize: DIR or DIR/bin) for "
                        f"the peer rows (default: ${llama_cpp.ENV}; absent: no peer rows)")
    p.add_argument("--peer-dir", default="runs/llama_cpp",
                   help="where the peer's GGUF files are made once (default runs/llama_cpp)")
    p.add_argument("--no-xla-flags", action="store_true",
                   help=f"skip the rows timed in child processes: the XLA flag rows "
                        f"({FLAGS_VARIANT} under each flag set of "
                        f"experiments/speed/xla_flag_runs.py) and the huge page rows "
                        f"({', '.join(HUGE_PAGE_VARIANTS)} with and without transparent huge "
                        f"pages)")
    p.add_argument("--decode-only", action="store_true",
                   help="time the decode variants only (no prefill, peer, breakdown, matrix-"
                        "vector check or flag rows): what the flag rows' child runs do")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--json", action="store_true", help="print the summary as JSON last")
    return p


def check(args) -> tuple[list[str], llama_cpp.Tools | None, str]:
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise ConfigError(f"variants={args.variants!r}: allowed a comma-separated subset of "
                          f"{', '.join(VARIANTS)}")
    for name in ("new_tokens", "repeats", "rounds", "prefill_tokens", "pairs"):
        if getattr(args, name) < 1:
            raise ConfigError(f"{name}={getattr(args, name)}: must be a positive integer")
    if args.long_prompt_tokens < 0:
        raise ConfigError(f"long_prompt_tokens={args.long_prompt_tokens}: must be 0 (none) or a "
                          f"positive integer")
    if args.layers is not None and args.layers < 1:
        raise ConfigError(f"layers={args.layers}: must be a positive integer")
    model_ref.check_step(args.model, args.step)
    check_output_file("out", args.out)
    if args.decode_only:  # a child run of the XLA flag rows: no peer
        return names, None, ""
    check_output_folder("peer_dir", args.peer_dir, "the peer's GGUF files")
    tools, skipped = llama_cpp.locate(args.llama_cpp)
    return names, tools, skipped


def prefill_label(mode: str, table: str) -> str:
    """The prefill row of a model: its mode, and which table it holds where that is not the
    mode's own (float for float, int8 blocks for the int8 modes)."""
    if mode == "none":
        return "float"
    return mode + ("" if table == "block" else f"-{table}-head")


def build_variants(decoding, names: list[str], models: dict, prompt: list[int]) -> tuple:
    """(DecodeVariants of `names`, the layout probe's result per model that has one)."""
    probes, variants = {}, []
    for n in names:
        mode, kv8, layout, table, devices, kernel, streamed, grouped = VARIANTS[n]
        model = models[mode, table]
        if layout == "probe":
            if (mode, table) not in probes:
                probes[mode, table] = decoding.probe_layout(model, prompt)
            layout = probes[mode, table]["per_layer"]
        variants.append(decoding.DecodeVariant(n, model, kv8, layout, devices=devices,
                                               kernels=kernel, streamed=streamed,
                                               grouped=grouped))
    return variants, {prefill_label(*k): v for k, v in probes.items()}


def child_argv(args, variants: str = FLAGS_VARIANT) -> list[str]:
    """The flags a child run of the XLA flag or huge page rows gets: `variants`, the same model
    and timing."""
    argv = ["--variants", variants, "--model", args.model, "--new-tokens",
            str(args.new_tokens), "--repeats", str(args.repeats), "--rounds", "1"]
    return (argv + (["--layers", str(args.layers)] if args.layers is not None else [])
            + (["--step", str(args.step)] if args.step is not None else []))


def run(args, names: list[str], tools: llama_cpp.Tools | None, skipped: str) -> dict:
    modules = ("experiments.pretrained.loading", "experiments.pretrained.decoding",
               "experiments.pretrained.prefill_speed", "experiments.training.pydoc_corpus",
               "experiments.speed.block_matvec", "experiments.speed.greedy_pick",
               "experiments.speed.machine", "experiments.speed.decode_profile",
               "experiments.speed.xla_flag_runs", "experiments.speed.huge_page_runs",
               "experiments.speed.paired_runs", "quant.native_int8")
    split = max(VARIANTS[n].devices for n in names)
    (loading, decoding, prefill_speed, pydoc_corpus, block_matvec, greedy_pick, machine,
     decode_profile, xla_flag_runs, huge_page_runs, paired_runs, native_int8) = (
        startup.begin(*modules, devices=split) if split > 1 else startup.load(*modules))
    load_before = os.getloadavg()[0]
    float_model = loading.load(args.model, n_layers=args.layers, step=args.step)
    if tools is not None:
        (peer_export,) = startup.load("experiments.pretrained.peer_export")
        files, skipped = peer_export.peer_files(
            tools, args.peer_dir, args.model, float_model.name, float_model.cfg.n_layers,
            args.layers, args.step)
        if not files:
            print(skipped, flush=True)
    else:
        files = {}
    built = llama_cpp.version(tools) if tools is not None else {}
    # w8 and w8a8 weights do not depend on calibration (it only fills their error report).
    models = {}
    for mode, table in sorted({(VARIANTS[n].mode, VARIANTS[n].table) for n in names}):
        rules, block = TABLES[table]
        models[mode, table] = loading.quantize(float_model, mode, QuantConfig(
            mode=mode, rules=rules, embed_block=block, calib_batches=1))
    text = pydoc_corpus.split_text("validation")
    prompt = float_model.tokenizer.encode(text[:400])
    if 0 < float_model.cfg.max_len - args.new_tokens < len(prompt):  # a short context: cut
        prompt = prompt[:float_model.cfg.max_len - args.new_tokens]
    variants, probes = build_variants(decoding, names, models, prompt)
    head = {"model": float_model.name, "layers": float_model.cfg.n_layers,
            "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
            "repeats": args.repeats, "rounds": args.rounds,
            # which build of shardq's kernel the int8 variants ran (or why XLA's products)
            "int8_kernel": {k: v for k, v in native_int8.status().items() if k != "library"}}
    if args.decode_only:
        rows = decoding.decode_benchmark(variants, prompt, args.new_tokens, args.repeats,
                                         args.rounds)
        return {**head, "variants": rows, "huge_pages": huge_page_runs.page_state()}
    window = prefill_speed.window_of(float_model.tokenizer.encode(text[:8 * args.prefill_tokens]),
                                     args.prefill_tokens)
    long = long_prompt(args, float_model.tokenizer.encode(text[:8 * args.long_prompt_tokens]),
                       float_model.cfg.max_len)
    prefill = prefill_speed.PrefillBench(
        {prefill_label(*k): m for k, m in models.items()}, window)
    threads = llama_cpp.cores()
    tests = {"tg": {"n_prompt": 0, "n_gen": args.new_tokens, "depth": len(prompt)},
             "pp": {"n_prompt": args.prefill_tokens, "n_gen": 0, "depth": 0}}
    peer_runs: dict[tuple[str, str], list[dict]] = {(f, t): [] for t in tests for f in files}

    def between_rounds():  # after our decoding: the peer's, then both prefills, in turn
        for test in tests:
            if test == "pp":
                prefill.time_round(args.repeats)
            for fmt, path in files.items():
                peer_runs[fmt, test].append(llama_cpp.bench(
                    tools, path, threads, **tests[test], reps=args.repeats))

    rows = decoding.decode_benchmark(variants, prompt, args.new_tokens, args.repeats,
                                     args.rounds, between_rounds)
    pairs = peer_pairs(args, decoding, paired_runs, variants, prompt, tools, files, threads,
                       tests["tg"])
    prefill_rows = prefill.rows()
    profile = {v.name: decode_profile.decode_breakdown(
        *decoding.decode_programs(v, prompt, args.new_tokens), args.new_tokens)
        for v in variants if v.name in PROFILED}
    long_context = long_rows(args, decoding, models, long)
    flags = ([] if args.no_xla_flags
             else xla_flag_runs.flag_rows(child_argv(args), args.rounds))
    pages = ([] if args.no_xla_flags else huge_page_runs.huge_page_rows(
        child_argv(args, ",".join(HUGE_PAGE_VARIANTS)), args.rounds))
    matvec = block_matvec.matvec_check(float_model.cfg, args.repeats)
    by_name = {r["variant"]: r for r in rows}
    changes = [{"change": what, "before": a, "after": b,
                "speedup": by_name[b]["tokens_per_s"] / by_name[a]["tokens_per_s"]}
               for what, a, b in CHANGES if a in by_name and b in by_name]
    return {**head, "variants": rows, "changes": changes, "long_context": long_context,
            "layout_probe": probes,
            "profile": profile, "xla_flags": {"variant": FLAGS_VARIANT, "rows": flags},
            "huge_pages": {**huge_page_runs.page_state(), "rows": pages},
            "prefill": {"window_tokens": args.prefill_tokens, "rows": prefill_rows},
            "peer": ({**peer_section(files, peer_runs, rows, prefill_rows, threads),
                      "paired": pairs, **built}
                     if files else {"skipped": skipped}),
            "block_matvec": matvec,
            "greedy_pick": greedy_pick.pick_check(float_model.cfg.vocab_size, args.repeats),
            "machine": {**machine.describe(), "cpu_devices": split,
                        "load_1min_before": load_before,
                        "load_1min_after": os.getloadavg()[0]}}


def long_prompt(args, tokens: list[int], max_len: int) -> list[int]:
    """The long-context rows' prompt: the first `--long-prompt-tokens` of `tokens` ([] for
    none), checked against the text and the context before anything is timed."""
    n = args.long_prompt_tokens
    if n and (len(tokens) < n or n + args.new_tokens > max_len):
        raise ConfigError(f"long_prompt_tokens={n}: must leave room for {args.new_tokens} new "
                          f"tokens in the context ({max_len}) and the text ({len(tokens)} "
                          f"tokens)")
    return tokens[:n]


def long_rows(args, decoding, models: dict, prompt: list[int]) -> dict | None:
    """The long-context rows (LONG_VARIANTS, of the modes benchmarked) after `prompt`, and the
    attention kernel's change rows (each `-xla-attention` variant against its twin)."""
    have = {mode: models[mode, table] for mode, table in models
            if table == ("float" if mode == "none" else "block")}
    chosen = [(name, have[mode], own, kv8) for name, mode, own, kv8 in LONG_VARIANTS
              if mode in have]
    if not prompt or not chosen:
        return None
    variants = [decoding.DecodeVariant(name, model, kv8, attention_kernel=own)
                for name, model, own, kv8 in chosen]
    rows = decoding.decode_benchmark(variants, prompt, args.new_tokens, args.repeats,
                                     args.rounds)
    by_name = {r["variant"]: r for r in rows}
    changes = []
    def change(what: str, before: str, after: str) -> None:
        if before in by_name and after in by_name:
            changes.append({"change": f"{what} ({after}, {len(prompt)}-token prompt)",
                            "before": before, "after": after,
                            "speedup": by_name[after]["tokens_per_s"]
                            / by_name[before]["tokens_per_s"]})

    for name, _, own, kv8 in chosen:
        if not own:
            change("shardq's attention kernel instead of XLA's attention over the cache", name,
                   name.removesuffix("-xla-attention"))
        elif kv8:
            change("int8 KV cache instead of float32, both in shardq's attention kernel",
                   name.replace("+kv8", ""), name)
    return {"prompt_tokens": len(prompt), "variants": rows, "changes": changes}


def peer_pairs(args, decoding, paired_runs, variants: list, prompt: list[int],
               tools: llama_cpp.Tools | None, files: dict, threads: int,
               tg: dict) -> list[dict]:
    """Each PAIRED variant against its peer format, `args.pairs` back-to-back pairs of one run
    each (experiments/speed/paired_runs.py), the peer's run the rounds' decode test `tg`: []
    without the peer's files."""
    by = {v.name: v for v in variants}
    sides = {}
    for name, fmt in PAIRED:
        if name in by and fmt in files:
            def peer(path=files[fmt]) -> float:
                return llama_cpp.bench(tools, path, threads, **tg, reps=1)["avg_ts"]
            sides[name, fmt] = (decoding.timed_speed(by[name], prompt, args.new_tokens), peer)
    rows = paired_runs.paired_runs({f"{n} / {f}": run for (n, f), run in sides.items()},
                                   args.pairs) if sides else []
    return [{"ours": n, "peer": f, **row} for (n, f), row in zip(sides, rows, strict=True)]


def peer_section(files: dict, runs: dict, rows: list[dict], prefill_rows: list[dict],
                 threads: int) -> dict:
    """The peer's rows, its build and our ratios to it (decoding and prefill)."""
    peer = [llama_cpp.peer_row(fmt, test, files[fmt], got) for (fmt, test), got in runs.items()]
    first = next(iter(runs.values()))[0]

    def speeds(test: str) -> dict[str, float]:
        return {r["format"]: r["tokens_per_s"] for r in peer if r["test"] == test}

    def ratios(ours: list[dict], test: str, floats: str = "float") -> list[dict]:
        int8 = [r["variant"] for r in ours if r["quant"] != "none"]
        return llama_cpp.ratios({r["variant"]: r["tokens_per_s"] for r in ours}, int8,
                                speeds(test), floats)

    # Prefill twice: as scoring runs it (every position's logits) and as generation does (the
    # last position's, as llama-bench's pp): each set with its own float and best int8.
    last = [r for r in prefill_rows if r.get("logits") == "last"]
    scored = [r for r in prefill_rows if r.get("logits") != "last"]
    return {"tool": "llama.cpp", "build_commit": first["build_commit"],
            "build_number": first["build_number"], "threads": threads, "rows": peer,
            "decode_ratios": ratios(rows, "tg"),
            "prefill_ratios": ratios(scored, "pp") + ratios(last, "pp", "float-last")}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        names, tools, skipped = check(args)
        if tools is None and not args.decode_only:
            print(skipped, flush=True)
        out = {**run(args, names, tools, skipped), "command": command_line(PROG, argv)}
    except (ConfigError, GGUFError, QuantError, llama_cpp.PeerError) as e:
        fail(PROG, str(e).splitlines()[0])
    write_result(args.out, out)
    summary = {"tokens_per_s": {r["variant"]: round(r["tokens_per_s"], 1)
                                for r in out["variants"]}, "written": args.out}
    if not args.decode_only:
        summary |= {
            "changes": {c["change"]: round(c["speedup"], 2)
                        for c in out["changes"] + (out["long_context"] or {}).get("changes", [])},
            "xla_flags": {r["xla_flags"] or "none (control)": round(r["speedup"], 2)
                          for r in out["xla_flags"]["rows"]},
            "huge_pages": {r["variant"]: round(r["speedup"], 2)
                           for r in out["huge_pages"]["rows"]},
            "prefill_tokens_per_s": {r["variant"]: round(r["tokens_per_s"], 1)
                                     for r in out["prefill"]["rows"]},
            "peer": out["peer"].get("skipped") or {
                **{part: {r["ratio"]: round(r["value"], 2)
                          for r in out["peer"][f"{part}_ratios"]}
                   for part in ("decode", "prefill")},
                "paired": {r["label"]: round(r["median_ratio"], 2)
                           for r in out["peer"]["paired"]}},
            "load_1min": round(out["machine"]["load_1min_after"], 1)}
    print(json.dumps(summary) if args.json else summary)
    return out


if __name__ == "__main__":
    main()
