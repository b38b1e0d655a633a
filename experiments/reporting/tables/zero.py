"""Tables of ZeRO's claims: model state per device (Table 1), communication volume, layer
release, the largest trainable model (Table 2) and the planner.
"""

from __future__ import annotations

from experiments.reporting.tables.common import STAGE_ORDER, head


def zero_memory(d: dict) -> str:
    cells = {}
    for r in d["results"]:
        cells[(r["params"], r["n_devices"], r["stage"])] = r
    models = sorted({k[0] for k in cells})
    nds = sorted({k[1] for k in cells})
    stages = STAGE_ORDER
    rows = head("params", "N_d", *(f"{s} ours / paper GB" for s in stages))
    for m in models:
        for n in nds:
            parts = []
            for s in stages:
                r = cells.get((m, n, s))
                parts.append("—" if r is None else
                             f"{r['model_state_gb']:.4g} / {r['paper_gb']:.4g}")
            rows.append(f"| {m} | {n} | " + " | ".join(parts) + " |")
    return "\n".join(rows)


def zero_memory_peak(d: dict) -> str:
    """The compiled step's whole peak per stage (model state, gradients in flight and
    activations), beside the whole-model gradient's size: what ZeRO-2 saves over ZeRO-1 is the
    gradient the step never holds whole."""
    rows = head("params", "N_d", "gradient, whole (GB)",
                *(f"{s} peak GB" for s in STAGE_ORDER), "zero1 − zero2 (× gradient)")
    cells = {(r["params"], r["n_devices"], r["stage"]): r for r in d["results"]}
    for m, n in sorted({(p, n) for p, n, _ in cells}, key=lambda k: (k[0], k[1])):
        if n == 1 or (m, n, "zero1") not in cells or (m, n, "zero2") not in cells:
            continue
        whole = cells[(m, n, "dp")]["grads_gb"] if (m, n, "dp") in cells else None
        peaks = [cells[(m, n, s)]["peak_gb"] if (m, n, s) in cells else None for s in STAGE_ORDER]
        gap = cells[(m, n, "zero1")]["peak_gb"] - cells[(m, n, "zero2")]["peak_gb"]
        rows.append(f"| {m} | {n} | {'—' if whole is None else f'{whole:.4g}'} | "
                    + " | ".join("—" if p is None else f"{p:.4g}" for p in peaks)
                    + f" | {'—' if not whole else f'{gap / whole:.2f}'} |")
    return "\n".join(rows)


def comm_volume(d: dict) -> str:
    rows = head("strategy", "volume (× Ψ)", "all-gathers in layer loop")
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
    rows += head("strategy", "volume (× Ψ)", "expected (× Ψ)", "in layer loop (× Ψ_layers)",
                 "layer gathers per step")
    for r in d["results"]:
        rows.append(f"| {r['strategy']} | {r['volume_psi']:.3f} | {r['expected_psi']:.3f} | "
                    f"{r['in_layer_loop_psi_layers']:.3f} | {r['layer_param_gathers']:.2f} |")
    return "\n".join(rows)


def zero_release(d: dict) -> str:
    c = d["config"]
    rows = [f"d_model {c['d_model']}, depths {c['depths'][0]} vs {c['depths'][1]}, "
            f"{c['devices'][0]} and {c['devices'][1]} devices, {c['dtype']}, remat {c['remat']}, "
            f"fit {c.get('fit', 'g(N) = u + s / N')}:",
            "", *head("strategy", "peak growth per added layer",
                      "of which does not shrink with N_d", "one gathered layer",
                      "gathered layers kept", "released")]
    for r in [*d["results"], *d.get("controls", [])]:
        growth = ", ".join(f"{k}: {v / 1e6:.2f} MB" for k, v in r["growth_per_layer_bytes"].items())
        rows.append(f"| {r['strategy']} | {growth} | "
                    f"{r['unsharded_growth_per_layer_bytes'] / 1e6:.2f} MB | "
                    f"{r['gathered_layer_bytes'] / 1e6:.2f} MB | "
                    f"{r['kept_gathered_layers']:.2f} | {r['released']} |")
    if d.get("shipped"):
        rows += _shipped_release(d["shipped"])
    return "\n".join(rows)


def _shipped_release(shipped: list[dict]) -> list[str]:
    # Columns only a newer run writes: the step's volume, and an unrolled preset's unroll-1
    # alternative (a dash for the presets that have none).
    volume = all("volume_psi" in r for r in shipped)
    unroll1 = any("unroll1_peak_bytes" in r for r in shipped)
    extra = (("volume (× Ψ) / expected",) if volume else ()) + (
        ("peak with scan_unroll 1 (gathers per step)",) if unroll1 else ())
    rows = ["", "The presets' zero3 steps as shipped (their own depth, unroll, remat and "
            f"batch, {shipped[0]['n_devices']} devices) beside the same step keeping "
            "every gathered layer:", "",
            *head("preset", "layers × unroll", "gathers of each layer per step",
                  "peak", "peak keeping every layer", "released", *extra)]
    for r in shipped:
        m = r["model"]
        cell = f" {r['volume_psi']:.3f} / {r['expected_volume_psi']:.3f} |" if volume else ""
        if unroll1:
            cell += (f" {r['unroll1_peak_bytes'] / 1e6:.1f} MB "
                    f"({r['unroll1_layer_param_gathers']:.2f}) |"
                    if "unroll1_peak_bytes" in r else " — |")
        rows.append(f"| {r['preset']} | {m['n_layers']} × {m['scan_unroll']} | "
                    f"{r['layer_param_gathers']:.2f} (kept: "
                    f"{r['control_layer_param_gathers']:.2f}) | "
                    f"{r['peak_bytes'] / 1e6:.1f} MB | "
                    f"{r['control_peak_bytes'] / 1e6:.1f} MB | "
                    f"{r['released']} |{cell}")
    return rows


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
            *head("rank", "strategy", "mesh", "remat", "micro-batch × steps",
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
    rows = head("configuration (8 fake CPU devices)", "planner peak MB", "executed peak MB",
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
    rows = head("stage", "paper (model state)", "ours, model state only", "vs paper",
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
    rows = head("devices", *(f"{m:g} GB {s}" for m in memories for s in stages))
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

