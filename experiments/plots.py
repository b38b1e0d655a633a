"""Plots generated from the files runs write (never from numbers typed by hand)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def loss_curve(metrics_path: Path, out_path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    train = [(r["step"], r["loss"] / math.log(2)) for r in rows if "loss" in r]
    val = [(r["step"], r["val_bits_per_byte"]) for r in rows if "val_bits_per_byte" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(*zip(*train, strict=True), label="train (bits/byte)", lw=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation (bits/byte)")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(top=min(8.0, max(v for _, v in train)))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
