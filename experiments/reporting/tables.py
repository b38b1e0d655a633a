"""Regenerate the README's result tables from the JSON files the experiments wrote.

  python -m experiments.report            # rewrites the marked sections of README.md
  python -m experiments.report --check    # exit 1 if README.md is out of date

Each table sits between `<!-- report:NAME -->` and `<!-- /report:NAME -->`; a table whose
results file does not exist yet says so instead of showing numbers.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

from experiments.reporting.results_io import RESULTS_DIR

RESULTS = RESULTS_DIR
SHOWN = "experiments/results"  # how the README names that folder


def _load(name: str, results: Path = RESULTS) -> dict | None:
    path = Path(results) / name
    return json.loads(path.read_text()) if path.exists() else None


STAGE_ORDER = ("dp", "zero1", "zero2", "zero3")  # the ZeRO stages, in the paper's column order


def _head(*columns: str) -> list[str]:
    """A markdown table's header and separator lines."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def main_job(d: dict) -> str:
    return "\n".join([
        *_head("preset", "params", "devices", "steps", "val bits/byte (after reload)",
               "job time", "train", "reload + eval", "median tokens/s"),
        f"| {d['preset']} | {d['params']:,} | {d['devices']} | {d['step']} | "
        f"**{d['bits_per_byte']:.3f}** (target ≤ {d['target_bits_per_byte']}) | "
        f"**{d['job_s']:.0f} s** (budget {d['budget_s']} s) | {d['train_s']:.0f} s | "
        f"{d['reload_eval_s']:.1f} s | {d['median_tokens_per_s']:,.0f} |"])


def equivalence(d: dict) -> str:
    rows = _head("precision", "strategy", "mesh", "max loss diff", "max param diff")
    for r in d["results"]:
        rows.append(f"| {r['dtype']} | {r['strategy']} | {r['mesh']} | "
                    f"{r['max_loss_diff']:.1e} | {r['max_param_diff']:.1e} |")
    worst = d["fp32_max_loss_diff"]
    claim = ("no fp32 run" if worst is None else
             f"fp32 worst loss difference {worst:.1e} (tolerance {d['fp32_tolerance']:.0e})")
    rows.append(f"\n{d['steps']} steps of the `{d['preset']}` preset, global batch "
                f"{d['global_batch']} in {d['micro_steps']} micro-steps; reference: "
                f"{d['reference']}. {claim}.")
    return "\n".join(rows)


def strategy_speed(d: dict) -> str:
    rows = [f"`{d['preset']}` preset on {d['devices']} {d['backend']} devices "
            f"({d['device_kind']}), median of {d['steps']} steps:", "",
            *_head("strategy", "ms/step", "× dp", "tokens/s", "peak MB/device")]
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
    stages = STAGE_ORDER
    rows = _head("params", "N_d", *(f"{s} ours / paper GB" for s in stages))
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
    rows = _head("strategy", "volume (× Ψ)", "all-gathers in layer loop")
    for r in d["results"]:
        rows.append(f"| {r['strategy']} | {r['volume_psi']:.3f} | "
                    f"{r['all_gathers_in_layer_loop']} |")
    return "\n".join(rows)


def comm_volume_layers(d: dict) -> str:
    """Volume against the exact expectation (3 Psi_layers + 2 Psi_rest for zero3), and what
    moves inside the layer loop in units of the layers' own parameters."""
    c = d["config"]
    rows = [f"{c['preset']}, {c['n_layers']} layers, Ψ = {d['psi']:,} (layers "
            f"{d['psi_layers'] / d['psi']:.0%}), {c['devices']} devices", ""]
    rows += _head("strategy", "volume (× Ψ)", "expected (× Ψ)", "in layer loop (× Ψ_layers)",
                  "layer gathers per step")
    for r in d["results"]:
        rows.append(f"| {r['strategy']} | {r['volume_psi']:.3f} | {r['expected_psi']:.3f} | "
                    f"{r['in_layer_loop_psi_layers']:.3f} | {r['layer_param_gathers']:.2f} |")
    return "\n".join(rows)


def export_run(results: Path) -> str:
    """The export summary and, from the same results folder, its transformers parity."""
    d = _load("export_run_smollm2.json", results)
    if d is None:
        return f"_(no {SHOWN}/export_run_smollm2.json yet: run the commands above)_"
    parity = _load("export_run_parity.json", results) or {}
    rows = _head("exported", "tensors", "bytes", "host peak before → after first/last leaf",
                 "largest leaf", "ids identical", "next tokens identical",
                 "largest Δ mean NLL")
    cell = lambda k: parity.get(k, "—")
    nll = parity.get("max_abs_nll_diff")
    rows.append(f"| {d['source']} | {d['tensors']} | {d['bytes']:,} | "
                f"{d['peak_rss_before_bytes'] / 1e9:.2f} → {d['peak_rss_bytes'] / 1e9:.2f} GB | "
                f"{d['largest_tensor_bytes'] / 1e6:.0f} MB | {cell('ids_identical')}/"
                f"{cell('texts')} | {cell('next_identical')}/{cell('texts')} | "
                f"{'—' if nll is None else f'{nll:.1e}'} nats |")
    return "\n".join(rows)


def zero_release(d: dict) -> str:
    c = d["config"]
    rows = [f"d_model {c['d_model']}, depths {c['depths'][0]} vs {c['depths'][1]}, "
            f"{c['devices'][0]} and {c['devices'][1]} devices, {c['dtype']}, remat {c['remat']}:",
            "", *_head("strategy", "peak growth per added layer",
                       "of which does not shrink with N_d", "one gathered layer",
                       "gathered layers kept", "released")]
    for r in d["results"]:
        growth = ", ".join(f"{k}: {v / 1e6:.2f} MB" for k, v in r["growth_per_layer_bytes"].items())
        rows.append(f"| {r['strategy']} | {growth} | "
                    f"{r['unsharded_growth_per_layer_bytes'] / 1e6:.2f} MB | "
                    f"{r['gathered_layer_bytes'] / 1e6:.2f} MB | "
                    f"{r['kept_gathered_layers']:.2f} | {r['released']} |")
    return "\n".join(rows)


def _divergence(r: dict, kl: str = ".4f", top1: str = ".1%") -> str:
    """A row's mean KL from float and top-1 agreement as two cells ('–' where not measured:
    the float row, and files written before the measurement existed)."""
    dv = r.get("divergence")
    return f"{dv['kl_mean']:{kl}} | {dv['top1_agree']:{top1}}" if dv else "– | –"


def quant_eval(d: dict) -> str:
    rows = [f"`{d['preset']}` checkpoint at step {d['step']} ({d['workdir'].split('/')[-1]}), "
            f"{d['eval_tokens']:,} validation tokens, {d['calib_batches']} calibration batches:",
            "", *_head("mode", "val loss", "bits/byte", "vs float", "KL from float (mean, nats)",
                       "same top-1 byte as float", "param bytes", "Dense bytes / fp32",
                       "on disk vs fp32")]
    for r in d["rows"]:
        dense = "—" if r.get("dense_bytes_ratio") is None else f"{r['dense_bytes_ratio']:.3f}"
        disk = r.get("disk_ratio_vs_fp32")
        disk = "baseline" if disk is None else f"{disk:.2f}× smaller"
        rows.append(f"| {r['mode']} | {r['val_loss']:.5f} | {r['bits_per_byte']:.4f} | "
                    f"{r['rel_to_float'] * 100:+.3f}% | {_divergence(r, '.2e', '.2%')} | "
                    f"{r['param_bytes']:,} | {dense} | {disk} |")
    return "\n".join(rows)


