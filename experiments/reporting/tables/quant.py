"""Tables of the byte-level model's int8 quantisation: quality and size, and int8 speed.
"""

from __future__ import annotations

from experiments.reporting.tables.common import divergence, head


def quant_eval(d: dict) -> str:
    rows = [f"`{d['preset']}` checkpoint at step {d['step']} ({d['workdir'].split('/')[-1]}), "
            f"{d['eval_tokens']:,} validation tokens, {d['calib_batches']} calibration batches:",
            "", *head("mode", "val loss", "bits/byte", "vs float", "KL from float (mean, nats)",
                      "same top-1 byte as float", "param bytes", "Dense bytes / fp32",
                      "on disk vs fp32")]
    for r in d["rows"]:
        dense = "—" if r.get("dense_bytes_ratio") is None else f"{r['dense_bytes_ratio']:.3f}"
        disk = r.get("disk_ratio_vs_fp32")
        disk = "baseline" if disk is None else f"{disk:.2f}× smaller"
        rows.append(f"| {r['mode']} | {r['val_loss']:.5f} | {r['bits_per_byte']:.4f} | "
                    f"{r['rel_to_float'] * 100:+.3f}% | {divergence(r, '.2e', '.2%')} | "
                    f"{r['param_bytes']:,} | {dense} | {disk} |")
    return "\n".join(rows)


def int8_bench(d: dict) -> str:
    cpu = d["host_cpu"]
    host = f"host CPU {cpu['model']} (int8 flags: {', '.join(cpu['int8_flags']) or 'none'})"
    rows = [f"{d['backend']} ({d['device_kind']}), JAX {d['jax_version']}, {host}:", "",
            *head("m × k × n", "fp32 ms", "bf16 ms", "int8 dot ms (kernel [out, in] / [in, out])",
                  "int8 Dense ms", "LLM.int8() Dense ms (1/16 cap / uncapped)",
                  "int8 dot vs bf16", "int8 Dense vs fp32")]
    for r in d["matmuls"]:
        rows.append(f"| {r['m']}×{r['k']}×{r['n']} | {r['float32_ms']:.3f} | "
                    f"{r['bfloat16_ms']:.3f} | {r['int8_dot_ms']:.3f} / "
                    f"{r['int8_dot_in_out_ms']:.3f} | {r['int8_dense_ms']:.3f} | "
                    f"{r['int8_outlier_dense_ms']:.3f} / {r['int8_outlier_full_dense_ms']:.3f} | "
                    f"{r['int8_dot_speedup_vs_bf16']:.2f}× | "
                    f"{r['int8_dense_speedup_vs_f32']:.2f}× |")
    rows += ["", *head("decoding mode", "tokens/s", "× float", "param bytes")]
    for r in d["decoding"]:
        rows.append(f"| {r['mode']} (batch {r['batch']}, {r['new_tokens']} tokens) | "
                    f"{r['tokens_per_s']:,.0f} | {r['speedup_vs_float']:.2f} | "
                    f"{r['param_bytes']:,} |")
    return "\n".join(rows)

