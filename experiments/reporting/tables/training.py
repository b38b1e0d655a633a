"""Tables of the training runs: the main job, strategy equivalence and speed, fault
injection, and SmolLM2 fine-tuning.
"""

from __future__ import annotations

from experiments.reporting.tables.common import head


def main_job(d: dict) -> str:
    return "\n".join([
        *head("preset", "params", "devices", "steps", "val bits/byte (after reload)",
              "job time", "train", "reload + eval", "median tokens/s"),
        f"| {d['preset']} | {d['params']:,} | {d['devices']} | {d['step']} | "
        f"**{d['bits_per_byte']:.3f}** (target ≤ {d['target_bits_per_byte']}) | "
        f"**{d['job_s']:.0f} s** (budget {d['budget_s']} s) | {d['train_s']:.0f} s | "
        f"{d['reload_eval_s']:.1f} s | {d['median_tokens_per_s']:,.0f} |"])


def equivalence(d: dict) -> str:
    rows = head("precision", "strategy", "mesh", "max loss diff", "max param diff")
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
            *head("strategy", "ms/step", "× dp", "tokens/s", "peak MB/device")]
    for r in d["results"]:
        rows.append(f"| {r['strategy']} | {r['median_step_s'] * 1e3:.1f} | "
                    f"{r['ratio_to_dp']:.2f} | {r['tokens_per_s']:,.0f} | "
                    f"{r['peak_bytes'] / 1e6:.1f} |")
    return "\n".join(rows)


def fault_injection(d: dict) -> str:
    rows = [f"`{d['preset']}` on {d['devices']} devices, {d['steps']} steps, a checkpoint every "
            f"{d['ckpt_every']}:", "",
            *head("scenario", "injected", "outcome", "lost steps", "retrained steps",
                  "recovery (s)")]
    for r in d["results"]:
        injected = r["injected"] + (" (mocked)" if r.get("mocked") else "")
        rows.append(f"| {r['scenario']} | {injected} | {r['outcome']} | "
                    f"{r['lost_steps']} | {r['retrained_steps']} | {r['recovery_s']:.1f} |")
    return "\n".join(rows)


def finetune_smollm2(d: dict) -> str:
    c, m = d["config"], d["machine"]
    mb = 1e6
    return "\n".join([
        f"{d['steps']} steps of {d['tokens_per_step']:,} tokens ({c['train']['batch_size']} × "
        f"{c['model']['max_len']}), {d['strategy']} on {d['devices']} devices, "
        f"{c['model']['compute_dtype']} compute, remat {c['model']['remat']}, lr "
        f"{c['train']['lr']:g}; host {m['host_cpu']['model']} ({m['cpus']} cores):", "",
        *head("held-out perplexity before", "after", "change", "val loss before → after",
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
            *head("strategy", "devices", "largest loss difference", "largest parameter "
                  "difference")]
    for r in d["results"]:
        rows.append(f"| {r['strategy']} | {r['devices']} | {r['max_loss_diff']:.1e} | "
                    f"{r['max_param_diff']:.1e} |")
    return "\n".join(rows)

