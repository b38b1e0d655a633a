"""Plots generated from the files runs write (never from numbers typed by hand)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

# Files only, never a window: the non-interactive backend, chosen before pyplot is imported.
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.zero.settings import STAGES  # noqa: E402


def loss_curve(metrics_path: Path, out_path: Path, title: str = "",
               per_token: bool = False) -> Path:
    """Train and validation loss by step: bits per byte (byte-level runs), or nats per token
    (`per_token`: a pretrained model's tokens; step 0 is the model before fine-tuning)."""
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    scale, unit = (1.0, "nats per token") if per_token else (1 / math.log(2), "bits per byte")
    train = [(r["step"], r["loss"] * scale) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"] * scale) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(*zip(*train, strict=True), label=f"train ({unit})", lw=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label=f"validation ({unit})")
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    if not per_token:
        ax.set_ylim(top=min(8.0, max(v for _, v in train)))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def activation_profile(outliers: dict, out_path: Path, title: str = "") -> Path:
    """Per layer, the largest input channel of each Dense (left) and its ratio to the median
    channel (right), log scale, from the pretrained model's `activation_outliers`. Layers that
    share an input (q/k/v, gate/up) are one line."""
    order = ("q", "k", "v", "o", "gate", "up", "down")  # a block's order, for the labels
    lines: dict[tuple, list[str]] = {}  # one line per distinct input
    by_name = sorted(outliers["per_module"].items(), key=lambda kv: (
        order.index(kv[0].split("/")[-1]) if kv[0].split("/")[-1] in order else len(order),
        kv[0]))
    for path, m in by_name:
        key = (tuple(m["per_layer"]["max"]), tuple(m["per_layer"]["ratio_to_median"]))
        lines.setdefault(key, []).append(path.split("/")[-1])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120)
    for (peak, ratio), names in lines.items():
        label = "/".join(names) + " input"
        axes[0].plot(range(len(peak)), peak, "o-", ms=3, lw=1, label=label)
        axes[1].plot(range(len(ratio)), ratio, "o-", ms=3, lw=1, label=label)
    for ax, ylabel in zip(axes, ("largest |activation| in a channel",
                                 "largest channel / median channel"), strict=True):
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def gpu_benchmark(results: dict, out_path: Path) -> Path:
    """From `bench_gpu`'s results: MFU per training variant (left; a variant that did not run is
    named with a cross) and int8 speed over bf16 per matmul size, for the int8 kernel stored
    [in, out] and [out, in] (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), dpi=120,
                             gridspec_kw={"width_ratios": [1.4, 1]})
    rows = results["training"]
    labels = [f"{r['strategy']} · remat {r['remat']} · {r['attention']}" for r in rows]
    mfu = [100 * (r.get("mfu") or 0) for r in rows]
    bars = axes[0].barh(range(len(rows)), mfu, color=["tab:orange" if r["attention"] == "cudnn"
                                                       else "tab:blue" for r in rows])
    for bar, r, v in zip(bars, rows, mfu, strict=True):
        why = r.get("error") or r.get("skipped") or ""
        note = (f"{v:.1f}%" if r.get("mfu") is not None else
                "× out of memory" if "RESOURCE_EXHAUSTED" in why else "× not run")
        axes[0].text(bar.get_width() + 0.5, bar.get_y() + bar.get_height() / 2, note,
                     va="center", fontsize=8)
    axes[0].set_yticks(range(len(rows)), labels, fontsize=8)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("MFU (model FLOPs / bf16 peak), %")
    axes[0].set_xlim(0, max(mfu + [1]) * 1.2)
    axes[0].grid(alpha=0.3, axis="x")
    sizes = [m["n"] for m in results["matmuls"]]
    axes[1].plot(sizes, [m["int8_speedup_vs_bf16"] for m in results["matmuls"]], "o-",
                 label="int8, kernel [in, out]")
    if all("int8_kmajor_speedup_vs_bf16" in m for m in results["matmuls"]):
        axes[1].plot(sizes, [m["int8_kmajor_speedup_vs_bf16"] for m in results["matmuls"]],
                     "s-", label="int8, kernel [out, in] (quant/)")
    axes[1].axhline(1.0, color="grey", lw=1, ls="--")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xticks(sizes, [f"{n}³" for n in sizes])
    axes[1].set_ylabel("speed over bf16 (×)")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(f"{m['device_kind']}, preset {results['preset']}: training step variants and "
                 f"int8 GEMMs")
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def zero_table2_planning(planning: list[dict], out_path: Path) -> Path:
    """Largest trainable member vs devices, per stage, log-log: a panel per device memory, the
    state-only search as lines, the compiled search (activations included) as markers."""
    memories = sorted({r["memory_gb"] for r in planning})
    fig, axes = plt.subplots(1, len(memories), figsize=(5.2 * len(memories), 4.2), dpi=120,
                             sharey=True, squeeze=False)
    colors = dict(zip(STAGES, ("tab:gray", "tab:blue", "tab:orange", "tab:green"), strict=True))
    for ax, mem in zip(axes[0], memories, strict=True):
        for stage in STAGES:
            rows = sorted((r for r in planning if r["memory_gb"] == mem and r["stage"] == stage),
                          key=lambda r: r["devices"])
            ax.plot([r["devices"] for r in rows], [r["state_psi"] for r in rows], "-",
                    color=colors[stage], label=f"{stage} (model state)")
            done = [r for r in rows if r.get("compiled_psi")]
            ax.plot([r["devices"] for r in done], [r["compiled_psi"] for r in done], "o",
                    color=colors[stage], label=f"{stage} (compiled, with activations)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices")
        ax.set_title(f"{mem:g} GB per device")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("largest trainable model (parameters)")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
