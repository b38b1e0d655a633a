"""The README's headline tables: one row per area, our figure beside its published or
independent counterpart, each read from the results file named in the row, with the host and
commit of the run that wrote that file. The CPU rows are one table (one reproduction run on one
host); the GPU row, necessarily from another machine, is a table of its own."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from experiments.reporting.tables.common import STAGE_ORDER, head, load

# A row's figures: (ours, theirs) from its results file's JSON and the results folder (for a
# counterpart another file holds). KeyError, IndexError or TypeError: not in this results set.
Figures = Callable[[dict, Path], tuple[str, str]]


def _table1(d: dict, results: Path) -> tuple[str, str]:
    r = {x["stage"]: x for x in d["results"] if x["params"] == "7.5b" and x["n_devices"] == 64}
    return (" / ".join(f"{r[s]['model_state_gb']:.2f}" for s in STAGE_ORDER) + " GB",
            " / ".join(f"{r[s]['paper_gb']:.2f}" for s in STAGE_ORDER) + " GB (ZeRO Table 1)")


def _volume(d: dict, results: Path) -> tuple[str, str]:
    r = {x["strategy"]: x["volume_psi"] for x in d["results"]}
    return (f"{r['dp']:.2f} / {r['zero3']:.2f} Ψ", "2 / 3 Ψ (ZeRO §7)")


def _table2(d: dict, results: Path) -> tuple[str, str]:
    r = {x["stage"]: x for x in d["table2"]}
    return (" / ".join(f"{r[s]['state_psi'] / 1e9:.1f}B" for s in STAGE_ORDER) +
            " (with activations: " +
            " / ".join(f"{r[s]['compiled_psi'] / 1e9:.1f}B" for s in STAGE_ORDER) + ")",
            " / ".join(f"{r[s]['paper_printed_psi'] / 1e9:g}B" for s in STAGE_ORDER) +
            " (ZeRO Table 2)")


def _plan_accuracy(d: dict, results: Path) -> tuple[str, str]:
    return f"max error {d['max_abs_error']:.1%}", "goal ≤ 10%"


def _equivalence(d: dict, results: Path) -> tuple[str, str]:
    return f"max difference {d['fp32_max_loss_diff']:.1e}", "tolerance 1e-5"


def _parity(d: dict, results: Path) -> tuple[str, str]:
    ours = f"max Δ mean NLL {d['max_abs_nll_diff']:.1e} nats, next tokens " \
           f"{d['next_identical']}/{d['texts']}"
    if "long_text" in d:
        ours += (f"; {d['long_text']['tokens']:,}-token text: Δ "
                 f"{d['long_text']['abs_nll_diff']:.1e}")
    if "chat" in d:
        ours += (f"; greedy chat replies identical "
                 f"{sum(p['identical'] for p in d['chat']['prompts'])}/"
                 f"{len(d['chat']['prompts'])}")
    return ours, "transformers on the same GGUF"


def _quant(d: dict, results: Path) -> tuple[str, str]:
    r = {x["quant"]: x["perplexity"] for x in d["rows"]}
    return (", ".join(f"{m} {r[m]:.2f}" for m in ("none", "w8a8-tensor", "w8a8",
                                                   "smoothquant", "w8a8-rotated") if m in r),
            "SmoothQuant's ordering: per-tensor ruined, per-token degraded, smoothed ≈ "
            "float; QuaRot's: rotated ≈ float")


def _crosscheck(d: dict, results: Path) -> tuple[str, str]:
    rows = {x["variant"]: x for x in d["rows"]}
    shown = [v for v in ("w8a8", "w8a8-rotated") if v in rows]
    ours = " / ".join(f"{rows[v]['ours']['vs_float_pct']:+.2f}%" for v in shown)
    theirs = " / ".join(f"{rows[v]['transformers']['vs_float_pct']:+.2f}%" for v in shown)
    return (f"{ours} ({' / '.join(shown)})",
            f"{theirs} (the same in transformers, same windows)")


def _encoder(d: dict, results: Path) -> tuple[str, str]:
    r = {x["mode"]: x["mean_cosine"] for x in d["results"]}
    bench = load("bench_encoder.json", results) or {}
    torch = bench.get("torch") or {}
    theirs = (f"{torch['int8_cosine_mean']:.4f} (`quantize_dynamic` against its own float, "
              f"bench_encoder's texts)" if torch else "—")
    return f"{r['w8a8']:.4f} (w8a8)", theirs


def _finetune(d: dict, results: Path) -> tuple[str, str]:
    return (f"{d['perplexity_before']:.2f} → {d['perplexity_after']:.2f}",
            "goal: ≥ 10% lower")


def _train_speed(d: dict, results: Path) -> tuple[str, str]:
    t = {n: (r.get("torch") or {}).get("ratio") for n, r in d["runs"].items()}
    t = {n: v for n, v in t.items() if v is not None}
    if not t:
        return "(no PyTorch side in this run)", "—"
    return (" / ".join(f"{v:.2f}×" for v in t.values()) +
            f" ({' / '.join(t)} devices)", "PyTorch eager, same model and batch = 1.00×")


def _encoder_speed(d: dict, results: Path) -> tuple[str, str]:
    r = d.get("ratios") or {}
    if "float" not in r:
        return "(no PyTorch side in this run)", "—"
    return (f"float {r['float']:.2f}×, w8a8 {r['w8a8']:.2f}×",
            "transformers float / `quantize_dynamic` int8 = 1.00×")


def _decode(d: dict, results: Path) -> tuple[str, str]:
    r = {x["variant"]: x["tokens_per_s"] for x in d["variants"]}
    rotated = f", w8a8-rotated {r['w8a8-rotated']:.1f}" if "w8a8-rotated" in r else ""
    # files written before the chat path was timed have no -chat row
    chat = f", w8a8 as chat streams it {r['w8a8-chat']:.1f}" if "w8a8-chat" in r else ""
    ratios = {x["ratio"]: x["value"] for x in (d.get("peer") or {}).get("decode_ratios", [])}
    peer = "".join(f"; {k} {v:.2f}×" for k, v in ratios.items()
                   if k.startswith(("our float /", "our w8a8 /", "our w8a8-chat /")))
    # files written before the back-to-back pairs have none
    peer += "".join(f"; {p['ours']} / {p['peer']} in {p['pairs']} back-to-back pairs, median "
                    f"{p['median_ratio']:.2f}×" for p in (d.get("peer") or {}).get("paired", []))
    return (f"float {r['float']:.1f}, w8a8 {r['w8a8']:.1f}{rotated}{chat} tokens/s{peer}",
            "int8 should beat float (memory-bound); llama.cpp is the peer")


def _gpu(d: dict, results: Path) -> tuple[str, str]:
    ran = [r for r in d["training"] if r.get("mfu") is not None]
    if not ran or not d["matmuls"]:
        return "no complete run in the file", "—"
    best = max(ran, key=lambda r: r["mfu"])
    base = next((r for r in ran if (r["strategy"], r.get("remat", "full"),
                                    r.get("attention", "xla")) == ("dp", "full", "xla")), None)
    big = max(d["matmuls"], key=lambda r: r["n"])
    peak = best["peak_flops_per_device"]
    return (f"MFU {best['mfu']:.1%} ({best['strategy']}, remat {best['remat']}, "
            f"{best['attention']} attention)" + (f"; {base['mfu']:.1%} with full remat and "
                                                 f"XLA's attention" if base else ""),
            f"the same run's bf16 matmul at {big['n']}³: {big['bf16_tflops']:.0f} TFLOP/s "
            f"= {1e12 * big['bf16_tflops'] / peak:.0%} of the chip's peak")


# (results file, area, figures), in the table's order.
ROWS: tuple[tuple[str, str, Figures], ...] = (
    ("zero_memory.json", "model state per device, 7.5B on 64 devices, dp / zero1 / zero2 / "
     "zero3", _table1),
    ("comm_volume.json", "communication per step, dp / zero3", _volume),
    ("zero_table2.json", "largest model on 64 × 32 GB, dp / zero1 / zero2 / zero3", _table2),
    ("plan_accuracy.json", "planner's peak against the executed peak", _plan_accuracy),
    ("equivalence.json", "every strategy against one device (fp32 loss)", _equivalence),
    ("smollm2_parity.json", "SmolLM2 float against transformers (36 texts, a long one, "
     "chat replies)", _parity),
    ("smollm2_quant.json", "SmolLM2 perplexity, float and int8", _quant),
    ("smollm2_w8a8_crosscheck.json", "SmolLM2 per-token w8a8, plain and rotated, perplexity "
     "vs float", _crosscheck),
    ("embed_fidelity.json", "MiniLM int8 embeddings, mean cosine to float", _encoder),
    ("finetune_smollm2.json", "SmolLM2 fine-tuned under zero3, held-out perplexity", _finetune),
    ("bench_train.json", "training speed (`small`)", _train_speed),
    ("bench_encoder.json", "MiniLM encoding speed", _encoder_speed),
    ("bench_decode.json", "SmolLM2 batch-1 decoding", _decode),
)
GPU_ROWS: tuple[tuple[str, str, Figures], ...] = (
    ("bench_gpu.json", "training a 1.3B decoder on one GPU (H200, bf16)", _gpu),
)


def host_label(provenance: dict | None) -> str:
    """A short name for the machine a results file's provenance records: its CPU model without
    trademarks, clock or core-count words, and its cores ("—" without provenance)."""
    machine = (provenance or {}).get("machine") or {}
    if not machine.get("cpu"):
        return "—"
    cpu = re.sub(r"\((R|TM|tm)\)", "", machine["cpu"]).split("@")[0]
    words = [w for w in cpu.split() if w not in ("CPU", "Processor")
             and not re.fullmatch(r"\d+-Core", w)]
    cores = machine.get("cores")
    return " ".join(words) + (f", {cores} cores" if cores else "")


def commit_label(provenance: dict | None) -> str:
    """The commit a results file's provenance records, abbreviated ("—" where there is none)."""
    commit = (provenance or {}).get("git_commit")
    return f"`{commit[:7]}`" if commit else "—"


