"""Tables of the pretrained models: SmolLM2 (int8 perplexity, chat replies, parity with
transformers, int8 checkpoint, export) and MiniLM's int8 embeddings.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from experiments.reporting.tables.common import SHOWN, cell, divergence, head, load

FT_QUANT = "smollm2_ft_quant.json"  # the int8 table of the fine-tuned SmolLM2
FT_PACKAGED = "smollm2_quant_window128.json"  # the packaged model's, in the same windows


def smollm2_quant(d: dict) -> str:
    m = d["machine"]
    text = {"pydoc": "validation tokens of `pydoc_data`",
            "docstrings": "tokens of the standard library's docstrings"}[d.get("corpus", "pydoc")]
    rows = [f"{d['model']} ({d['layers']} layers), perplexity on {d['rows'][0]['tokens']:,} "
            f"{text} (windows of {d['rows'][0]['window']}):", "",
            *head("mode", "perplexity", "vs float", "KL from float (mean, nats)",
                  "same top-1 token as float", "param bytes", "int8 share")]
    for r in d["rows"]:
        rows.append(f"| {r['quant']} | {r['perplexity']:.3f} | {r['vs_float_pct']:+.2f}% | "
                    f"{divergence(r)} | {r['param_bytes']:,} | "
                    f"{r['quantized_fraction']:.3f} |")
    if any("divergence" in r for r in d["rows"]):
        rows += ["", "KL from float: KL(float ‖ int8) of the next-token distributions at the "
                 "scored positions, averaged; same top-1: the share of those positions where "
                 "both models' most likely next token is the same (what greedy decoding "
                 "follows)."]
    rows += _outlier_rows(d)
    rows += _method_rows(d)
    dec = d["decoding"]  # float is always among them: never empty
    rows += ["", *head(f"decoding, batch 1 (greedy, {dec[0]['new_tokens']} new tokens, median "
                       f"of {len(dec[0]['runs_s'])} interleaved runs)", "KV cache", "tokens/s")]
    for r in dec:
        rows.append(f"| {r['quant']} | {'int8' if r['kv_int8'] else 'float'} | "
                    f"{r['tokens_per_s']:.1f} |")
    rows += ["", f"Host: {m['host_cpu']['model']} ({m['cpus']} cores, int8 flags "
             f"{', '.join(m['host_cpu']['int8_flags']) or 'none'}), JAX {m['jax_version']}."]
    return "\n".join(rows)


def _outlier_rows(d: dict) -> list[str]:
    """The largest activations of the float model and the tokens that carry them."""
    out = d["outliers"]
    cal = out["calibration"]
    rows = ["", f"Largest activations (float model, {cal['rows']} calibration rows of "
             f"{cal['tokens_per_row']} tokens): the three largest, then the largest of each other "
             f"distinct Dense input (q/k/v read one, gate/up another). A carrier is a token "
             f"whose largest input is in that channel, at a tenth of its peak or more:", "",
             *head("Dense input", "layer", "channel", "peak", "× median channel",
                   "carriers", "carriers first in their row", "carriers' text",
                   "median token's largest input")]
    order = ("q", "k", "v", "o", "gate", "up", "down")  # a block's order, for the labels

    def label(module: str) -> str:  # every Dense that reads the same input
        same = [p.split("/")[-1] for p, v in out["per_module"].items()
                if v["per_layer"] == out["per_module"][module]["per_layer"]]
        return "/".join(sorted(same, key=lambda n: (order.index(n) if n in order else 99, n)))

    # q, k and v read one input, so one activation can fill several of the top entries
    shown: list[dict] = []
    seen: set[tuple] = set()
    for e in out["top"]:
        key = (label(e["module"]), e["layer"], e["channel"])
        if len(shown) < 3 and key not in seen:
            seen.add(key)
            shown.append(e)
    for module in sorted(out["per_module"].values(), key=lambda v: -v["max"]):
        if all(module["per_layer"] != out["per_module"][e["module"]]["per_layer"]
               for e in shown):
            shown.append(module["peak"])

    for e in shown:
        c = e["carriers"]
        texts = ", ".join("`" + json.dumps(t["text"], ensure_ascii=False).replace("|", "\\|")
                          + f"` ×{t['count']}" for t in c["texts"][:3])
        rows.append(f"| {label(e['module'])} | {e['layer']} | {e['channel']} | "
                    f"{e['absmax']:.0f} | {e['ratio_to_median']:.0f}× | {c['tokens']:,} of "
                    f"{c['of']:,} | {c['first_of_row']} | {texts} | "
                    f"{e['median_token_absmax']:.2f} |")
    return rows


def _method_rows(d: dict) -> list[str]:
    """What the runs that vary one method beside the modes show: plain w8a8 with one
    group left float, SmoothQuant's searched and fixed alpha, the rotation's seeds."""
    rows: list[str] = []
    if d.get("w8a8_sensitivity"):
        w8a8 = next(r for r in d["rows"] if r["quant"] == "w8a8")
        rows += ["", f"Plain w8a8 ({w8a8['vs_float_pct']:+.2f}%) with one group of layers left "
                 f"float, all {d['layers']} layers each (the groups share an input):", "",
                 *head("left float", "perplexity", "vs float", "share of w8a8's change removed")]
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
                 *head("mode", "q/k/v (attn_norm)", "gate/up (mlp_norm)", "o (v → o)",
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
                 *head("mode", "perplexity", "vs float", "KL from float (mean, nats)",
                       "same top-1 token as float")]
        for r in d["paper_alpha"]:
            rows.append(f"| {r['quant']} (alpha {r['alpha']:g}) | {r['perplexity']:.3f} | "
                        f"{r['vs_float_pct']:+.2f}% | {divergence(r)} |")
    if d.get("rotation_seeds"):
        seeds = d["rotation_seeds"]
        h = next(r for r in d["rows"] if r["quant"] == "w8a8-rotated")
        pct = sorted(r["vs_float_pct"] for r in seeds)
        rows += ["", f"w8a8-rotated with the plain Hadamard rotation: {h['vs_float_pct']:+.2f}%; "
                 f"with random signs before it (seeds {seeds[0]['seed']}–{seeds[-1]['seed']}): "
                 f"{pct[0]:+.2f}% to {pct[-1]:+.2f}%, median "
                 f"{statistics.median(pct):+.2f}%."]
    return rows


def smollm2_ft_quant(results: Path) -> str:
    """Every int8 mode on the fine-tuned SmolLM2 beside the same mode on the packaged one
    (FT_PACKAGED of the same folder): whether the modes keep their order once the weights
    leave the 4-bit grid."""
    d = load(FT_QUANT, results)
    if d is None:
        return f"_(no {SHOWN}/{FT_QUANT} yet: run the commands above)_"
    pkg = load(FT_PACKAGED, results)
    theirs = {r["quant"]: r for r in pkg["rows"]} if pkg else {}

    def text(f: dict) -> str:
        r = f["rows"][0]
        return f"{r['tokens']:,} validation tokens of `pydoc_data` in windows of {r['window']}"

    same = pkg is not None and text(pkg) == text(d)
    rows = [f"`{d['model']}` ({d['layers']} layers), perplexity on {text(d)}; the packaged "
            f"model" + (f" (`{pkg['model']}`) on the same:" if same else
                        f" (`{pkg['model']}`): {text(pkg)}:" if pkg else
                        f": no {FT_PACKAGED} yet:"),
            "", *head("mode", "fine-tuned: perplexity", "vs its float",
                      "KL from its float (mean, nats)", "same top-1 as its float",
                      "packaged: perplexity", "vs its float", "KL from its float",
                      "same top-1")]
    for r in d["rows"]:
        p = theirs.get(r["quant"])
        other = (f"{p['perplexity']:.3f} | {p['vs_float_pct']:+.2f}% | {divergence(p)}" if p
                 else "– | – | – | –")
        rows.append(f"| {r['quant']} | {r['perplexity']:.3f} | {r['vs_float_pct']:+.2f}% | "
                    f"{divergence(r)} | {other} |")
    mine = _by_kl(d["rows"])
    shared = [m for m in mine if m in theirs]
    kept = shared == [m for m in _by_kl(list(theirs.values())) if m in shared]
    order = f"By mean KL from float, fine-tuned: {' < '.join(mine)}"
    if shared:
        order += (f"; packaged, the same modes: "
                  f"{' < '.join(m for m in _by_kl(list(theirs.values())) if m in shared)} "
                  f"({'the same order' if kept else 'a different order'})")
    rows += ["", order + "."]
    hosts = [f"fine-tuned: {_host(d)}"] + ([f"packaged: {_host(pkg)}"] if pkg else [])
    return "\n".join(rows + ["", f"Hosts: {'; '.join(hosts)}."])


def _by_kl(rows: list[dict]) -> list[str]:
    """The int8 modes of `rows` from the closest to float to the farthest (mean KL)."""
    measured = [r for r in rows if r.get("divergence")]
    return [r["quant"] for r in sorted(measured, key=lambda r: r["divergence"]["kl_mean"])]


def _host(d: dict) -> str:
    m = d["machine"]
    return f"{m['host_cpu']['model']} ({m['cpus']} cores), JAX {m['jax_version']}"


def w8a8_crosscheck(d: dict) -> str:
    ref, m = d["reference"], d["machine"]
    rows = [f"{d['model']} ({d['layers']} layers), the same {d['tokens']:,} validation tokens "
            f"(windows of {d['window']}, {d['scored']:,} positions scored) through both:", "",
            *head("variant", "ours: perplexity", "vs our float", "transformers: perplexity",
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
            *head("variant", "mentions the answer: ours", "transformers",
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
             *head("variant", "first step: ours", "ours, whole-prompt pass",
                   "first step: transformers", "reply: ours", "reply: transformers",
                   "reply: transformers, float32 quotient")]
    for r in d["rows"]:
        rep = r["replies"]
        f32_reply = cell(rep[f32][0]["reply"], 48) if f32 in rep else "—"
        rows.append(f"| {r['variant']} | {top2(rep['ours'][0])} | "
                    f"{top2(rep['ours'][0], 'first_top2_forward')} | "
                    f"{top2(rep['transformers'][0])} | {cell(rep['ours'][0]['reply'], 48)} | "
                    f"{cell(rep['transformers'][0]['reply'], 48)} | {f32_reply} |")
    return rows


def chat_replies(d: dict) -> str:
    m, n, lengths = d["machine"], len(d["prompts"]), d["max_new_tokens"]
    short, long = lengths[0], lengths[-1]
    first = d["prompts"][0]["text"]
    spread = {s["quant"]: s for s in d["spread"]}
    modes = list(dict.fromkeys(r["quant"] for r in d["replies"]))
    rows = [f"{d['model']} ({d['layers']} layers), greedy, the {n} prompts of "
            "`experiments/pretrained/reply_stability.py`:", "",
            *head("mode", *(f"mentions the answer ({k} new tokens)" for k in lengths),
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
             *head("mode", f"{short} new tokens", f"{long} new tokens")]
    for mode in modes:
        cells = [cell(next(r["reply"] for r in d["replies"] if r["quant"] == mode
                            and r["prompt"] == first and r["max_new_tokens"] == k))
                 for k in (short, long)]
        rows.append(f"| {mode} | {cells[0]} | {cells[1]} |")
    rows += ["", f"Host: {m['host_cpu']['model']} ({m['cpus']} cores), JAX {m['jax_version']}."]
    return "\n".join(rows)


def smollm2_int8_checkpoint(d: dict) -> str:
    rows = [*head("mode", "rules", "int8 checkpoint on disk", "float32 parameters", "smaller by",
                  "float32 checkpoint on disk (compressed)", "smaller by"),
            f"| {d['mode']} | `{','.join(d['rules'])}` | {d['int8_disk_bytes']:,} | "
            f"{d['float32_param_bytes']:,} | **{d['disk_ratio']:.2f}×** | "
            f"{d['float32_disk_bytes']:,} | {d['disk_ratio_vs_float_checkpoint']:.2f}× |"]
    if "reload_vs_in_memory_same_layout" not in d:  # written before the layout comparisons
        return "\n".join(rows)
    rows += ["", f"Scores of {d['texts']} texts, zero3 over {d['devices']} devices "
             f"(parameters read back bit-identical: {d['params_bit_identical']}):", "",
             *head("compared", "largest Δ mean NLL", "next tokens identical")]
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


def export_run(results: Path) -> str:
    """The export summary and, from the same results folder, its transformers parity."""
    d = load("export_run_smollm2.json", results)
    if d is None:
        return f"_(no {SHOWN}/export_run_smollm2.json yet: run the commands above)_"
    parity = load("export_run_parity.json", results) or {}
    rows = head("exported", "tensors", "bytes", "host peak before → after first/last leaf",
                "largest leaf", "ids identical", "next tokens identical",
                "largest Δ mean NLL")
    got = lambda k: parity.get(k, "—")
    nll = parity.get("max_abs_nll_diff")
    rows.append(f"| {d['source']} | {d['tensors']} | {d['bytes']:,} | "
                f"{d['peak_rss_before_bytes'] / 1e9:.2f} → {d['peak_rss_bytes'] / 1e9:.2f} GB | "
                f"{d['largest_tensor_bytes'] / 1e6:.0f} MB | {got('ids_identical')}/"
                f"{got('texts')} | {got('next_identical')}/{got('texts')} | "
                f"{'—' if nll is None else f'{nll:.1e}'} nats |")
    return "\n".join(rows)


def embed_fidelity(d: dict) -> str:
    rows = [f"{d['n_sentences']} sentences ({d['n_calib']} other sentences for calibration), "
            f"Python {d['python']}; float parameters {d['float_param_bytes']:,} bytes:", "",
            *head("mode", "mean cosine", "min cosine", "top-1 agreement", "top-10 overlap",
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


def embed_int8(d: dict) -> str:
    """The int8 modes with the embedding (the tied head) left float or made int8 too."""
    r0 = d["rows"][0]
    tied = "tied to the head" if d["tied"] else "untied"
    rows = [f"{d['model']}: embedding {d['vocab_size']:,} x {d['d_model']} ({tied}); perplexity "
            f"on {r0['tokens']:,} validation tokens of `pydoc_data` (windows of "
            f"{r0['window']}):", "",
            *head("mode", "int8 modules", "perplexity", "vs float",
                  "KL from float (mean, nats)", "same top-1 token as float", "param bytes")]
    for r in d["rows"]:
        rows.append(f"| {r['quant']} | {r.get('quantised', '–')} | {r['perplexity']:.3f} | "
                    f"{r['vs_float_pct']:+.2f}% | {divergence(r)} | {r['param_bytes']:,} |")
    return "\n".join(rows)
