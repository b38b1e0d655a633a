"""Regenerate the README's result tables from the JSON files the experiments wrote.

  python -m experiments.report            # rewrites the marked sections of README.md
  python -m experiments.report --check    # exit 1 if README.md is out of date

Each table sits between `<!-- report:NAME -->` and `<!-- /report:NAME -->`; a table whose
results file does not exist yet says so instead of showing numbers.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

RESULTS = Path("experiments/results")


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def main_job(d: dict) -> str:
    return "\n".join([
        "| preset | params | devices | steps | val bits/byte (after reload) | job time | "
        "train | reload + eval | median tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {d['preset']} | {d['params']:,} | {d['devices']} | {d['step']} | "
        f"**{d['bits_per_byte']:.3f}** (target ≤ {d['target_bits_per_byte']}) | "
        f"**{d['job_s']:.0f} s** (budget {d['budget_s']} s) | {d['train_s']:.0f} s | "
        f"{d['reload_eval_s']:.1f} s | {d['median_tokens_per_s']:,.0f} |"])


def equivalence(d: dict) -> str:
    rows = ["| precision | strategy | mesh | max loss diff | max param diff |",
            "|---|---|---|---|---|"]
    for r in d["results"]:
        rows.append(f"| {r['dtype']} | {r['strategy']} | {r['mesh']} | "
                    f"{r['max_loss_diff']:.1e} | {r['max_param_diff']:.1e} |")
    rows.append(f"\n{d['steps']} steps of the `{d['preset']}` preset, global batch "
                f"{d['global_batch']} in {d['micro_steps']} micro-steps; reference: "
                f"{d['reference']}. fp32 worst loss difference {d['fp32_max_loss_diff']:.1e} "
                f"(tolerance {d['fp32_tolerance']:.0e}).")
    return "\n".join(rows)


def strategy_speed(d: dict) -> str:
    rows = [f"`{d['preset']}` preset on {d['devices']} {d['backend']} devices "
            f"({d['device_kind']}), median of {d['steps']} steps:", "",
            "| strategy | ms/step | × dp | tokens/s | peak MB/device |", "|---|---|---|---|---|"]
    for r in d["results"]:
        rows.append(f"| {r['strategy']} | {r['median_step_s'] * 1e3:.1f} | "
                    f"{r['ratio_to_dp']:.2f} | {r['tokens_per_s']:,.0f} | "
                    f"{r['peak_bytes'] / 1e6:.1f} |")
    return "\n".join(rows)


def zero_memory(d: dict) -> str:
    cells = {}
    for r in d["results"]:
        cells[(r["params"], r["n_devices"], r["stage"])] = r
    models = sorted({k[0] for k in cells})
    nds = sorted({k[1] for k in cells})
    stages = ["dp", "zero1", "zero2", "zero3"]
    rows = ["| params | N_d | " + " | ".join(f"{s} ours / paper GB" for s in stages) + " |",
            "|---|---|" + "---|" * len(stages)]
    for m in models:
        for n in nds:
            parts = []
            for s in stages:
                r = cells.get((m, n, s))
                parts.append("—" if r is None else
                             f"{r['model_state_gb']:.4g} / {r['paper_gb']:.4g}")
            rows.append(f"| {m} | {n} | " + " | ".join(parts) + " |")
    return "\n".join(rows)


def comm_volume(d: dict) -> str:
    rows = ["| strategy | volume (× Ψ) | all-gathers in layer loop |", "|---|---|---|"]
    for r in d["results"]:
        rows.append(f"| {r['strategy']} | {r['volume_psi']:.3f} | "
                    f"{r['all_gathers_in_layer_loop']} |")
    return "\n".join(rows)


SECTIONS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "main_job": ("main_job.json", main_job),
    "equivalence": ("equivalence.json", equivalence),
    "strategy_speed": ("strategy_speed.json", strategy_speed),
    "zero_memory": ("zero_memory.json", zero_memory),
    "comm_volume": ("comm_volume.json", comm_volume),
}


def render(readme: str) -> str:
    for name, (file, fn) in SECTIONS.items():
        data = _load(file)
        body = fn(data) if data else f"_(no {RESULTS / file} yet: run the command above)_"
        pattern = re.compile(rf"(<!-- report:{name} -->\n).*?(\n<!-- /report:{name} -->)", re.S)
        readme = pattern.sub(lambda m, b=body: m.group(1) + b + m.group(2), readme)
    return readme


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="experiments.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readme", default="README.md")
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    path = Path(args.readme)
    old = path.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("README.md tables are out of date: run python -m experiments.report",
                  file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