def int8_bench(d: dict) -> str:
    cpu = d["host_cpu"]
    host = f"host CPU {cpu['model']} (int8 flags: {', '.join(cpu['int8_flags']) or 'none'})"
    rows = [f"{d['backend']} ({d['device_kind']}), JAX {d['jax_version']}, {host}:", "",
            *_head("m × k × n", "fp32 ms", "bf16 ms", "int8 dot ms (kernel [out, in] / [in, out])",
                   "int8 Dense ms", "LLM.int8() Dense ms (1/16 cap / uncapped)",
                   "int8 dot vs bf16", "int8 Dense vs fp32")]
    for r in d["matmuls"]:
        rows.append(f"| {r['m']}×{r['k']}×{r['n']} | {r['float32_ms']:.3f} | "
                    f"{r['bfloat16_ms']:.3f} | {r['int8_dot_ms']:.3f} / "
                    f"{r['int8_dot_in_out_ms']:.3f} | {r['int8_dense_ms']:.3f} | "
                    f"{r['int8_outlier_dense_ms']:.3f} / {r['int8_outlier_full_dense_ms']:.3f} | "
                    f"{r['int8_dot_speedup_vs_bf16']:.2f}× | "
                    f"{r['int8_dense_speedup_vs_f32']:.2f}× |")
    rows += ["", *_head("decoding mode", "tokens/s", "× float", "param bytes")]
    for r in d["decoding"]:
        rows.append(f"| {r['mode']} (batch {r['batch']}, {r['new_tokens']} tokens) | "
                    f"{r['tokens_per_s']:,.0f} | {r['speedup_vs_float']:.2f} | "
                    f"{r['param_bytes']:,} |")
    return "\n".join(rows)


def smollm2_quant(d: dict) -> str:
    m = d["machine"]
    text = {"pydoc": "validation tokens of `pydoc_data`",
            "docstrings": "tokens of the standard library's docstrings"}[d.get("corpus", "pydoc")]
    rows = [f"{d['model']} ({d['layers']} layers), perplexity on {d['rows'][0]['tokens']:,} "
            f"{text} (windows of {d['rows'][0]['window']}):", "",
            *_head("mode", "perplexity", "vs float", "KL from float (mean, nats)",
                   "same top-1 token as float", "param bytes", "int8 share")]
    for r in d["rows"]:
        rows.append(f"| {r['quant']} | {r['perplexity']:.3f} | {r['vs_float_pct']:+.2f}% | "
                    f"{_divergence(r)} | {r['param_bytes']:,} | "
                    f"{r['quantized_fraction']:.3f} |")
    if any("divergence" in r for r in d["rows"]):
        rows += ["", "KL from float: KL(float ‖ int8) of the next-token distributions at the "
                 "scored positions, averaged; same top-1: the share of those positions where "
                 "both models' most likely next token is the same (what greedy decoding "
                 "follows)."]
    out = d["outliers"]
    cal = out["calibration"]
    rows += ["", f"Largest activations (float model, {cal['rows']} calibration rows of "
             f"{cal['tokens_per_row']} tokens): the three largest, then the largest of each other "
             f"distinct Dense input (q/k/v read one, gate/up another). A carrier is a token "
             f"whose largest input is in that channel, at a tenth of its peak or more:", "",
             *_head("Dense input", "layer", "channel", "peak", "× median channel",
                    "carriers", "carriers first in their row", "carriers' text",
                    "median token's largest input")]
    shown = out["top"][:3]  # the largest overall, then each other distinct input's largest
    for module in sorted(out["per_module"].values(), key=lambda v: -v["max"]):
        if all(module["per_layer"] != out["per_module"][e["module"]]["per_layer"]
               for e in shown):
            shown.append(module["peak"])
    order = ("q", "k", "v", "o", "gate", "up", "down")  # a block's order, for the labels

    def label(module: str) -> str:  # every Dense that reads the same input
        same = [p.split("/")[-1] for p, v in out["per_module"].items()
                if v["per_layer"] == out["per_module"][module]["per_layer"]]
        return "/".join(sorted(same, key=lambda n: (order.index(n) if n in order else 99, n)))

    for e in shown:
        c = e["carriers"]
        texts = ", ".join("`" + json.dumps(t["text"], ensure_ascii=False).replace("|", "\\|")
                          + f"` ×{t['count']}" for t in c["texts"][:3])
        rows.append(f"| {label(e['module'])} | {e['layer']} | {e['channel']} | "
                    f"{e['absmax']:.0f} | {e['ratio_to_median']:.0f}× | {c['tokens']:,} of "
                    f"{c['of']:,} | {c['first_of_row']} | {texts} | "
                    f"{e['median_token_absmax']:.2f} |")
    if d.get("w8a8_sensitivity"):
        w8a8 = next(r for r in d["rows"] if r["quant"] == "w8a8")
        rows += ["", f"Plain w8a8 ({w8a8['vs_float_pct']:+.2f}%) with one group of layers left "
                 f"float, all {d['layers']} layers each (the groups share an input):", "",
                 *_head("left float", "perplexity", "vs float", "share of w8a8's change removed")]
        for r in d["w8a8_sensitivity"]:
            removed = 1 - r["vs_float_pct"] / w8a8["vs_float_pct"]
            rows.append(f"| {r['float_group']} | {r['perplexity']:.3f} | "
                        f"{r['vs_float_pct']:+.2f}% | {removed:.0%} |")
    searched = [r for r in d["rows"] if "alpha" in r]
    if searched:
        grid = ", ".join(f"{a:g}" for a in d["alpha_grid"])
        rows += ["", f"SmoothQuant's alpha, chosen per layer and site from {grid} by the int8 "
                 f"product's error on the calibration rows (quant/alpha_search.py); the median "
                 f"of the {d['layers']} layers' choices per site:", "",
                 *_head("mode", "q/k/v (attn_norm)", "gate/up (mlp_norm)", "o (v → o)",
                        "down (up → down)")]
        sites = ("blocks/attn_norm", "blocks/mlp_norm", "blocks/attn/o", "blocks/mlp/down")
        for r in searched:
            med = " | ".join(f"{statistics.median(r['alpha'][k]):.2f}" if k in r["alpha"]
                             else "–" for k in sites)
            rows.append(f"| {r['quant']} | {med} |")
    if d.get("paper_alpha"):
        alpha = d["paper_alpha"][0]["alpha"]
        rows += ["", f"The same modes with the SmoothQuant paper's one alpha, {alpha:g}, at "
                 f"every site (`--alpha {alpha:g}`):", "",
                 *_head("mode", "perplexity", "vs float", "KL from float (mean, nats)",
                        "same top-1 token as float")]
        for r in d["paper_alpha"]:
            rows.append(f"| {r['quant']} (alpha {r['alpha']:g}) | {r['perplexity']:.3f} | "
                        f"{r['vs_float_pct']:+.2f}% | {_divergence(r)} |")
    if d.get("rotation_seeds"):
        seeds = d["rotation_seeds"]
        h = next(r for r in d["rows"] if r["quant"] == "w8a8-rotated")
        pct = sorted(r["vs_float_pct"] for r in seeds)
        rows += ["", f"w8a8-rotated with the plain Hadamard rotation: {h['vs_float_pct']:+.2f}%; "
                 f"with random signs before it (seeds {seeds[0]['seed']}–{seeds[-1]['seed']}): "
                 f"{pct[0]:+.2f}% to {pct[-1]:+.2f}%, median "
                 f"{statistics.median(pct):+.2f}%."]
    dec = d["decoding"]  # float is always among them: never empty
    rows += ["", *_head(f"decoding, batch 1 (greedy, {dec[0]['new_tokens']} new tokens, median "
                        f"of {len(dec[0]['runs_s'])} interleaved runs)", "KV cache", "tokens/s")]
    for r in dec:
        rows.append(f"| {r['quant']} | {'int8' if r['kv_int8'] else 'float'} | "
                    f"{r['tokens_per_s']:.1f} |")
    rows += ["", f"Host: {m['host_cpu']['model']} ({m['cpus']} cores, int8 flags "
             f"{', '.join(m['host_cpu']['int8_flags']) or 'none'}), JAX {m['jax_version']}."]
    return "\n".join(rows)


