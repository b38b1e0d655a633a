"""Tables of Gemma 3 270M: parity with transformers reading the same GGUF, and the int8 table
(rendered as SmolLM2's, with what the tied 262k-entry embedding weighs)."""

from __future__ import annotations

from experiments.reporting.tables.pretrained import smollm2_quant


def gemma3_parity(d: dict) -> str:
    return (f"{d['texts']} texts ({d['texts_past_window']} longer than the "
            f"{d['sliding_window']}-token sliding window, the longest {d['longest_tokens']} "
            f"tokens): token ids identical for {d['ids_identical']}, greedy next token identical "
            f"for {d['next_identical']}, max |Δ mean NLL| **{d['max_abs_nll_diff']:.1e}** nats "
            f"(past the window {d['max_abs_nll_diff_past_window']:.1e}; float32, transformers "
            f"{d['reference_transformers']} reading the same GGUF).")


def gemma3_quant(d: dict) -> str:
    """SmolLM2's table layout, with what the smallest int8 row keeps of the float bytes: with
    262,144 rows the tied embedding (the head too) is most of the model."""
    float_row = d["rows"][0]
    int8 = [r for r in d["rows"][1:] if r["quantized_fraction"] > 0]
    note = ""
    if int8:
        least = min(int8, key=lambda r: r["param_bytes"])
        share = least["param_bytes"] / float_row["param_bytes"]
        held = ("the blocks and the tied embedding (the head too)"
                if least["quantized_fraction"] >= 0.999 else
                f"{least['quantized_fraction']:.1%} of the parameters, the rest float")
        note = (f"\n\nThe smallest int8 row ({least['quant']}) holds {least['param_bytes']:,} of "
                f"the float model's {float_row['param_bytes']:,} bytes ({share:.3f}×), with "
                f"{held} in int8.")
    return smollm2_quant(d) + note