def _row(results: Path, file: str, area: str, figures: Figures) -> str:
    d = load(file, results)
    if d is None:
        return f"| {area} | _(no {file} yet)_ | | | | |"
    try:
        ours, theirs = figures(d, results)
    except (KeyError, IndexError, TypeError):  # a smaller grid (reproduce --quick)
        ours, theirs = "_(not in this results set)_", ""
    prov = d.get("provenance")
    host = host_label(prov)
    if host == "—":  # a device benchmark run outside reproduce names its device itself
        host = ((d.get("machine") or {}).get("device_kind")) or host
    return f"| {area} | {ours} | {theirs} | `{file}` | {host} | {commit_label(prov)} |"


def _table(results: Path, rows: tuple[tuple[str, str, Figures], ...]) -> str:
    lines = head("area", "ours", "published / independent counterpart", "from", "host",
                 "commit")
    lines += [_row(results, file, area, figures) for file, area, figures in rows]
    return "\n".join(lines)


def headline(results: Path) -> str:
    """One row per area measured on the CPU: our headline figure beside its published or
    independent counterpart, each read from the results file named in the row, with the host
    and commit that file's run records (a mixed table shows it in these columns)."""
    return _table(results, ROWS)


def headline_gpu(results: Path) -> str:
    """The GPU's headline rows, kept out of the CPU table because they come from another
    machine."""
    return _table(results, GPU_ROWS)