def w8a8_crosscheck(d: dict) -> str:
    ref, m = d["reference"], d["machine"]
    rows = [f"{d['model']} ({d['layers']} layers), the same {d['tokens']:,} validation tokens "
            f"(windows of {d['window']}, {d['scored']:,} positions scored) through both:", "",
            *_head("variant", "ours: perplexity", "vs our float", "transformers: perplexity",
                   "vs its float", "transformers, float32 quotient: vs its float")]
    for r in d["rows"]:
        o, t = r["ours"], r["transformers"]
        f32 = r.get("transformers_float32_quotient")  # absent for the float model
        f32_cell = f"{f32['vs_float_pct']:+.2f}%" if f32 else "—"
        rows.append(f"| {r['variant']} | {o['perplexity']:.3f} | {o['vs_float_pct']:+.2f}% | "
                    f"{t['perplexity']:.3f} | {t['vs_float_pct']:+.2f}% | {f32_cell} |")
    if "prompts" in d:
        rows += ["", *_crosscheck_replies(d)]
    versions = ", ".join(f"{k} {v}" for k, v in ref["versions"].items())
    rows += ["", f"Reference: {versions} ({ref['threads']} threads). Host: "
             f"{m['host_cpu']['model']} ({m['cpus']} cores)."]
    return "\n".join(rows)


def _crosscheck_replies(d: dict) -> list[str]:
    """The greedy-reply tables of w8a8_crosscheck: answers per implementation, agreement, and
    the first prompt's reply with its first step's top two."""
    n, first = len(d["prompts"]), d["prompts"][0]["text"]
    f32 = "transformers_float32_quotient"
    rows = [f"Greedy chat replies ({d['new_tokens']} new tokens) to the {n} prompts of "
            "`experiments/pretrained/chat_prompts.py`, each implementation from its own KV cache, "
            "after the "
            "same ChatML token ids:", "",
            *_head("variant", "mentions the answer: ours", "transformers",
                   "transformers, float32 quotient", "reply identical to transformers'",
                   "same first token as transformers")]

    def count(rep: dict, key: str) -> str:
        return f"{sum(x['correct'] for x in rep[key])}/{n}" if key in rep else "—"

    for r in d["rows"]:
        rep = r["replies"]
        pairs = list(zip(rep["ours"], rep["transformers"], strict=True))
        same = sum(a["tokens"] == b["tokens"] for a, b in pairs)
        first_same = sum(a["tokens"][:1] == b["tokens"][:1] for a, b in pairs)
        rows.append(f"| {r['variant']} | {count(rep, 'ours')} | {count(rep, 'transformers')} | "
                    f"{count(rep, f32)} | {same}/{n} | {first_same}/{n} |")

    def top2(x: dict, key: str = "first_top2") -> str:
        t = x[key]
        return " / ".join(f"`{json.dumps(s, ensure_ascii=False)}` {p:.3f}"
                          for s, p in zip(t["texts"], t["p"], strict=True))

    rows += ["", f"The reply to {json.dumps(first)}, and the first step's two most likely "
             "tokens (ours from the prefill the reply starts from, and from `score`'s "
             "whole-prompt pass):", "",
             *_head("variant", "first step: ours", "ours, whole-prompt pass",
                    "first step: transformers", "reply: ours", "reply: transformers",
                    "reply: transformers, float32 quotient")]
    for r in d["rows"]:
        rep = r["replies"]
        f32_reply = _cell(rep[f32][0]["reply"], 48) if f32 in rep else "—"
        rows.append(f"| {r['variant']} | {top2(rep['ours'][0])} | "
                    f"{top2(rep['ours'][0], 'first_top2_forward')} | "
                    f"{top2(rep['transformers'][0])} | {_cell(rep['ours'][0]['reply'], 48)} | "
                    f"{_cell(rep['transformers'][0]['reply'], 48)} | {f32_reply} |")
    return rows


def _cell(text: str, width: int = 70) -> str:
    """`text` as one markdown table cell: one line, at most `width` characters, no pipes."""
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= width else text[:width - 1] + "…"


def chat_replies(d: dict) -> str:
    m, n, lengths = d["machine"], len(d["prompts"]), d["max_new_tokens"]
    short, long = lengths[0], lengths[-1]
    first = d["prompts"][0]["text"]
    spread = {s["quant"]: s for s in d["spread"]}
    modes = list(dict.fromkeys(r["quant"] for r in d["replies"]))
    rows = [f"{d['model']} ({d['layers']} layers), greedy, the {n} prompts of "
            "`experiments/pretrained/reply_stability.py`:", "",
            *_head("mode", *(f"mentions the answer ({k} new tokens)" for k in lengths),
                   f"reply at {short} new tokens begins the one at {long}",
                   f"tokens equal to float's before they differ (median, {long})",
                   f"P(float's first token) under {d['spread'][0]['seeds'] if d['spread'] else 0}"
                   f" perturbed runs (rel {d['spread'][0]['rel'] if d['spread'] else 0:g})",
                   "runs whose first token is not float's")]
    for mode in modes:
        mine = [r for r in d["replies"] if r["quant"] == mode]
        by = {(r["prompt"], r["max_new_tokens"]): r for r in mine}
        right = [f"{sum(r['correct'] for r in mine if r['max_new_tokens'] == k)}/{n}"
                 for k in lengths]
        same = sum(by[(p["text"], long)]["tokens"][:len(by[(p["text"], short)]["tokens"])]
                   == by[(p["text"], short)]["tokens"] for p in d["prompts"])
        prefix = float(statistics.median([r.get("same_as_float_prefix", len(r["tokens"]))
                                  for r in mine if r["max_new_tokens"] == long]))
        s = spread.get(mode)
        p_cell = (f"{s['p_min']:.3f}–{s['p_max']:.3f}" if s else "—")
        flips = f"{s['argmax_not_reference']}/{s['seeds']}" if s else "—"
        rows.append(f"| {mode} | {' | '.join(right)} | {same}/{n} | {prefix:.0f} | {p_cell} | "
                    f"{flips} |")
    if "none" in spread and "top2_unperturbed" in spread["none"]:
        (a, b), s0 = spread["none"]["top2_unperturbed"], spread["none"]
        rows += ["", f"Float's first reply token to {s0['prompt']!r} (one forward pass of the "
                 f"prompt): {a['text']!r} at p = {a['p']:.3f}, the runner-up {b['text']!r} at "
                 f"{b['p']:.3f}. A perturbed run multiplies the float embedding table by "
                 f"(1 + {s0['rel']:g}·N(0, 1)) elementwise, a new seed each run."]
    rows += ["", f"The reply to {first!r} at {short} and {long} new tokens:", "",
             *_head("mode", f"{short} new tokens", f"{long} new tokens")]
    for mode in modes:
        cells = [_cell(next(r["reply"] for r in d["replies"] if r["quant"] == mode
                            and r["prompt"] == first and r["max_new_tokens"] == k))
                 for k in (short, long)]
        rows.append(f"| {mode} | {cells[0]} | {cells[1]} |")
    rows += ["", f"Host: {m['host_cpu']['model']} ({m['cpus']} cores), JAX {m['jax_version']}."]
    return "\n".join(rows)


def bench_decode(d: dict) -> str:
    m = d["machine"]
    rows = [f"{d['model']} ({d['layers']} layers), batch 1, greedy, {d['new_tokens']} new tokens "
            f"after a {d['prompt_tokens']}-token prompt, median of {d['repeats']} interleaved "
            f"runs:", "",
            *_head("variant", "layout", "KV cache", "tokens/s", "ms/token",
                   "weight bytes read/token", "KV cache bytes")]
    for r in d["variants"]:
        rows.append(f"| {r['variant']} | {r['layout'].replace('_', ' ')} | "
                    f"{'int8' if r['kv_int8'] else 'float32'} | {r['tokens_per_s']:.1f} | "
                    f"{r['ms_per_token']:.1f} | {r['weight_bytes_per_token'] / 1e6:.1f} MB | "
                    f"{r['kv_cache_bytes'] / 1e6:.1f} MB |")
    rows += ["", *_head("change (same run)", "before", "after", "speed-up")]
    for c in d["changes"]:
        rows.append(f"| {c['change']} | {c['before']} | {c['after']} | {c['speedup']:.2f}× |")
    mv = d["block_matvec"]
    ms = mv["ms"]
    padded = next(k for k in ms if k.endswith("_rows"))
    # Files written before int8 kernels were stored [out, in] have no [in, out] row.
    in_out = (f" (kernel stored [out, in]; {ms[padded + '_in_out']:.1f} ms stored [in, out])"
              if padded + "_in_out" in ms else "")
    w8 = (f"; weight-only (float row × int8 kernel): converted then dot "
          f"{ms['w8_convert_then_dot']:.1f} ms, multiply-and-sum {ms['w8_multiply_sum']:.1f} ms"
          if "w8_multiply_sum" in ms else "")
    rows += ["", f"One token through all {mv['kernels']} block kernels: float32 dot "
             f"{ms['float32_dot']:.1f} ms, int8 dot on 1 row {ms['int8_dot_1_row']:.1f} ms, "
             f"int8 dot padded to {padded.split('_')[2]} rows {ms[padded]:.1f} ms"
             f"{in_out}{w8}.", "",
             f"Host: {m['host_cpu']['model']} ({m['cpus']} cores, int8 flags "
             f"{', '.join(m['host_cpu']['int8_flags']) or 'none'}), JAX {m['jax_version']}, "
             f"1-minute load average {m['load_1min_before']:.1f} before and "
             f"{m['load_1min_after']:.1f} after."]
    return "\n".join(rows)


