"""Experiments of Gemma 3 270M (`--model gemma3-270m`): parity with transformers reading the
same GGUF, and the int8 table."""

from __future__ import annotations

from experiments.reporting.registry.claims import holds
from experiments.reporting.registry.experiment import Experiment, launcher
from experiments.reporting.registry.pretrained import embed_int8_experiment, every_mode_measured

# The table's modes, the decoding rows short: the 262k-entry vocabulary makes every evaluation
# costly on the 2-core machine.
TABLE_FLAGS = ("--model", "gemma3-270m", "--tokens", "2048", "--no-sensitivity",
               "--rotation-seeds", "0", "--no-paper-alpha", "--new-tokens", "16")

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        name="parity_gemma3",
        argv=launcher("parity_gemma3", "--out", "{results}/gemma3_parity.json"),
        outputs=("gemma3_parity.json",),
        expected_s=400, quick_expected_s=400,
        feeds="Gemma 3 270M parity with transformers",
        claim=holds(
            "gemma3_parity.json", "token ids and next tokens are identical for every text, "
            "texts past the sliding window included, and mean NLLs within 1e-3 nats",
            lambda d: d["ids_identical"] == d["next_identical"] == d["texts"]
            and d["texts_past_window"] > 0 and d["max_abs_nll_diff"] <= 1e-3)),
    Experiment(
        name="gemma3_quant",
        argv=launcher("llm_quant_table", *TABLE_FLAGS, "--out", "{results}/gemma3_quant.json"),
        quick_argv=launcher("llm_quant_table", *TABLE_FLAGS[:2], "--layers", "2", "--modes",
                            "w8a8", "--tokens", "512", "--no-sensitivity", "--rotation-seeds",
                            "0", "--no-paper-alpha", "--new-tokens", "8",
                            "--out", "{results}/gemma3_quant.json"),
        outputs=("gemma3_quant.json", "gemma3_quant.png"),
        expected_s=3600, quick_expected_s=120,
        feeds="Gemma 3 270M int8 perplexity table",
        claim=holds("gemma3_quant.json", "every mode was measured", every_mode_measured)),
    embed_int8_experiment("gemma3-270m", "gemma3", None, expected_s=900, quick_expected_s=300,
                          feeds="Gemma 3 270M with its embedding in int8"),
)
