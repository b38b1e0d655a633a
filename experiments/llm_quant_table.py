"""Every int8 mode on a pretrained LLM (SmolLM2-135M-Instruct): perplexity, bytes, speed.

  python -m experiments.llm_quant_table                       # writes results/smollm2_quant.json
  python -m experiments.llm_quant_table --modes w8a8,smoothquant --tokens 4096

For the float model and each mode of quant/convert.py: perplexity on the validation topics of
`pydoc_data` (as `experiments.perplexity`), its change against float, the parameter bytes as
stored, the share of parameters whose product runs in int8 and how far the int8 model's
next-token distributions lie from float's at the same positions (mean KL(float || int8) and the
share of positions with the same most likely token; `--corpus docstrings`: all on the standard
library's docstrings instead, experiments/pretrained/eval_text.py). Also the float model's
activation outliers (which Dense inputs, how large against the median channel) on the
calibration rows (per layer too, drawn into smollm2_quant.png beside the results file), and
batch-1 greedy decoding tokens/s for float, w8, w8a8 and w8a8-rotated with and without the
int8 KV cache, the eight timed interleaved in one benchmark. smoothquant and auto choose
SmoothQuant's alpha per layer and site (quant/alpha_search.py; the rows record the choice) and
run again with the paper's one alpha, 0.5, at every site. The machine is recorded beside the
figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from pathlib import Path

from tqdm import tqdm

from experiments.cli import model_flags, startup
from experiments.cli.config import ConfigError, Parser, check_output_file, fail
from experiments.pretrained import eval_text, model_ref
from experiments.reporting.plots import activation_profile
from experiments.reporting.results_io import project_relative, results_path, write_result
from model.gguf import GGUFError
from quant.modes import MODES, PAPER_ALPHA, SMOOTHING_MODES, QuantConfig, QuantError

PROG = "experiments.llm_quant_table"
OUT = results_path("smollm2_quant.json")
SPEED_MODES = ("none", "w8", "w8a8", "w8a8-rotated")


def vs_float_pct(row: dict, float_perplexity: float) -> float:
    """A row's perplexity change against the float model's, in percent."""
    return 100.0 * (row["perplexity"] / float_perplexity - 1.0)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags.add_model_flags(p, quant=False)
    model_ref.add_step_flag(p)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated int8 modes")
    p.add_argument("--tokens", type=int, default=8192, help="validation tokens per mode")
    p.add_argument("--window", type=int, default=512)
    model_flags.add_corpus_flag(p)
    p.add_argument("--new-tokens", type=int, default=64, help="decoding benchmark length")
    p.add_argument("--no-sensitivity", action="store_true",
                   help="skip w8a8 with each group of layers left float (4 more evaluations)")
    p.add_argument("--rotation-seeds", type=int, default=8,
                   help="w8a8-rotated again with the random-sign rotations of seeds 1..N (how "
                        "much its figure owes to the one rotation; 0 skips)")
    p.add_argument("--no-paper-alpha", action="store_true",
                   help=f"skip smoothquant and auto again with the paper's alpha {PAPER_ALPHA:g} "
                        f"at every site (2 more evaluations)")
    p.add_argument("--out", default=str(OUT))
    return p


def check(args) -> list[str]:
    """The flags that can be judged before the model loads; returns the int8 modes."""
    model_ref.check_step(args.model, args.step)
    model_flags.check_model_flags(args)
    modes = model_flags.parse_modes(args.modes)
    model_flags.check_window_flags(args.tokens, args.window)
    eval_text.check_corpus(args.corpus)
    if args.rotation_seeds < 0:
        raise ConfigError(f"rotation_seeds={args.rotation_seeds}: must be 0 or more")
    if args.new_tokens < 1:
        raise ConfigError(f"new_tokens={args.new_tokens}: must be a positive integer")
    check_output_file("out", args.out)
    return modes


def run(args, modes: list[str]) -> dict:
    """Float and every mode, then the extra rows; the results file is rewritten as rows come."""
    loading, scoring, decoding, outliers, pydoc_corpus, machine, alpha_search = startup.begin(
        "experiments.pretrained.loading", "experiments.pretrained.scoring",
        "experiments.pretrained.decoding", "experiments.pretrained.outliers",
        "experiments.training.pydoc_corpus", "experiments.speed.machine",
        "quant.alpha_search", devices=1)
    float_model = loading.load(args.model, args.layers, args.gguf, args.step, args.context)
    if float_model.name not in model_ref.REGISTERED:  # a path: no machine's absolute path kept
        float_model = dataclasses.replace(float_model, name=project_relative(float_model.name))
    scoring.validation_ids(float_model, args.tokens, args.window, args.corpus)
    # (refuses a --tokens beyond the text before anything is written)
    context = float_model.cfg.max_len  # a run's: the length it was trained on
    if args.new_tokens >= context:
        raise ConfigError(f"new_tokens={args.new_tokens}: must be below the model's context of "
                          f"{context}")
    # The decoding prompt: the validation text's start, cut so that the new tokens fit.
    prompt = float_model.tokenizer.encode(
        pydoc_corpus.split_text("validation")[:400])[:context - args.new_tokens]
    calib = loading.calibration_rows(float_model.tokenizer, 8)
    out = {"model": float_model.name, "gguf": args.gguf, "layers": float_model.cfg.n_layers,
           "corpus": args.corpus, "python": platform.python_version(),  # its docstrings
           "machine": machine.describe(), "alpha_grid": list(alpha_search.ALPHA_GRID),
           "outliers": outliers.activation_outliers(float_model, calib), "rows": [],
           "decoding": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # the plot comes first
    activation_profile(out["outliers"], Path(args.out).with_suffix(".png"),
                       f"{args.model}: Dense inputs of the float model, "
                       f"{len(calib)} calibration rows")

    def evaluate(mode: str, qcfg: QuantConfig | None = None) -> tuple:
        """`mode`'s model and its perplexity row, with the quantisation's seconds (calibration
        and the alpha search included) and an int8 model's divergence from the float one (KL,
        top-1 agreement: scoring.perplexity)."""
        t0 = time.perf_counter()
        pre = loading.quantize(float_model, mode, qcfg)
        quantize_s = time.perf_counter() - t0
        row = scoring.perplexity(pre, args.tokens, args.window, args.corpus,
                                 reference=None if mode == "none" else float_model)
        return pre, (row if mode == "none" else {**row, "quantize_s": quantize_s})

    for_speed = []
    for mode in tqdm(["none"] + modes, desc="modes", unit="mode"):
        pre, row = evaluate(mode)
        if pre.report and "alpha" in pre.report:  # searched: per site, one per layer
            row["alpha"] = pre.report["alpha"]
        out["rows"].append(row)
        if mode in SPEED_MODES:
            for_speed.append(pre)
        for r in out["rows"]:
            r["vs_float_pct"] = vs_float_pct(r, out["rows"][0]["perplexity"])
        write_result(args.out, out)  # after every mode: a long run keeps what it measured
    out["decoding"] = decoding.decode_speeds(for_speed, prompt, args.new_tokens)
    write_result(args.out, out)
    del for_speed
    # Each row differs from the w8a8 row (quant's default rules) by its group alone.
    groups = {name: (paths, loading.rules_without(name) + ("embed",))
              for name, paths in loading.SENSITIVITY_GROUPS.items()}
    extra_rows(args, modes, evaluate, groups, out)
    return out


def extra_rows(args, modes: list[str], evaluate, groups: dict, out: dict) -> None:
    """The rows beside the table: w8a8-rotated under other rotation seeds, the smoothing modes
    at the paper's one alpha, and w8a8 with each group of layers (`groups`: name -> (paths,
    rules leaving them float)) kept float."""
    base = out["rows"][0]["perplexity"]
    if args.rotation_seeds and "w8a8-rotated" in modes:
        out["rotation_seeds"] = []
        for seed in tqdm(range(1, args.rotation_seeds + 1), desc="w8a8-rotated seeds",
                         unit="seed"):
            _, row = evaluate("w8a8-rotated", QuantConfig(mode="w8a8-rotated",
                                                          rotation_seed=seed))
            out["rotation_seeds"].append(
                {"seed": seed, **row, "vs_float_pct": vs_float_pct(row, base)})
            write_result(args.out, out)
    smoothed = [m for m in modes if m in SMOOTHING_MODES]
    if not args.no_paper_alpha and smoothed:
        out["paper_alpha"] = []
        for mode in tqdm(smoothed, desc=f"alpha {PAPER_ALPHA:g}", unit="mode"):
            _, row = evaluate(mode, QuantConfig(mode=mode, alpha=PAPER_ALPHA))
            out["paper_alpha"].append({**row, "vs_float_pct": vs_float_pct(row, base),
                                       "alpha": PAPER_ALPHA})
            write_result(args.out, out)
    if not args.no_sensitivity and "w8a8" in modes:
        out["w8a8_sensitivity"] = []
        for name, (paths, rules) in tqdm(groups.items(), desc="w8a8 with a group float",
                                         unit="group"):
            _, row = evaluate("w8a8", QuantConfig(mode="w8a8", rules=rules))
            out["w8a8_sensitivity"].append(
                {"float_group": name, "float_paths": list(paths), **row,
                 "vs_float_pct": vs_float_pct(row, base)})
            write_result(args.out, out)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        out = run(args, check(args))
    except (ConfigError, GGUFError, QuantError) as e:
        fail(PROG, str(e).splitlines()[0])
    for r in out["rows"]:
        dv = r.get("divergence")
        print(f"{r['quant']:>13}  ppl {r['perplexity']:8.3f}  {r['vs_float_pct']:+6.2f}%  "
              f"{r['param_bytes'] / 1e6:7.1f} MB"
              + (f"  KL {dv['kl_mean']:.4f}  top-1 {dv['top1_agree']:.1%}" if dv else ""))
    return out


if __name__ == "__main__":
    main()