def _gpu_variant(r: dict) -> str:
    return (f"{r['strategy']} | {r.get('remat', 'full')} | "
            f"{r.get('attention', 'xla')}")  # files written before the variants: full / xla


def bench_gpu(d: dict) -> str:
    m = d["machine"]
    flags = f", `XLA_FLAGS={m['xla_flags']}`" if m.get("xla_flags") else ""
    rows = [f"{m['device_kind']} (JAX {m['jax_version']}{flags}), preset `{d['preset']}`"
            f"{'' if d.get('complete', True) else ' (run cut short: partial)'}:", ""]
    if d.get("attention_parity"):
        rows += [*_head("fused (cuDNN) against XLA attention, bf16", "output", "dq", "dk", "dv",
                        "within tolerance")]
        for a in d["attention_parity"]:
            sh, rel = a["shape"], a["max_rel_diff"]
            rows.append(f"| {sh['batch']}×{sh['seq']} tokens, {sh['heads']} heads / "
                        f"{sh['kv_heads']} kv, dim {sh['head_dim']} | " +
                        " | ".join(f"{rel[k]:.1e}" for k in ("out", "dq", "dk", "dv")) +
                        (f" | {a['ok']} (≤ {a['tolerance']:g}) |" if "ok" in a else " | — |"))
        rows += ["", "(largest |difference| over the XLA side's largest |value|)", ""]
    if d["training"]:
        rows += _head("strategy", "remat", "attention", "step", "tokens/s", "model TFLOP/s", "MFU",
                      "first loss", "last loss", "compiled temporaries")
        for r in d["training"]:
            if "step_s" not in r:
                why = r.get("error") or r.get("skipped")
                why = why.split(" [")[0].replace("|", "/")[:140]  # JAX's bracketed detail dropped
                rows.append(f"| {_gpu_variant(r)} | not run: {why} "
                            "| | | | | | | |")
                continue
            mfu = f"**{100 * r['mfu']:.1f}%**" if r["mfu"] is not None else "n/a (unknown peak)"
            first = f"{r['first_loss']:.4f}" if "first_loss" in r else "—"
            last = f"{r['last_loss']:.4f} ({r['updates']} updates)" if "last_loss" in r else "—"
            rows.append(f"| {_gpu_variant(r)} | {r['step_s'] * 1e3:.0f} ms | "
                        f"{r['tokens_per_s']:,.0f} | {r['model_tflops_per_s']:.0f} | {mfu} | "
                        f"{first} | {last} | {r['compiled_temp_bytes'] / 1e9:.1f} GB |")
        first = next((r for r in d["training"] if "params" in r), None)
        if first:
            rows += ["", f"{first['params'] / 1e9:.2f} B parameters, {first['tokens_per_step']:,} "
                     f"tokens per step, bf16 compute."]
    if d["matmuls"]:
        rows += ["", *_gpu_matmul_rows(d["matmuls"])]
    if d.get("inference"):
        r0 = d["inference"][0]
        base = r0["tokens_per_s"]
        rows += ["", f"One forward pass over {r0['batch']} × {r0['seq']:,} tokens (every "
                 f"position's logits), {r0['compute_dtype']} activations:", "",
                 *_head("mode", "step", "tokens/s", "vs float", "parameter bytes")]
        for r in d["inference"]:
            rows.append(f"| {r['mode']} | {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | "
                        f"{r['tokens_per_s'] / base:.2f}× | {r['param_bytes']:,} |")
    return "\n".join(rows)


def _gpu_matmul_rows(matmuls: list[dict]) -> list[str]:
    rows = _head("matmul", "bf16", "int8, kernel [in, out]", "int8 / bf16",
                 "int8, kernel [out, in]", "int8 / bf16", "compiled programs keep s8",
                 "library calls and generated kernels (bf16 / int8 / int8 [out, in])")
    for r in matmuls:
        kern = r.get("gemm_backends")
        kern = (" / ".join(", ".join(f"`{k}`" for k in kern[t]) or "—"
                           for t in ("bf16", "int8", "int8_kmajor") if t in kern)
                if kern else "not recorded")
        kmajor = (f"{r['int8_kmajor_ms']:.2f} ms ({2 * r['n'] ** 3 / r['int8_kmajor_ms'] / 1e9:.0f}"
                  f" TOP/s) | {r['int8_kmajor_speedup_vs_bf16']:.2f}×"
                  if "int8_kmajor_ms" in r else "not measured | —")
        rows.append(f"| {r['n']}³ | {r['bf16_ms']:.2f} ms ({r['bf16_tflops']:.0f} TFLOP/s) | "
                    f"{r['int8_ms']:.2f} ms ({r['int8_tops']:.0f} TOP/s) | "
                    f"{r['int8_speedup_vs_bf16']:.2f}× | {kmajor} | {r['hlo_keeps_s8']} | "
                    f"{kern} |")
    return rows


def smollm2_int8_checkpoint(d: dict) -> str:
    rows = [*_head("mode", "rules", "int8 checkpoint on disk", "float32 parameters", "smaller by",
                   "float32 checkpoint on disk (compressed)", "smaller by"),
            f"| {d['mode']} | `{','.join(d['rules'])}` | {d['int8_disk_bytes']:,} | "
            f"{d['float32_param_bytes']:,} | **{d['disk_ratio']:.2f}×** | "
            f"{d['float32_disk_bytes']:,} | {d['disk_ratio_vs_float_checkpoint']:.2f}× |"]
    if "reload_vs_in_memory_same_layout" not in d:  # written before the layout comparisons
        return "\n".join(rows)
    rows += ["", f"Scores of {d['texts']} texts, zero3 over {d['devices']} devices "
             f"(parameters read back bit-identical: {d['params_bit_identical']}):", "",
             *_head("compared", "largest Δ mean NLL", "next tokens identical")]
    for key, label in (("reload_vs_in_memory_same_layout", "int8 reload vs the in-memory int8 "
                        "model in the same zero3 shards (same program)"),
                       ("zero3_vs_one_device", "int8 reload (zero3) vs the in-memory int8 model "
                        "on one device"),
                       ("replicated_vs_one_device", "in-memory int8 model replicated on the mesh "
                        "vs on one device"),
                       ("float_zero3_vs_one_device", "float model: zero3 vs one device")):
        c = d[key]
        rows.append(f"| {label} | {c['max_abs_nll_diff']:.1e} | {c['next_tokens_identical']} |")
    return "\n".join(rows)


def smollm2_parity(d: dict) -> str:
    return (f"{d['texts']} texts: token ids identical for {d['ids_identical']}, greedy next "
            f"token identical for {d['next_identical']}, max |Δ mean NLL| "
            f"**{d['max_abs_nll_diff']:.1e}** nats (full {d['layers']}-layer model, float32)."
            + _long_parity(d.get("long_text")) + _chat_parity(d.get("chat")))


def _chat_parity(c: dict | None) -> str:
    if c is None:
        return ""
    p = c["prompts"]
    same = sum(x["identical"] for x in p)
    tied = [x for x in p if x["parted_at_near_tie"]]
    other = len(p) - same - len(tied)
    text = (f" Greedy chat replies ({c['max_new_tokens']} new tokens, KV cache) to {len(p)} "
            f"prompts: ChatML prompt ids identical to transformers' chat template for "
            f"{sum(x['template_identical'] for x in p)}, replies identical token for token for "
            f"{same}")
    if tied:
        text += (f"; {len(tied)} part where transformers' two best logits are "
                 f"{max(x['margin_where_parted'] for x in tied):.0e} apart or less (after "
                 f"{min(x['common_prefix'] for x in tied)}+ equal tokens)")
    if other:
        text += f"; {other} part elsewhere"
    return text + "."


