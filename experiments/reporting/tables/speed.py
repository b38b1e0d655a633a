"""Tables of speed: the training step (against PyTorch, its breakdown and each change), MiniLM
encoding, SmolLM2 decoding and the GPU benchmark.
"""

from __future__ import annotations

from experiments.reporting.tables.common import head

_GROUPS = {"matmul": "matmul (projections, MLP, head)", "attention": "attention (scores, "
           "mask, softmax, weighted sum)", "norms_rope_elementwise": "norms, RoPE, GELU, "
           "residuals, copies", "embedding": "embedding gather + its gradient",
           "loss": "loss (log-softmax, target pick)", "optimizer": "clipping, AdamW, update "
           "guard", "collectives": "collectives (incl. waiting for the other devices)",
           "host": "outside the traced operations (step wall time no traced execution covers)"}


def train_speed(d: dict) -> str:
    rows = head("devices", "ours tokens/s", "PyTorch eager tokens/s", "ours / torch",
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
    rows = head("where the step's time goes", *(f"{n} device{'s' if n != '1' else ''}"
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
    rows = head("change", "devices", "ms/step before", "ms/step after", "wall ×",
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
    rows += head("ours", "sentences/s", *ratio_col, "cosine to our float (mean / min)",
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
                 *head("M × K × N", "ours float32", "ours s8 dot", "ours int8 Dense",
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
            *head("change", "variant", "texts", "before s", "after s", "speed-up", "notes")]
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
                 *head("--quant", "texts", "wall s", "marginal sentences/s")]
        for c in d["cli"]:
            rows.append(f"| {c['mode']} | {c['base_texts']} → {c['base_texts'] + c['extra_texts']}"
                        f" | {c['wall_s'][0]:.1f} → {c['wall_s'][1]:.1f} | "
                        f"{c['marginal_sentences_per_s']:.0f} |")
    return "\n".join(rows)


def bench_decode(d: dict) -> str:
    m = d["machine"]
    rounds = d.get("rounds", 1)  # files written before the rounds: one
    runs = f"{d['repeats']}" if rounds == 1 else f"{rounds} rounds × {d['repeats']}"
    rows = [f"{d['model']} ({d['layers']} layers), batch 1, greedy, {d['new_tokens']} new tokens "
            f"after a {d['prompt_tokens']}-token prompt, median of {runs} interleaved "
            f"runs:", "",
            *head("variant", "layout", "KV cache", "tokens/s", "ms/token",
                  "weight bytes read/token", "KV cache bytes", "cores busy")]
    for r in d["variants"]:
        busy = f"{r['cores_busy']:.2f}" if "cores_busy" in r else "–"
        # a streamed row hands its tokens to the host loop by loop, as experiments.chat
        layout = r["layout"].replace("_", " ") + (", streamed" if r.get("path") ==
                                                 "stream" else "")
        rows.append(f"| {r['variant']} | {layout} | "
                    f"{'int8' if r['kv_int8'] else 'float32'} | {r['tokens_per_s']:.1f} | "
                    f"{r['ms_per_token']:.1f} | {r['weight_bytes_per_token'] / 1e6:.1f} MB | "
                    f"{r['kv_cache_bytes'] / 1e6:.1f} MB | {busy} |")
    rows += ["", *head("change (same run)", "before", "after", "speed-up")]
    long = d.get("long_context")  # files written before the long-context rows have none
    for c in d["changes"] + (long["changes"] if long else []):
        rows.append(f"| {c['change']} | {c['before']} | {c['after']} | {c['speedup']:.2f}× |")
    if long:
        rows += ["", f"At a {long['prompt_tokens']}-token prompt (the same {d['new_tokens']} new "
                 f"tokens, the same runs):", "", *head("variant", "attention", "KV cache",
                                                       "tokens/s", "ms/token")]
        for r in long["variants"]:
            how = "XLA's" if r["variant"].endswith("-xla-attention") else "shardq's kernel"
            rows.append(f"| {r['variant']} | {how} | {'int8' if r['kv_int8'] else 'float32'} | "
                        f"{r['tokens_per_s']:.1f} | {r['ms_per_token']:.1f} |")
    rows += _bench_decode_levers(d) + _bench_decode_profile(d)
    mv = d["block_matvec"]
    ms = mv["ms"]
    padded = next(k for k in ms if k.endswith("_rows"))
    # Files written before int8 kernels were stored [out, in] have no [in, out] row.
    in_out = (f" (kernel stored [out, in]; {ms[padded + '_in_out']:.1f} ms stored [in, out])"
              if padded + "_in_out" in ms else "")
    w8 = (f"; weight-only (float row × int8 kernel): converted then dot "
          f"{ms['w8_convert_then_dot']:.1f} ms, multiply-and-sum {ms['w8_multiply_sum']:.1f} ms"
          if "w8_multiply_sum" in ms else "")
    # Files written before shardq's kernel (or on a host where it does not build) have no row.
    kernel = (f"; shardq's int8 kernel (float row in, quantised in the call) "
              f"{ms['shardq_int8_kernel']:.1f} ms" if "shardq_int8_kernel" in ms else "")
    rows += _bench_decode_prefill(d) + _bench_decode_peer(d)
    rows += ["", f"One token through all {mv['kernels']} block kernels: float32 dot "
             f"{ms['float32_dot']:.1f} ms, int8 dot on 1 row {ms['int8_dot_1_row']:.1f} ms, "
             f"int8 dot padded to {padded.split('_')[2]} rows {ms[padded]:.1f} ms"
             f"{in_out}{w8}{kernel}.", *_greedy_pick(d), "",
             f"Host: {m['host_cpu']['model']} ({m['cpus']} cores, int8 flags "
             f"{', '.join(m['host_cpu']['int8_flags']) or 'none'}), JAX {m['jax_version']}, "
             f"{_int8_kernel(d)}{_pages(d)}1-minute load average "
             f"{m['load_1min_before']:.1f} before and {m['load_1min_after']:.1f} after."]
    return "\n".join(rows)


def _pages(d: dict) -> str:
    """What the run's own process held in transparent huge pages (files before it: nothing)."""
    p = d.get("huge_pages")
    if not p or "asked" not in p:
        return ""
    held = f", {p['bytes'] / 1e6:,.0f} MB in them at the end" if p.get("bytes") is not None else ""
    return (f"{'huge pages' if p['asked'] else 'no huge pages'} asked of malloc "
            f"(kernel mode {p['thp']}){held}, ")


def _greedy_pick(d: dict) -> list[str]:
    """The greedy pick's line (files written before it, or where shardq's kernel does not
    build: none)."""
    pick = d.get("greedy_pick")
    if not pick or "shardq_kernel" not in pick["us_per_pick"]:
        return []
    us = pick["us_per_pick"]
    return ["", f"The greedy pick over {pick['vocab']:,} logits, µs per token: XLA's argmax "
                f"{us['xla_argmax']:.0f}, shardq's kernel {us['shardq_kernel']:.0f} (each with "
                f"one elementwise pass over the logits)."]


def _int8_kernel(d: dict) -> str:
    """Which build of shardq's int8 kernel ran (files written before it: nothing)."""
    k = d.get("int8_kernel")
    if not k:
        return ""
    return (f"shardq's int8 kernel built for {k['isa']}, " if k["available"]
            else f"no shardq int8 kernel ({k['reason']}), ")


def _bench_decode_levers(d: dict) -> list[str]:
    """The layout probe's choice, the XLA flag rows and the huge page rows (files written
    before them: none)."""
    rows = []
    for model, probe in (d.get("layout_probe") or {}).items():
        speeds = ", ".join(f"{k.replace('_', ' ')} {v:.1f}"
                           for k, v in probe["tokens_per_s"].items())
        rows += ["", f"Layout probe ({model}, {probe['probe_tokens']} tokens × "
                 f"{probe['probe_repeats']}, tokens/s: {speeds}): "
                 f"{'per layer' if probe['per_layer'] else 'layer scan'}."]
    flags = (d.get("xla_flags") or {}).get("rows")
    if flags:
        rows += ["", f"XLA:CPU flags, {d['xla_flags']['variant']} timed in child processes "
                 f"that differ only in `XLA_FLAGS`, alternating with a baseline child "
                 f"(the control: a second child with the baseline's own flags):", "",
                 *head("change", "flags", "tokens/s", "baseline tokens/s", "speed-up")]
        rows += [f"| {r['change']} | {f'`{fl}`' if (fl := r['xla_flags']) else '(none)'} | "
                 f"{r['tokens_per_s']:.1f} | {r['baseline_tokens_per_s']:.1f} | "
                 f"{r['speedup']:.2f}× |" for r in flags]
    pages = (d.get("huge_pages") or {}).get("rows")
    if pages:
        def mb(xs: list) -> str:  # the children's range
            if None in xs:
                return "–"
            lo, hi = f"{min(xs) / 1e6:,.0f}", f"{max(xs) / 1e6:,.0f}"
            return lo if lo == hi else f"{lo}–{hi}"
        rows += ["", "Transparent huge pages for XLA's buffers, timed in child processes that "
                 "start with glibc's malloc asking for them (`GLIBC_TUNABLES=glibc.malloc."
                 "hugetlb=1`) and without, alternating (MB in huge pages: each child's, at its "
                 "end):", "",
                 *head("variant", "tokens/s with", "tokens/s without", "speed-up",
                       "MB in huge pages with", "MB in huge pages without")]
        rows += [f"| {r['variant']} | {r['tokens_per_s']:.1f} | "
                 f"{r['without_tokens_per_s']:.1f} | {r['speedup']:.2f}× | "
                 f"{mb(r['huge_page_bytes'])} | {mb(r['without_huge_page_bytes'])} |"
                 for r in pages]
    return rows


def _bench_decode_profile(d: dict) -> list[str]:
    """Where a token's time goes: one traced decode call per profiled variant, ms per token by
    kind of operation (busy time; `experiments/speed/decode_profile.py`)."""
    prof = d.get("profile")
    if not prof:
        return []
    groups = list(next(iter(prof.values()))["ms_per_token"])
    rows = ["", "One traced decode call, ms per token by kind of operation (summed busy time), "
            "the time between operations, and operations executed per token:", "",
            *head("variant", "wall", *(g.replace("_", " ") for g in groups), "between ops",
                  "ops/token")]
    for name, b in prof.items():
        cells = " | ".join(f"{b['ms_per_token'][g]:.2f}" for g in groups)
        rows.append(f"| {name} | {b['wall_ms_per_token']:.2f} | {cells} | "
                    f"{b['between_ops_ms_per_token']:.2f} | {b['ops_per_token']:.0f} |")
    return rows


def _bench_decode_prefill(d: dict) -> list[str]:
    """Our prefill line (files written before prefill was timed have none)."""
    pre = d.get("prefill")
    if not pre:
        return []
    def speeds(last: bool) -> str:
        return ", ".join(f"{r['variant']} {r['tokens_per_s']:.0f}" for r in pre["rows"]
                         if (r.get("logits") == "last") == last)

    rows = ["", f"Prefill, one forward over a {pre['window_tokens']}-token window as scoring "
            f"runs it (logits of every position), tokens/s: {speeds(False)}."]
    # Files written before the generation rows have none.
    if any(r.get("logits") == "last" for r in pre["rows"]):
        rows[-1] += (f" As generation's prefill runs it (into a fresh KV cache, the last "
                     f"position's logits, as llama-bench's pp): {speeds(True)}.")
    return rows


def _bench_decode_peer(d: dict) -> list[str]:
    """llama.cpp beside our rows: its F32 and Q8_0 speeds and our ratios to them, only when
    the file has peer rows."""
    peer = d.get("peer") or {}
    if not peer.get("rows"):
        return []
    by = {(r["format"], r["test"]): r for r in peer["rows"]}
    tg = next((r for r in peer["rows"] if r["test"] == "tg"), None)
    pp = next((r for r in peer["rows"] if r["test"] == "pp"), None)
    built = peer.get("source_package") or f"build {peer['build_number']}, {peer['build_commit']}"
    rows = ["", f"llama.cpp ({built}) on our own "
            f"float32 GGUF export (F32) and its `llama-quantize` Q8_0, {peer['threads']} threads, "
            f"in the same run, its rounds alternating with ours; "
            f"median tokens/s:", "",
            *head("llama.cpp", "file", f"decode (tg{tg['n_gen']} at depth {tg['depth']})"
                  if tg else "decode", f"prefill (pp{pp['n_prompt']})" if pp else "prefill")]
    for fmt in dict.fromkeys(r["format"] for r in peer["rows"]):
        t, p = by.get((fmt, "tg")), by.get((fmt, "pp"))
        decode = f"{t['tokens_per_s']:.1f}" if t else "–"
        prefill = f"{p['tokens_per_s']:.0f}" if p else "–"
        rows.append(f"| {fmt} | {(t or p)['file_bytes'] / 1e6:.1f} MB | {decode} | {prefill} |")
    rows += ["", *head("ours / llama.cpp (same run)", "part", "ratio")]
    for part, key in (("decode", "decode_ratios"), ("prefill", "prefill_ratios")):
        rows += [f"| {r['ratio']} | {part} | {r['value']:.2f}× |" for r in peer.get(key, [])]
    # files written before the pairs have none
    rows += [f"| our {r['ours']} / llama.cpp {r['peer']} | decode, {r['pairs']} back-to-back "
             f"pairs: median (range) | {r['median_ratio']:.2f}× ({r['min_ratio']:.2f}–"
             f"{r['max_ratio']:.2f}) |" for r in peer.get("paired", [])]
    return rows + _weight_rates(d, by)


def _weight_rates(d: dict, peer_by: dict) -> list[str]:
    """Weight bytes each decoder reads per second (bytes per token × tokens/s): how close each
    comes to what the host's memory delivers."""
    ours = {r["variant"]: r["weight_bytes_per_token"] * r["tokens_per_s"] / 1e9
            for r in d["variants"] if r.get("devices", 1) == 1}
    theirs = {fmt: r["file_bytes"] * r["tokens_per_s"] / 1e9
              for (fmt, test), r in peer_by.items() if test == "tg"}
    if not theirs:
        return []
    cells = [f"{k} {v:.1f}" for k, v in ours.items() if k in ("float", "w8", "w8a8", "w8a8+head8")]
    cells += [f"llama.cpp {k} {v:.1f}" for k, v in theirs.items()]
    return ["", f"Weights read per second while decoding (bytes per token × tokens/s), GB/s: "
            f"{', '.join(cells)}."]


def _gpu_variant(r: dict) -> str:
    return (f"{r['strategy']} | {r.get('remat', 'full')} | "
            f"{r.get('attention', 'xla')}")  # files written before the variants: full / xla


def bench_gpu(d: dict) -> str:
    m = d["machine"]
    flags = f", `XLA_FLAGS={m['xla_flags']}`" if m.get("xla_flags") else ""
    rows = [f"{m['device_kind']} (JAX {m['jax_version']}{flags}), preset `{d['preset']}`"
            f"{'' if d.get('complete', True) else ' (run cut short: partial)'}:", ""]
    if d.get("attention_parity"):
        rows += [*head("fused (cuDNN) against XLA attention, bf16", "output", "dq", "dk", "dv",
                       "within tolerance")]
        for a in d["attention_parity"]:
            sh, rel = a["shape"], a["max_rel_diff"]
            rows.append(f"| {sh['batch']}×{sh['seq']} tokens, {sh['heads']} heads / "
                        f"{sh['kv_heads']} kv, dim {sh['head_dim']} | " +
                        " | ".join(f"{rel[k]:.1e}" for k in ("out", "dq", "dk", "dv")) +
                        (f" | {a['ok']} (≤ {a['tolerance']:g}) |" if "ok" in a else " | — |"))
        rows += ["", "(largest |difference| over the XLA side's largest |value|)", ""]
    if d["training"]:
        rows += head("strategy", "remat", "attention", "step", "tokens/s", "model TFLOP/s", "MFU",
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
                 *head("mode", "step", "tokens/s", "vs float", "parameter bytes")]
        for r in d["inference"]:
            rows.append(f"| {r['mode']} | {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | "
                        f"{r['tokens_per_s'] / base:.2f}× | {r['param_bytes']:,} |")
    if d.get("decode") or d.get("decode_skipped"):
        rows += [*([""] if rows[-1] else []),
                 *_gpu_decode_rows(d.get("decode", []), d.get("decode_skipped", {}))]
    return "\n".join(rows)


def _gpu_decode_rows(decode: list[dict], skipped: dict) -> list[str]:
    rows = []
    if decode:
        r0 = decode[0]
        rows += [f"Batch 1, every form in the {r0['layout'].replace('_', ' ')}: greedy decoding "
                 f"of {r0['new_tokens']} tokens after a prompt of {r0['prompt_tokens']}, and "
                 f"prefill of a window of {r0['prefill_window']} tokens (scoring's logits at "
                 f"every position; generation's at the last):", ""]
    rows += head("model", "form", "parameter bytes", "decode tokens/s", "decode vs bf16",
                 "stored bytes × tokens/s", "tokens as bf16's", "prefill tokens/s",
                 "prefill vs bf16", "prefill tokens/s, last position only")
    bf16 = {r["model"]: r for r in decode if r["form"] == "bf16"}
    for r in decode:
        b = bf16.get(r["model"], r)
        same = (f"{r['tokens_as_bf16']} of {r['new_tokens']}" if r["weights"] == "pretrained"
                else "— (random weights)")
        rows.append(f"| {r['model']} ({r['layers']} layers, {r['weights']} weights) | "
                    f"{r['form']} | {r['param_bytes']:,} | {r['decode_tokens_per_s']:,.1f} | "
                    f"{r['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}× | "
                    f"{r['stored_gb_per_s']:,.1f} GB/s | {same} | "
                    f"{r['prefill_tokens_per_s']:,.0f} | "
                    f"{r['prefill_tokens_per_s'] / b['prefill_tokens_per_s']:.2f}× | "
                    f"{r['prefill_last_tokens_per_s']:,.0f} |")
    for name, why in skipped.items():
        rows.append(f"| {name} | not run: {why.replace('|', '/')[:140]} | | | | | | | | |")
    why = {r["model"]: r["weights_why"] for r in decode if r.get("weights_why")}
    rows += [f"\n{name}: random weights of its shapes, since {reason}" for name, reason in
             why.items()]
    return rows


def _gpu_matmul_rows(matmuls: list[dict]) -> list[str]:
    rows = head("matmul", "bf16", "int8, kernel [in, out]", "int8 / bf16",
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

