"""Experiments of the pretrained models: SmolLM2's int8 perplexity, chat replies, parity with
transformers, int8 checkpoint and export; MiniLM's int8 embeddings."""

from __future__ import annotations

import math

from experiments.reporting.registry.claims import holds, perplexity
from experiments.reporting.registry.experiment import Experiment, launcher
from quant.modes import EMBED_BLOCK, MODES

# The bound on what int8 of the embedding may add to perplexity, in percent.
EMBED_BUDGET_PCT = 0.1

# The fine-tuned model's table and the packaged one beside it: the modes alone, in windows of
# the run's context (max_len: 128, and 32 in the quick run).
_MODES_ONLY = ("--new-tokens", "8", "--rotation-seeds", "0", "--no-paper-alpha",
               "--no-sensitivity")
FT_TABLE_FLAGS = ("--window", "128", *_MODES_ONLY)
FT_TABLE_QUICK_FLAGS = ("--modes", "w8a8", "--tokens", "512", "--window", "32", *_MODES_ONLY)

def every_mode_measured(d: dict) -> bool:
    """Finite perplexities, and each int8 row's divergence from float in range."""
    return all(math.isfinite(r["perplexity"]) and (
        r["quant"] == "none" or (r["divergence"]["kl_mean"] >= 0
                                 and 0 <= r["divergence"]["top1_agree"] <= 1))
        for r in d["rows"])


def embed_int8_holds(d: dict, budget: bool = True) -> bool:
    """`experiments.embed_int8`'s rows: every one measured; each mode with its embedding in int8
    stores fewer bytes than with the blocks alone; and (`budget`) the block-scaled table alone
    (quant's default table, the blocks float: its own cost, which per-token int8's run-to-run
    movement of a few tenths of a percent does not blur) costs at most `EMBED_BUDGET_PCT` of
    perplexity."""
    if not every_mode_measured(d):
        return False
    by = {(r["quant"], r.get("quantised")): r for r in d["rows"][1:]}
    for (mode, label), r in by.items():
        if label.startswith("blocks+embed") and (
                r["param_bytes"] >= by[(mode, "blocks")]["param_bytes"]):
            return False
    alone = [r for (_, label), r in by.items() if label == f"embed/{EMBED_BLOCK}"]
    return not budget or (len(alone) == 1 and alone[0]["vs_float_pct"] <= EMBED_BUDGET_PCT)


def embed_int8_experiment(model: str, stem: str, tokens: int | None, *, expected_s: float,
                          quick_expected_s: float, feeds: str, window: int | None = None,
                          off_grid: float = 0.0, after: tuple[str, ...] = (),
                          budget: bool = True) -> Experiment:
    """`experiments.embed_int8` on `model` (its table in {stem}_embed_int8.json); `tokens`:
    validation tokens per row (None: the launcher's default); `window`: the scoring window
    (None: the launcher's default); `off_grid`: the launcher's --off-grid; `budget`: whether
    the claim includes the perplexity bound."""
    out = f"{{results}}/{stem}_embed_int8.json"
    win = (("--window", str(window)) if window is not None else ()) + (
        ("--off-grid", str(off_grid)) if off_grid else ())
    full = (("--tokens", str(tokens)) if tokens is not None else ()) + win
    return Experiment(
        name=f"{stem}_embed_int8",
        argv=launcher("embed_int8", "--model", model, *full, "--out", out),
        quick_argv=launcher("embed_int8", "--model", model, "--tokens", "512", *win,
                            "--out", out),
        outputs=(f"{stem}_embed_int8.json",), expected_s=expected_s,
        quick_expected_s=quick_expected_s, feeds=feeds, after=after,
        claim=holds(f"{stem}_embed_int8.json", "every row was measured and int8 of the "
                    "embedding stores fewer bytes than the blocks alone" + (
                        f", and its block-scaled table alone costs at most "
                        f"{EMBED_BUDGET_PCT}% perplexity" if budget else ""),
                    lambda d: embed_int8_holds(d, budget)))


def q8_rows_hold(d: dict) -> bool:
    """`experiments.llama_cpp_int8`'s rows: the float32 reference first, every file read over
    the same windows, figures in range, and Q8_0 files near a quarter of float32's bytes."""
    base, rows = d["rows"][0], d["rows"][1:]
    return bool(rows) and base["name"] == "float32" and all(
        math.isfinite(r["perplexity"]) and (r["chunks"], r["ctx"]) == (base["chunks"],
                                                                       base["ctx"])
        for r in d["rows"]) and all(
        r["kl_mean"] >= 0 and 0 <= r["top1_agree"] <= 1
        and r["file_bytes"] <= 0.3 * base["file_bytes"] for r in rows)


EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        name="llm_quant_table",
        argv=launcher("llm_quant_table", "--out", "{results}/smollm2_quant.json"),
        quick_argv=launcher("llm_quant_table", "--layers", "4", "--modes", "w8a8",
                            "--tokens", "512", "--new-tokens", "8",
                            "--out", "{results}/smollm2_quant.json"),
        outputs=("smollm2_quant.json", "smollm2_quant.png"),
        expected_s=1000, quick_expected_s=30,
        feeds="SmolLM2 int8 perplexity table and activation plot",
        claim=holds(
            "smollm2_quant.json", "every mode was measured (finite perplexities, and each int8 "
            "mode's divergence from float: a mean KL of at least 0, a top-1 agreement in [0, 1])",
            every_mode_measured,
            full_only=("smoothquant, auto and w8a8-rotated are within 1% of float, and smoothquant "
                       "is no worse than plain per-token w8a8",
                       lambda d: all(r["vs_float_pct"] <= 1.0 for r in d["rows"]
                                     if r["quant"] in ("smoothquant", "auto", "w8a8-rotated"))
                       and perplexity(d, "smoothquant") <= perplexity(d, "w8a8"))),
    ),
    embed_int8_experiment("smollm2", "smollm2", 8192, expected_s=600, quick_expected_s=120,
                          feeds="SmolLM2 with its tied embedding and head in int8"),
    # The packaged table is Q8_0 (blocks of 32): int8 blocks of 32 hold it exactly. Moved off
    # that grid by a block step of noise, it measures what they cost on a table that never was
    # on one; the fine-tuned run's, trained a few steps off it, what they cost there.
    embed_int8_experiment("smollm2", "smollm2_offgrid", 8192, off_grid=1.0, expected_s=700,
                          quick_expected_s=120,
                          feeds="SmolLM2 with its table off the int8 grid, the table in int8"),
    embed_int8_experiment("{runs}/finetune-smollm2", "smollm2_ft", 8192, window=128,
                          expected_s=900, quick_expected_s=60, after=("finetune_smollm2",),
                          budget=False,
                          feeds="the fine-tuned SmolLM2 with its tied embedding and head in int8"),
    # The same table on the fine-tuned model, whose weights are off the packaged 4-bit grid,
    # beside the packaged model at the same windows: the run's context (its max_len) is 128.
    # Only the mode rows; the decoding rows, which the launcher cannot leave out, run short.
    Experiment(
        name="smollm2_quant_window128",
        argv=launcher("llm_quant_table", *FT_TABLE_FLAGS,
                      "--out", "{results}/smollm2_quant_window128.json"),
        quick_argv=launcher("llm_quant_table", "--layers", "2", *FT_TABLE_QUICK_FLAGS,
                            "--out", "{results}/smollm2_quant_window128.json"),
        outputs=("smollm2_quant_window128.json", "smollm2_quant_window128.png"),
        expected_s=600, quick_expected_s=30,
        feeds="the packaged SmolLM2's int8 table at the fine-tuned run's context",
        claim=holds("smollm2_quant_window128.json", "every mode was measured",
                    every_mode_measured),
    ),
    Experiment(
        name="smollm2_ft_quant",
        argv=launcher("llm_quant_table", "--model", "{runs}/finetune-smollm2", *FT_TABLE_FLAGS,
                      "--out", "{results}/smollm2_ft_quant.json"),
        quick_argv=launcher("llm_quant_table", "--model", "{runs}/finetune-smollm2",
                            *FT_TABLE_QUICK_FLAGS, "--out", "{results}/smollm2_ft_quant.json"),
        outputs=("smollm2_ft_quant.json", "smollm2_ft_quant.png"),
        expected_s=600, quick_expected_s=30,
        feeds="SmolLM2 int8 table on the fine-tuned weights, beside the packaged model's",
        after=("finetune_smollm2", "smollm2_quant_window128"),
        claim=holds(
            "smollm2_ft_quant.json", "the model is the fine-tuning run's folder and every mode "
            "was measured (as for llm_quant_table)",
            lambda d: d["model"].endswith("finetune-smollm2") and every_mode_measured(d),
            full_only=("the table covers float and every int8 mode of quant/",
                       lambda d: [r["quant"] for r in d["rows"]] == ["none", *MODES])),
    ),
    Experiment(
        name="chat_replies",
        argv=launcher("chat_replies", "--out", "{results}/smollm2_chat_replies.json"),
        quick_argv=launcher("chat_replies", "--layers", "2", "--modes", "w8a8", "--prompts", "2",
                            "--max-new-tokens", "4,8", "--seeds", "2",
                            "--out", "{results}/smollm2_chat_replies.json"),
        outputs=("smollm2_chat_replies.json",),
        expected_s=900, quick_expected_s=60,
        feeds="SmolLM2 int8 chat replies table",
    ),
    Experiment(
        name="parity_smollm2",
        argv=launcher("parity_smollm2", "--out", "{results}/smollm2_parity.json"),
        quick_argv=launcher("parity_smollm2", "--no-long",
                            "--out", "{results}/smollm2_parity.json"),
        outputs=("smollm2_parity.json",),
        expected_s=150, quick_expected_s=30,
        feeds="SmolLM2 parity with transformers",
        claim=holds(
            "smollm2_parity.json", "token ids and next tokens are identical, mean NLLs within "
            "1e-4 nats, chat prompt ids identical and greedy replies identical but at near ties",
            lambda d: d["ids_identical"] == d["next_identical"] == d["texts"]
            and d["max_abs_nll_diff"] <= 1e-4
            and all(p["template_identical"] and (p["identical"] or p["parted_at_near_tie"])
                    for p in d["chat"]["prompts"]),
            full_only=("the same holds for the long text (the quick run skips it)",
                       lambda d: d["long_text"]["ids_identical"]
                       and d["long_text"]["next_identical"]
                       and d["long_text"]["abs_nll_diff"] <= 1e-4
                       and d["long_text"]["tail_abs_nll_diff"] <= 1e-4)),
    ),
    Experiment(
        name="llm_int8_checkpoint",
        argv=launcher("llm_int8_checkpoint",
                      "--json-out", "{results}/smollm2_int8_checkpoint.json"),
        quick_argv=launcher("llm_int8_checkpoint", "--devices", "2",
                            "--json-out", "{results}/smollm2_int8_checkpoint.json"),
        outputs=("smollm2_int8_checkpoint.json",),
        expected_s=120, quick_expected_s=70,
        feeds="SmolLM2 int8 checkpoint size and zero3 reload table",
        claim=holds(
            "smollm2_int8_checkpoint.json", "the int8 checkpoint is at least 3.5x smaller than the "
            "float32 parameters and reads back bit-identical, scoring as the in-memory model",
            lambda d: d["disk_ratio"] >= 3.5 and d["params_bit_identical"] is True
            and d["reload_vs_in_memory_same_layout"]["max_abs_nll_diff"] == 0.0
            and d["reload_vs_in_memory_same_layout"]["next_tokens_identical"] is True),
    ),
    Experiment(
        name="w8a8_crosscheck",
        argv=launcher("w8a8_crosscheck", "--json-out", "{results}/smollm2_w8a8_crosscheck.json"),
        quick_argv=launcher("w8a8_crosscheck", "--layers", "2", "--tokens", "1024",
                            "--new-tokens", "4",
                            "--json-out", "{results}/smollm2_w8a8_crosscheck.json"),
        outputs=("smollm2_w8a8_crosscheck.json",),
        expected_s=600, quick_expected_s=180,
        feeds="SmolLM2 w8a8 against transformers' W8A8",
        needs="torch",
        claim=holds(
            "smollm2_w8a8_crosscheck.json",
            "the two float models agree (mean NLL within 1e-4 nats)",
            lambda d: abs(d["rows"][0]["ours"]["nll"] - d["rows"][0]["transformers"]["nll"])
            <= 1e-4 and d["rows"][0]["variant"] == "none",
            full_only=("plain and rotated per-token w8a8 change perplexity alike in both "
                       "implementations (within 0.5 points)",
                       lambda d: all(abs(r["ours"]["vs_float_pct"]
                                         - r["transformers"]["vs_float_pct"]) <= 0.5
                                     for r in d["rows"]
                                     if r["variant"] in ("w8a8", "w8a8-rotated")))),
    ),
    Experiment(
        name="embed_fidelity",
        argv=launcher("embed_fidelity", "--json", "--out", "{results}/embed_fidelity.json"),
        quick_argv=launcher("embed_fidelity", "--json", "--sentences", "16", "--calib", "8",
                            "--modes", "w8a8", "--out", "{results}/embed_fidelity.json"),
        outputs=("embed_fidelity.json",),
        expected_s=300, quick_expected_s=15,
        feeds="MiniLM int8 fidelity table",
    ),
    # A fine-tuned run exported in both formats, then scored by transformers (the safetensors
    # folder) and by our loader (the GGUF file): the export_run table. Every step needs the
    # PyTorch side, so that a machine without it does not rewrite half of the table's sources.
    Experiment(
        name="export_train",
        argv=launcher("train", "--preset", "smollm2", "--steps", "2", "--ckpt-every", "2",
                      "--eval-every", "2", "--eval-batches", "1", "--devices", "8",
                      "--workdir", "{runs}/ft-export", "--no-progress"),
        quick_argv=launcher("train", "--preset", "smollm2", "--n-layers", "2", "--max-len", "32",
                            "--batch-size", "8", "--steps", "1", "--warmup-steps", "0",
                            "--ckpt-every", "1", "--eval-every", "1", "--eval-batches", "1",
                            "--devices", "2", "--workdir", "{runs}/ft-export", "--no-progress"),
        outputs=(),
        expected_s=240, quick_expected_s=20,
        feeds="the run the export table exports",
        needs="torch",
        fresh=("{runs}/ft-export",),
    ),
    Experiment(
        name="export_safetensors",
        argv=launcher("export", "--workdir", "{runs}/ft-export", "--format", "safetensors",
                      "--out", "{runs}/exports/ft-export", "--force",
                      "--record", "{results}/export_run_smollm2.json"),
        outputs=("export_run_smollm2.json",),
        expected_s=60, quick_expected_s=10,
        feeds="export table: the Hugging Face folder",
        needs="torch",
        after=("export_train",),
    ),
    Experiment(
        name="export_gguf",
        argv=launcher("export", "--workdir", "{runs}/ft-export", "--format", "gguf",
                      "--out", "{runs}/exports/ft-export-gguf", "--force"),
        outputs=(),
        expected_s=60, quick_expected_s=10,
        feeds="export table: the GGUF file",
        needs="torch",
        after=("export_train",),
    ),
    Experiment(
        name="export_reference",
        argv=("experiments/reference/check_export_reference.py", "--dir",
              "{runs}/exports/ft-export", "--texts-from",
              "tests/fixtures/smollm2_reference.json",
              "--out", "{results}/export_run_transformers.json"),
        outputs=("export_run_transformers.json",),
        expected_s=120, quick_expected_s=10,
        feeds="export table: transformers scores the exported folder",
        needs="torch",
        after=("export_safetensors",),
        env=(("HF_HUB_OFFLINE", "1"),),
    ),
    Experiment(
        name="export_parity",
        argv=launcher("parity_smollm2", "--gguf", "{runs}/exports/ft-export-gguf/model.gguf",
                      "--fixture", "{results}/export_run_transformers.json", "--no-long",
                      "--out", "{results}/export_run_parity.json"),
        outputs=("export_run_parity.json",),
        expected_s=150, quick_expected_s=10,
        feeds="export table: our loader scores the exported GGUF against transformers",
        needs="torch",
        after=("export_gguf", "export_reference"),
        claim=holds(
            "export_run_parity.json", "our loader's scores of the exported GGUF match "
            "transformers' of the exported folder (ids and next tokens identical, mean NLLs "
            "within 1e-4 nats)",
            lambda d: d["ids_identical"] == d["next_identical"] == d["texts"]
            and d["max_abs_nll_diff"] <= 1e-4),
    ),
    # llama.cpp's perplexity of our int8 models exported as Q8_0 beside its own Q8_0; the
    # launcher needs llama.cpp's tools ($SHARDQ_LLAMA_CPP) and exits 2 without them.
    Experiment(
        name="llama_cpp_int8",
        argv=launcher("llama_cpp_int8", "--out", "{results}/llama_cpp_int8.json"),
        quick_argv=launcher("llama_cpp_int8", "--layers", "2", "--modes", "w8a8",
                            "--chunks", "2", "--out", "{results}/llama_cpp_int8.json"),
        outputs=("llama_cpp_int8.json",), needs="llama_cpp",
        expected_s=600, quick_expected_s=60,
        feeds="llama.cpp's perplexity of our Q8_0 exports (docs/smollm2_export.md)",
        claim=holds("llama_cpp_int8.json", "every file was measured on the same windows (finite "
                    "perplexity; KL from float32 non-negative, top-1 agreement in [0, 1]) and "
                    "each Q8_0 file is at most 30% of the float32 one", q8_rows_hold)),
)