def _long_parity(t: dict | None) -> str:
    if t is None:
        return ""
    word = {True: "identical", False: "different"}
    return (f" One text of {t['tokens']:,} tokens (the context is {t['context']:,}): ids "
            f"{word[t['ids_identical']]}, next token {word[t['next_identical']]}, |Δ mean NLL| "
            f"{t['abs_nll_diff']:.1e} nats ({t['tail_abs_nll_diff']:.1e} over its last "
            f"{t['tail']} positions).")


def finetune_smollm2(d: dict) -> str:
    c, m = d["config"], d["machine"]
    mb = 1e6
    return "\n".join([
        f"{d['steps']} steps of {d['tokens_per_step']:,} tokens ({c['train']['batch_size']} × "
        f"{c['model']['max_len']}), {d['strategy']} on {d['devices']} devices, "
        f"{c['model']['compute_dtype']} compute, remat {c['model']['remat']}, lr "
        f"{c['train']['lr']:g}; host {m['host_cpu']['model']} ({m['cpus']} cores):", "",
        *_head("held-out perplexity before", "after", "change", "val loss before → after",
               "tokens/s", "params / optimizer per device", "compiled peak per device",
               "host peak while loading"),
        f"| {d['perplexity_before']:.3f} | {d['perplexity_after']:.3f} | "
        f"**{-d['perplexity_drop_pct']:+.1f}%** | {d['val_loss_before']:.4f} → "
        f"{d['val_loss_after']:.4f} | {d['tokens_per_s']:.0f} | "
        f"{d['params_bytes_per_device'] / mb:.1f} / {d['optimizer_bytes_per_device'] / mb:.1f} MB"
        f" | {d['compiled_peak_bytes_per_device'] / mb:.0f} MB | "
        f"{d['load_peak_rss_gb']:.2f} GB (before loading {d['load_rss_before_gb']:.2f} GB; "
        f"float32 model {d['float32_model_bytes'] / 1e9:.2f} GB, largest tensor "
        f"{d['largest_tensor_gb']:.3f} GB) |"])


def equivalence_smollm2(d: dict) -> str:
    rows = [f"{d['model']}, {d['steps']} steps of {d['global_batch']} sequences of "
            f"{d['seq_len']} tokens, against {d['reference']}:", "",
            *_head("strategy", "devices", "largest loss difference", "largest parameter "
                   "difference")]
    for r in d["results"]:
        rows.append(f"| {r['strategy']} | {r['devices']} | {r['max_loss_diff']:.1e} | "
                    f"{r['max_param_diff']:.1e} |")
    return "\n".join(rows)


def embed_fidelity(d: dict) -> str:
    rows = [f"{d['n_sentences']} sentences ({d['n_calib']} other sentences for calibration), "
            f"Python {d['python']}; float parameters {d['float_param_bytes']:,} bytes:", "",
            *_head("mode", "mean cosine", "min cosine", "top-1 agreement", "top-10 overlap",
                   "param bytes")]
    for r in d["results"]:
        rows.append(f"| {r['mode']} | {r['mean_cosine']:.5f} | {r['min_cosine']:.5f} | "
                    f"{r['top1_agreement']:.3f} | {r['top10_overlap']:.3f} | "
                    f"{r['param_bytes']:,} |")
    speed = ", ".join(f"{k} {v:.0f}" for k, v in d["sentences_per_s"].items())
    worst = max(d["outliers"], key=lambda o: o["top_over_median"])
    rows += ["", f"Encoding throughput (sentences/s, this CPU): {speed}. Largest activation "
             f"outlier: input of `{worst['input_of']}` in layer {worst['layer']}, channels "
             f"{worst['top_channels']} up to {max(worst['top_absmax']):.1f} "
             f"({worst['top_over_median']:.0f}× the median channel)."]
    return "\n".join(rows)


def fault_injection(d: dict) -> str:
    rows = [f"`{d['preset']}` on {d['devices']} devices, {d['steps']} steps, a checkpoint every "
            f"{d['ckpt_every']}:", "",
            *_head("scenario", "injected", "recovered", "lost steps", "retrained steps",
                   "recovery (s)")]
    for r in d["results"]:
        rows.append(f"| {r['scenario']} | {r['injected']} | {r['recovered']} | "
                    f"{r['lost_steps']} | {r['retrained_steps']} | {r['recovery_s']:.1f} |")
    return "\n".join(rows)


def _b(psi: float | None) -> str:
    """A parameter count in billions (trillions from 1e12), 3 significant digits."""
    if not psi:
        return "—"
    return f"{psi / 1e12:.3g}T" if psi >= 1e12 else f"{psi / 1e9:.3g}B"


def plan_example(d: dict) -> str:
    q, rec = d["request"], d["recommended"]
    fits = [r for r in d["candidates"] if r["fits"]]
    rows = [f"{q['shape']} [{q['shape_note']}], {q['devices']} devices × "
            f"{q['device_memory_gb']:g} GB ({q['headroom']:.0%} headroom: "
            f"{q['usable_gb']:.3g} GB usable), seq {q['seq']}, global batch "
            f"{q['global_batch']}, {q['dtype']}; {len(d['candidates'])} candidates, "
            f"{d['counts']['compiled']} compiled, answered in {d['wall_s']:.0f} s on this "
            f"2-core machine:", "",
            *_head("rank", "strategy", "mesh", "remat", "micro-batch × steps",
                   "model state GB", "peak GB", "volume (× Ψ)", "est. s/step")]
    for i, r in enumerate(fits, 1):
        mark = "**" if rec and all(r[k] == rec[k] for k in ("strategy", "mesh", "remat",
                                                             "micro_batch")) else ""
        rows.append(f"| {i} | {mark}{r['strategy']}{mark} | {r['mesh']} | {r['remat']} | "
                    f"{r['micro_batch']} × {r['micro_steps']} | {r['model_state_gb']:.2f} | "
                    f"{r['peak_gb']:.2f} | {r['comm_volume_psi']:.2f} | "
                    f"{r['est_step_s']:.2f} |")
    counts = ", ".join(f"{v} {k}" for k, v in d["counts"].items() if v)
    rows += ["", f"Candidates: {counts}. Ranking: {q['ranking']} ({q['tflops']:g} TFLOP/s, "
             f"{q['link_gb_s']:g} GB/s)."]
    return "\n".join(rows)


def _large_blocks_vs_compiled(row: dict) -> float:
    """XLA's own buffers at the step's peak (glibc's large blocks) against the compiled peak."""
    return row["executed_large_blocks_peak_bytes"] / row["compiled_peak_bytes"] - 1


def _high_water_vs_sampled(r: dict) -> float:
    """The executed peak per device with the step read from the kernel's high-water mark, against
    the one with the step sampled."""
    inputs = r["executed_inputs_bytes"]
    return (inputs + r["executed_step_high_water_bytes"]) / r["executed_peak_bytes"] - 1


