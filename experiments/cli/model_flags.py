"""The flags every pretrained-LM launcher picks its model with, and their checks.

No JAX here: a launcher parses and checks these (and refuses bad ones, one line) before it
imports `experiments.pretrained.llm`, which starts JAX.
"""

from __future__ import annotations

import os

from experiments.cli.config import ConfigError
from experiments.pretrained import eval_text, model_ref
from quant.modes import ALL_MODES, MODES, SMOOTHING_MODES, QuantConfig, QuantError

MODELS = model_ref.REGISTERED


def add_model_flags(p, quant: bool = True) -> None:
    """--model, --layers, --context, --gguf and (unless quant=False: a launcher that runs
    several modes itself) --quant."""
    p.add_argument("--model", default="smollm2", metavar="REF",
                   help=f"the model: {model_ref.ALLOWED} (default: smollm2)")
    if quant:
        p.add_argument("--quant", default="none", help=f"one of {', '.join(ALL_MODES)}")
        p.add_argument("--alpha", type=float, default=None,
                       help=f"{', '.join(SMOOTHING_MODES)}: SmoothQuant's migration strength "
                            f"at every site, e.g. the paper's 0.5 (default: chosen per layer "
                            f"and site on the calibration data, quant/alpha_search.py)")
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N blocks (a truncated model, for quick checks)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="the context the model runs with, in tokens (default: the model's own: "
                        "a folder's max_position_embeddings, or with LongRoPE its pretraining "
                        "context; a GGUF's context_length; a run's max_len). A LongRoPE model "
                        "takes its long factors beyond its pretraining context")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="another Llama-architecture GGUF file (default: the model's package); "
                        "the same as --model PATH")


def check_model_flags(args) -> None:
    """Refuse bad flags before anything is loaded (ConfigError, one line). `--model FILE.gguf`
    becomes `--gguf FILE.gguf`, the form the loader reads."""
    ref = model_ref.resolve(args.model)
    if ref.kind == "gguf":
        if args.gguf is not None and args.gguf != args.model:
            raise ConfigError(f"gguf={args.gguf!r}: give the file once (--model {args.model!r} "
                              f"already names one)")
        args.model, args.gguf = "smollm2", args.model
    if getattr(args, "quant", "none") not in ALL_MODES:
        raise ConfigError(f"quant={args.quant!r}: allowed {', '.join(ALL_MODES)}")
    alpha = getattr(args, "alpha", None)
    if alpha is not None:
        if args.quant not in SMOOTHING_MODES:
            raise ConfigError(f"alpha: only with --quant {' or '.join(SMOOTHING_MODES)} "
                              f"(got {args.quant!r})")
        try:  # the range (nan refused too) is the config's own check
            QuantConfig(mode=args.quant, alpha=alpha).validate()
        except QuantError as e:
            raise ConfigError(str(e)) from None
    for name in ("layers", "context"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"{name}={getattr(args, name)}: must be a positive integer")
    if args.gguf is not None:
        check_gguf_path(args.gguf)


def check_gguf_path(path: str) -> None:
    """--gguf names a file (its contents are checked when it is read)."""
    if not os.path.isfile(path):
        what = "a folder, not a file" if os.path.isdir(path) else "no such file"
        raise ConfigError(f"gguf={path!r}: {what}")


def add_corpus_flag(p) -> None:
    p.add_argument("--corpus", default="pydoc",
                   help=f"the text perplexity reads: {', '.join(eval_text.CORPORA)} (default "
                        "pydoc: its validation topics; experiments/pretrained/eval_text.py)")


def check_window_flags(tokens: int, window: int) -> None:
    """--tokens and --window of the perplexity launchers, as far as they can be judged before
    the model loads (the upper bounds need the context and the corpus's token count)."""
    if window < 2:
        raise ConfigError(f"window={window}: must be at least 2")
    if tokens < window:
        raise ConfigError(f"tokens={tokens}: must be at least the window ({window})")


def parse_modes(text: str) -> list[str]:
    """A --modes flag: a comma-separated, non-empty subset of quant/modes.py's int8 modes."""
    modes = [m for m in text.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise ConfigError(f"modes={text!r}: allowed a comma-separated subset of "
                          f"{', '.join(MODES)}")
    return modes
