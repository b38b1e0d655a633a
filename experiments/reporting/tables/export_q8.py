"""The llama_cpp_int8 table (docs/smollm2_export.md): llama.cpp's perplexity and KL divergence
from the float32 export for llama.cpp's own Q8_0 and for our int8 models exported as Q8_0."""

from __future__ import annotations

from experiments.reporting.tables.common import head


def llama_cpp_int8(d: dict) -> str:
    base = d["rows"][0]
    rows = [f"{d['label']}, {d['layers']} blocks; `llama-perplexity` ({d['llama_cpp_version']}"
            f"{', ' + d['source_package'] if d.get('source_package') else ''}) on the "
            f"validation topics of `pydoc_data`, {base['chunks']} windows of {base['ctx']} "
            f"tokens, {d['threads']} threads; KL divergence from the float32 export in nats:",
            "", *head("file", "made by", "bytes", "perplexity", "vs float32", "mean KL",
                      "median KL", "99th pct KL", "same top token")]
    for r in d["rows"]:
        change = 100.0 * (r["perplexity"] / base["perplexity"] - 1.0)
        kl = (f"{r['kl_mean']:.5f} | {r['kl_median']:.5f} | {r['kl_p99']:.4f} | "
              f"{r['top1_agree']:.1%}" if "kl_mean" in r else "– | – | – | –")
        rows.append(f"| {r['name']} | {r['made_by']} | {r['file_bytes']:,} | "
                    f"{r['perplexity']:.4f} ± {r['perplexity_uncertainty']:.4f} | "
                    f"{'–' if r is base else f'{change:+.2f}%'} | {kl} |")
    same = [r["name"] for r in d["rows"] if r is not base and r["sha256"] in
            {o["sha256"] for o in d["rows"] if o is not r}]
    if same:
        rows += ["", f"Identical files (same sha256): {', '.join(same)}."]
    return "\n".join(rows)