def plan_accuracy(d: dict) -> str:
    rows = _head("configuration (8 fake CPU devices)", "planner peak MB", "executed peak MB",
                 "error", "executed − planner MB", "XLA's buffers at the peak vs compiled",
                 "runtime's small allocations MB", "executable's compiled peak vs planner's")
    split = [r for r in d["results"] if "executed_large_blocks_peak_bytes" in r]
    for r in d["results"]:
        gap = (r["executed_peak_bytes"] - r["planner_peak_bytes"]) / 1e6
        has_split = "executed_large_blocks_peak_bytes" in r
        large = f"{_large_blocks_vs_compiled(r):+.1%}" if has_split else "—"
        small = f"{r['executed_small_blocks_step_bytes'] / 1e6:.2f}" if has_split else "—"
        rows.append(f"| {r['name']} | {r['planner_peak_bytes'] / 1e6:.2f} | "
                    f"{r['executed_peak_bytes'] / 1e6:.2f} | {r['error']:+.1%} | {gap:+.2f} | "
                    f"{large} | {small} | {r['executable_vs_planner']:+.3%} |")
    met = "met" if d["within_goal"] else "missed"
    rows.append(f"\nLargest |error| {d['max_abs_error']:.1%} (goal ≤ {d['goal']:.0%}: {met}).")
    if split:
        large = [_large_blocks_vs_compiled(r) for r in split]
        small = [r["executed_small_blocks_step_bytes"] / 1e6 for r in split]
        rows.append(f"Read from glibc's counts in a second step: XLA's own buffers (blocks of "
                    f"128 KiB or more) at the step's peak are within {max(map(abs, large)):.1%} "
                    f"of the compiled peak in every row; the runtime's small allocations add "
                    f"{min(small):.2f}–{max(small):.2f} MB per device.")
    watermarked = [r for r in d["results"] if "executed_step_high_water_bytes" in r]
    if watermarked:
        apart = max(abs(_high_water_vs_sampled(r)) for r in watermarked)
        rows.append(f"The kernel's high-water mark of the resident set (VmHWM, reset before the "
                    f"step; pages of shared libraries taken out) gives an executed peak within "
                    f"{apart:.2%} of the sampled one in every row: the sampling misses no peak.")
    if d.get("runtime_baseline"):
        b = d["runtime_baseline"]
        rows.append(f"Control, measured the same way: the first run of a program that holds "
                    f"almost nothing (a small vector summed over the {b['devices']} devices, "
                    f"compiled peak {b['compiled_peak_bytes'] / 1e3:.1f} KB) grows the resident "
                    f"set by {b['executed_first_run_bytes'] / 1e6:.2f} MB per device.")
    return "\n".join(rows)


def zero_table2(d: dict) -> str:
    c = d["config"]
    rows = _head("stage", "paper (model state)", "ours, model state only", "vs paper",
                 "ours, with activations (compiled)", "compiled peak GB",
                 "activations cost")
    for r in d["table2"]:
        got = r.get("compiled_psi")
        shape = f" (d {r['compiled_width']}, L {r['compiled_layers']})" if got else ""
        cost = f"{1 - got / r['state_psi']:.0%} smaller" if got else "—"
        peak = f"{r['compiled_peak_gb']:.1f}" if got else "—"
        rows.append(f"| {r['stage']} | {_b(r['paper_printed_psi'])} | {_b(r['state_psi'])} "
                    f"(d {r['state_width']}, L {r['state_layers']}) | "
                    f"{r['state_psi'] / r['paper_printed_psi'] - 1:+.1%} | {_b(got)}{shape} | "
                    f"{peak} | {cost} |")
    rows.append(f"\n64 devices × 32 GB. Ours is the largest member with widths in steps of 128 "
                f"(the next one up does not fit). With activations: seq {c['seq_len']}, "
                f"{c['micro_batch']} sequence per device per micro-step, {c['micro_steps']} "
                f"micro-steps, remat {c['remat']}, {c['dtype']} mixed precision; "
                f"{d['compiles']} compiles, {d['wall_s']:.0f} s.")
    return "\n".join(rows)


def zero_table2_planning(d: dict) -> str:
    cells = {(r["memory_gb"], r["devices"], r["stage"]): r for r in d["planning"]}
    memories = sorted({k[0] for k in cells})
    devices = sorted({k[1] for k in cells})
    stages = STAGE_ORDER
    rows = _head("devices", *(f"{m:g} GB {s}" for m in memories for s in stages))
    for n in devices:
        parts = []
        for m in memories:
            for s in stages:
                r = cells.get((m, n, s))
                if r is None:
                    parts.append("—")
                elif r["compiled"]:
                    parts.append(f"{_b(r['state_psi'])} / **{_b(r.get('compiled_psi'))}**")
                else:
                    parts.append(_b(r["state_psi"]))
        rows.append(f"| {n} | " + " | ".join(parts) + " |")
    rows.append("\nEach cell: model state only; in bold where searched by compiling, with "
                "activations (settings as above). The sharded stages need d_model divisible by "
                "the devices, so their compiled widths step by 128 up to 128 devices and by "
                "1024 at 1024 devices (coarser there).")
    return "\n".join(rows)


def _load_avg(d: dict) -> str:
    return f"load {d['load_1min']['start']:.1f}→{d['load_1min']['end']:.1f}"


def bench_encoder(d: dict) -> str:
    m, torch = d["machine"], d.get("torch")
    flags = ", ".join(m["host_cpu"]["int8_flags"]) or "no int8 dot flags"
    rows = [f"{d['n_sentences']} texts ({d['token_lengths']['min']}–"
            f"{d['token_lengths']['max']} tokens, median {d['token_lengths']['median']}), "
            f"batch {d['batch']} split over {d.get('devices', 1)} CPU device(s), median of "
            f"{d['rounds']} interleaved passes; "
            f"{m['host_cpu']['model']} ({flags}), {m['cpus']} cores, {_load_avg(d)}, "
            f"JAX {m['jax_version']}" + (f", torch {torch['torch']} ({torch['threads']} "
                                         f"threads)" if torch else "") + ":", ""]
    ratio_col = ("× PyTorch",) if torch else ()
    rows += _head("ours", "sentences/s", *ratio_col, "cosine to our float (mean / min)",
                  "compute s", "compile s (shapes)", "tokenise s", "padding")
    for r in d["results"]:
        b = r["breakdown"]
        ratio = (f"{d['ratios'][r['variant']]:.2f} |",) if torch else ()
        rows.append(f"| {r['variant']} | {r['sentences_per_s']:.0f} | {' '.join(ratio)} "
                    f"{r['mean_cosine']:.4f} / {r['min_cosine']:.4f} | {b['compute_s']:.2f} | "
                    f"{b['compile_total_s']:.1f} ({len(b['compile_s'])}) | "
                    f"{b['tokenize_s']:.3f} | {b['padding_fraction']:.0%} |")
    if torch:
        rows += ["", f"PyTorch (transformers {torch['transformers']}, the same texts sorted by "
                 f"length as sentence-transformers does): float "
                 f"{torch['float_sentences_per_s']:.0f} sentences/s, `quantize_dynamic` int8 "
                 f"{torch['int8_sentences_per_s']:.0f} sentences/s, int8 cosine to its float "
                 f"{torch['int8_cosine_mean']:.4f} / {torch['int8_cosine_min']:.4f} (mean / "
                 f"min). × PyTorch: float against its float, every int8 mode against its int8."]
    if d.get("kernels"):
        theirs = torch is not None and "torch_int8_ms" in d["kernels"][0]
        rows += ["", "One Dense layer per shape (x [M, K] → [M, N], one device, median ms): "
                 "XLA:CPU's float32 dot, its bare s8 × s8 → s32 dot, our whole int8 Dense "
                 "(per-token quantisation + s8 dot + dequantisation)"
                 + (", and PyTorch's float32 `nn.Linear` and `quantize_dynamic` int8 Linear "
                    "(FBGEMM) on the same shape:" if theirs else ":"), "",
                 *_head("M × K × N", "ours float32", "ours s8 dot", "ours int8 Dense",
                        *(("PyTorch float32", "PyTorch int8", "int8: ours / PyTorch time")
                          if theirs else ()))]
        for k in d["kernels"]:
            extra = (f" | {k['torch_float32_ms']:.2f} | {k['torch_int8_ms']:.2f} | "
                     f"{k['int8_dense_ms'] / k['torch_int8_ms']:.1f}×" if theirs else "")
            rows.append(f"| {k['m']} × {k['k']} × {k['n']} | {k['float32_ms']:.2f} | "
                        f"{k['s8_dot_ms']:.2f} | {k['int8_dense_ms']:.2f}{extra} |")
    return "\n".join(rows)


def encoder_ablations(d: dict) -> str:
    m = d["machine"]
    rows = [f"{m['host_cpu']['model']}, {m['cpus']} cores, {_load_avg(d)}; batch {d['batch']}, "
            f"median of {d['rounds']} interleaved passes:", "",
            *_head("change", "variant", "texts", "before s", "after s", "speed-up", "notes")]
    for r in d["results"]:
        notes = []
        if "padding_fraction" in r["before"]:
            notes.append(f"padding {r['before']['padding_fraction']:.0%} → "
                         f"{r['after']['padding_fraction']:.0%}, compiled lengths "
                         f"{r['before']['compiled_shapes']} → {r['after']['compiled_shapes']}")
        elif "compiled_shapes" in r["before"]:
            notes.append(f"first pass (compiles included) {r['before']['first_pass_s']:.1f} → "
                         f"{r['after']['first_pass_s']:.1f} s, shapes "
                         f"{r['before']['compiled_shapes']} → {r['after']['compiled_shapes']}")
        if "max_abs_embedding_diff" in r:
            notes.append(f"max embedding change {r['max_abs_embedding_diff']:.1e}")
        if "devices" in r:
            notes.append(f"{r['devices']} CPU devices")
        rows.append(f"| {r['change']} | {r.get('variant', 'float')} | "
                    f"{r.get('n_sentences', d.get('n_sentences', ''))} | "
                    f"{r['before']['warm_pass_s']:.2f} | {r['after']['warm_pass_s']:.2f} | "
                    f"{r['speedup_warm']:.2f}× | {'; '.join(notes)} |")
    if d.get("cli"):
        rows += ["", "`python -m experiments.embed --json` as a user runs it (default: one CPU "
                 "device per core, dp), marginal speed of the extra texts:", "",
                 *_head("--quant", "texts", "wall s", "marginal sentences/s")]
        for c in d["cli"]:
            rows.append(f"| {c['mode']} | {c['base_texts']} → {c['base_texts'] + c['extra_texts']}"
                        f" | {c['wall_s'][0]:.1f} → {c['wall_s'][1]:.1f} | "
                        f"{c['marginal_sentences_per_s']:.0f} |")
    return "\n".join(rows)


_GROUPS = {"matmul": "matmul (projections, MLP, head)", "attention": "attention (scores, "
           "mask, softmax, weighted sum)", "norms_rope_elementwise": "norms, RoPE, GELU, "
           "residuals, copies", "embedding": "embedding gather + its gradient",
           "loss": "loss (log-softmax, target pick)", "optimizer": "clipping, AdamW, update "
           "guard", "collectives": "collectives (incl. waiting for the other devices)",
           "host": "outside the traced operations (step wall time no traced execution covers)"}


def train_speed(d: dict) -> str:
    rows = _head("devices", "ours tokens/s", "PyTorch eager tokens/s", "ours / torch",
                 "model GFLOP/s", "matmul peak GFLOP/s", "of peak", "load (1 min)")
    for n, r in d["runs"].items():
        t = r.get("torch")
        theirs, ratio = (f"{t['tokens_per_s']:,.0f}", f"**{t['ratio']:.2f}×**") if t else ("—",
                                                                                     "—")
        rows.append(f"| {n} | {r['tokens_per_s']:,.0f} | {theirs} | {ratio} | "
                    f"{r['model_flops_per_s'] / 1e9:.1f} | "
                    f"{r['matmul_peak_flops_per_s'] / 1e9:.1f} | "
                    f"**{r['fraction_of_peak']:.0%}** | {r['machine']['load_avg_1min']:.1f} |")
    r = next(iter(d["runs"].values()))
    m = r["machine"]
    rows.append(f"\n`{r['preset']}` preset (d {r['model']['d_model']}, {r['model']['n_layers']} "
                f"layers, {r['params']:,} parameters), batch {r['batch']} × {r['seq_len']} "
                f"tokens, fp32, strategy {r['strategy']}; median of {r['rounds']} × "
                f"{r['steps']} timed steps, torch run between our rounds. {m['host_cpu']['model']}"
                f" ({', '.join(m['host_cpu'].get('vector_flags', [])) or 'flags not recorded'})"
                f", {m['cpus']} cores, JAX {m['jax_version']}.")
    return "\n".join(rows)


def train_breakdown(d: dict) -> str:
    runs = d["runs"]
    rows = _head("where the step's time goes", *(f"{n} device{'s' if n != '1' else ''}"
                                                  for n in runs))
    for key, label in _GROUPS.items():
        rows.append(f"| {label} | " + " | ".join(
            f"{r['breakdown']['fractions'][key]:.1%}" for r in runs.values()) + " |")
    rows.append("| step wall time (ms) | " + " | ".join(
        f"{r['median_step_s'] * 1e3:.0f}" for r in runs.values()) + " |")
    for n, r in runs.items():
        f, share = r["breakdown"]["fractions"], r["flop_shares"]
        at_matmul_rate = f["matmul"] * share["attention"] / share["matmul"]
        rows.append(f"\n{n} device(s): the matmuls do {share['matmul']:.1%} of the model FLOPs "
                    f"in {f['matmul']:.1%} of the step; attention does {share['attention']:.1%} "
                    f"in {f['attention']:.1%}, and at the matmuls' rate would take "
                    f"{at_matmul_rate:.1%}. Every other group does none of the counted FLOPs: "
                    f"{1 - f['matmul'] - f['attention']:.1%} of the step.")
        if "host" in r:
            h = r["host"]
            rows.append(f"Host, measured apart from the trace: a step call returns in "
                        f"{h['dispatch_s'] * 1e3:.2f} ms (jit dispatch), and steps enqueued back "
                        f"to back take {h['pipelined_step_s'] * 1e3:.0f} ms each against "
                        f"{r['median_step_s'] * 1e3:.0f} ms when every loss is waited for.")
    return "\n".join(rows)


def train_changes(d: dict) -> str:
    rows = _head("change", "devices", "ms/step before", "ms/step after", "wall ×",
                 "CPU ms/step before", "CPU ms/step after", "CPU ×")
    for n, r in d["runs"].items():
        for c in r["changes"]:
            rows.append(f"| {c['change']}: {c['what']} | {n} | {c['step_s_without'] * 1e3:.0f} | "
                        f"{c['step_s_with'] * 1e3:.0f} | {c['speedup']:.2f} | "
                        f"{c['cpu_s_without'] * 1e3:.0f} | {c['cpu_s_with'] * 1e3:.0f} | "
                        f"{c['cpu_speedup']:.2f} |")
        med = r["medians"]
        rows.append(f"| **all of them** | {n} | {med['without all']['step_s'] * 1e3:.0f} | "
                    f"{med['current']['step_s'] * 1e3:.0f} | **{r['speedup_all']:.2f}** | "
                    f"{med['without all']['cpu_s'] * 1e3:.0f} | "
                    f"{med['current']['cpu_s'] * 1e3:.0f} | **{r['cpu_speedup_all']:.2f}** |")
    return "\n".join(rows)


def headline(results: Path) -> str:
    """One row per area: our headline figure beside its published or independent counterpart,
    each read from the results file named in the last column."""
    rows = _head("area", "ours", "published / independent counterpart", "from")

    def row(file: str, area: str, fn) -> None:
        d = _load(file, results)
        if d is None:
            rows.append(f"| {area} | _(no {file} yet)_ | | |")
            return
        try:
            ours, theirs = fn(d)
        except (KeyError, IndexError, TypeError):  # a smaller grid (reproduce --quick)
            ours, theirs = "_(not in this results set)_", ""
        rows.append(f"| {area} | {ours} | {theirs} | `{file}` |")

    def table1(d):
        r = {x["stage"]: x for x in d["results"] if x["params"] == "7.5b" and x["n_devices"] == 64}
        return (" / ".join(f"{r[s]['model_state_gb']:.2f}" for s in STAGE_ORDER) + " GB",
                " / ".join(f"{r[s]['paper_gb']:.2f}" for s in STAGE_ORDER) + " GB (ZeRO Table 1)")

    def volume(d):
        r = {x["strategy"]: x["volume_psi"] for x in d["results"]}
        return (f"{r['dp']:.2f} / {r['zero3']:.2f} Ψ", "2 / 3 Ψ (ZeRO §7)")

    def table2(d):
        r = {x["stage"]: x for x in d["table2"]}
        return (" / ".join(f"{r[s]['state_psi'] / 1e9:.1f}B" for s in STAGE_ORDER) +
                " (with activations: " +
                " / ".join(f"{r[s]['compiled_psi'] / 1e9:.1f}B" for s in STAGE_ORDER) + ")",
                " / ".join(f"{r[s]['paper_printed_psi'] / 1e9:g}B" for s in STAGE_ORDER) +
                " (ZeRO Table 2)")

    def quant(d):
        r = {x["quant"]: x["perplexity"] for x in d["rows"]}
        return (", ".join(f"{m} {r[m]:.2f}" for m in ("none", "w8a8-tensor", "w8a8",
                                                       "smoothquant", "w8a8-rotated") if m in r),
                "SmoothQuant's ordering: per-tensor ruined, per-token degraded, smoothed ≈ "
                "float; QuaRot's: rotated ≈ float")

    def crosscheck(d):
        rows = {x["variant"]: x for x in d["rows"]}
        shown = [v for v in ("w8a8", "w8a8-rotated") if v in rows]
        ours = " / ".join(f"{rows[v]['ours']['vs_float_pct']:+.2f}%" for v in shown)
        theirs = " / ".join(f"{rows[v]['transformers']['vs_float_pct']:+.2f}%" for v in shown)
        return (f"{ours} ({' / '.join(shown)})",
                f"{theirs} (the same in transformers, same windows)")

    def encoder(d):
        r = {x["mode"]: x["mean_cosine"] for x in d["results"]}
        bench = _load("bench_encoder.json", results) or {}
        torch = bench.get("torch") or {}
        theirs = (f"{torch['int8_cosine_mean']:.4f} (`quantize_dynamic` against its own float, "
                  f"bench_encoder's texts)" if torch else "—")
        return f"{r['w8a8']:.4f} (w8a8)", theirs

    def speed(d):
        t = {n: (r.get("torch") or {}).get("ratio") for n, r in d["runs"].items()}
        t = {n: v for n, v in t.items() if v is not None}
        if not t:
            return "(no PyTorch side in this run)", "—"
        return (" / ".join(f"{v:.2f}×" for v in t.values()) +
                f" ({' / '.join(t)} devices)", "PyTorch eager, same model and batch = 1.00×")

    def enc_speed(d):
        r = d.get("ratios") or {}
        if "float" not in r:
            return "(no PyTorch side in this run)", "—"
        return (f"float {r['float']:.2f}×, w8a8 {r['w8a8']:.2f}×",
                "transformers float / `quantize_dynamic` int8 = 1.00×")

    def decode(d):
        r = {x["variant"]: x["tokens_per_s"] for x in d["variants"]}
        rotated = f", w8a8-rotated {r['w8a8-rotated']:.1f}" if "w8a8-rotated" in r else ""
        return (f"float {r['float']:.1f}, w8a8 {r['w8a8']:.1f}{rotated} tokens/s",
                "int8 should beat float (memory-bound)")

    row("zero_memory.json", "model state per device, 7.5B on 64 devices, dp / zero1 / zero2 / "
        "zero3", table1)
    row("comm_volume.json", "communication per step, dp / zero3", volume)
    row("zero_table2.json", "largest model on 64 × 32 GB, dp / zero1 / zero2 / zero3", table2)
    row("plan_accuracy.json", "planner's peak against the executed peak",
        lambda d: (f"max error {d['max_abs_error']:.1%}", "goal ≤ 10%"))
    row("equivalence.json", "every strategy against one device (fp32 loss)",
        lambda d: (f"max difference {d['fp32_max_loss_diff']:.1e}", "tolerance 1e-5"))
    row("smollm2_parity.json", "SmolLM2 float against transformers (36 texts, a long one, "
        "chat replies)",
        lambda d: (f"max Δ mean NLL {d['max_abs_nll_diff']:.1e} nats, next tokens "
                   f"{d['next_identical']}/{d['texts']}" + (
                       f"; {d['long_text']['tokens']:,}-token text: Δ "
                       f"{d['long_text']['abs_nll_diff']:.1e}" if "long_text" in d else "") + (
                       f"; greedy chat replies identical "
                       f"{sum(p['identical'] for p in d['chat']['prompts'])}/"
                       f"{len(d['chat']['prompts'])}" if "chat" in d else ""),
                   "transformers on the same GGUF"))
    row("smollm2_quant.json", "SmolLM2 perplexity, float and int8", quant)
    row("smollm2_w8a8_crosscheck.json", "SmolLM2 per-token w8a8, plain and rotated, perplexity "
        "vs float", crosscheck)
    row("embed_fidelity.json", "MiniLM int8 embeddings, mean cosine to float", encoder)
    row("finetune_smollm2.json", "SmolLM2 fine-tuned under zero3, held-out perplexity",
        lambda d: (f"{d['perplexity_before']:.2f} → {d['perplexity_after']:.2f}",
                   "goal: ≥ 10% lower"))
    row("bench_train.json", "training speed (`small`)", speed)
    row("bench_encoder.json", "MiniLM encoding speed", enc_speed)
    row("bench_decode.json", "SmolLM2 batch-1 decoding", decode)

    def gpu(d):
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

    row("bench_gpu.json", "training a 1.3B decoder on one GPU (H200, bf16)", gpu)
    return "\n".join(rows)


# Sections whose renderer reads several results files: it gets the results folder instead.
MULTI_FILE = {"headline": headline, "export_run": export_run}


SECTIONS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "main_job": ("main_job.json", main_job),
    "equivalence": ("equivalence.json", equivalence),
    "strategy_speed": ("strategy_speed.json", strategy_speed),
    "zero_memory": ("zero_memory.json", zero_memory),
    "comm_volume": ("comm_volume.json", comm_volume),
    "comm_volume_smollm2": ("comm_volume_smollm2.json", comm_volume_layers),
    "zero_memory_llama": ("zero_memory_llama.json", zero_memory),
    "zero_release": ("zero_release.json", zero_release),
    "quant_eval": ("quant_eval.json", quant_eval),
    "quant_disk_medium": ("quant_disk_medium.json", quant_eval),
    "int8_bench": ("int8_bench.json", int8_bench),
    "embed_fidelity": ("embed_fidelity.json", embed_fidelity),
    "bench_encoder": ("bench_encoder.json", bench_encoder),
    "encoder_ablations": ("encoder_ablations.json", encoder_ablations),
    "fault_injection": ("fault_injection.json", fault_injection),
    "smollm2_parity": ("smollm2_parity.json", smollm2_parity),
    "smollm2_quant": ("smollm2_quant.json", smollm2_quant),
    "smollm2_int8_checkpoint": ("smollm2_int8_checkpoint.json", smollm2_int8_checkpoint),
    "w8a8_crosscheck": ("smollm2_w8a8_crosscheck.json", w8a8_crosscheck),
    "chat_replies": ("smollm2_chat_replies.json", chat_replies),
    "bench_decode": ("bench_decode.json", bench_decode),
    "bench_gpu": ("bench_gpu.json", bench_gpu),
    "bench_gpu_no_triton": ("bench_gpu_no_triton.json", bench_gpu),
    "finetune_smollm2": ("finetune_smollm2.json", finetune_smollm2),
    "equivalence_smollm2": ("equivalence_smollm2.json", equivalence_smollm2),
    "plan_example": ("plan_7.5b_64x32gb.json", plan_example),
    "plan_accuracy": ("plan_accuracy.json", plan_accuracy),
    "zero_table2": ("zero_table2.json", zero_table2),
    "zero_table2_planning": ("zero_table2.json", zero_table2_planning),
    "train_speed": ("bench_train.json", train_speed),
    "train_breakdown": ("bench_train.json", train_breakdown),
    "train_changes": ("bench_train_changes.json", train_changes),
}


def documents(root: Path = Path(".")) -> list[Path]:
    """The markdown files whose tables `render` fills: README.md, then docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render(readme: str, results: str | Path = RESULTS) -> str:
    """`readme` with every marked table regenerated from the JSON files in `results`."""
    jobs = [(name, _load(file, results), fn, file) for name, (file, fn) in SECTIONS.items()]
    jobs += [(name, Path(results), fn, "*") for name, fn in MULTI_FILE.items()]
    for name, data, fn, file in jobs:
        body = fn(data) if data else f"_(no {SHOWN}/{file} yet: run the command above)_"
        pattern = re.compile(rf"(<!-- report:{name} -->\n)(?:.*?\n)?(<!-- /report:{name} -->)",
                             re.S)
        readme = pattern.sub(lambda m, b=body: m.group(1) + b + "\n" + m.group(2), readme)
    return readme
