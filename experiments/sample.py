"""Generate text from a trained checkpoint with a KV cache.

  python -m experiments.sample --workdir runs/small --prompt "def " --max-new-tokens 100
  python -m experiments.sample --workdir runs/small --prompt "import " --temperature 0.8 --top-k 40

--temperature 0 (default) is greedy decoding. --quant MODE generates with the int8 model (the
checkpoint `experiments.quantize` wrote under WORKDIR/quant/MODE, else quantised in memory).
The prompt is encoded, and the output decoded, with the run's tokenizer: bytes for a run
trained from random weights, the pretrained model's for a run that started from one (directly or
through --init RUN); a run whose tokenizer cannot be found is refused.
"""

from __future__ import annotations

import argparse
import functools
import json

from experiments.cli import startup
from experiments.cli.config import ConfigError, Parser, check_sampling, fail
from experiments.training import run_tokenizer
from experiments.training.config import load_config
from quant.modes import ALL_MODES, QuantError

PROG = "experiments.sample"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quant", default="none",
                   help=f"generate with the int8 model: {', '.join(ALL_MODES)} (default none)")
    p.add_argument("--kv-int8", action="store_true",
                   help="keep the KV cache in int8 (per token and head scales)")
    return p


def main(argv: list[str] | None = None) -> str:
    args = build_parser().parse_args(argv)
    if args.quant not in ALL_MODES:
        fail(PROG, f"quant={args.quant!r}: allowed {', '.join(ALL_MODES)}")
    try:
        # Only config.json (and the tokenizer it leads to) is read before the settings are
        # checked against the model.
        cfg = load_config(args.workdir)
        tokenizer = run_tokenizer.tokenizer_for(cfg.train.init)
        prompt = run_tokenizer.encode_prompt(tokenizer, args.prompt)
        check_sampling(cfg.model, prompt.shape[1], args.max_new_tokens, args.temperature,
                       args.top_k, args.seed, unit="bytes" if tokenizer is None else "tokens")
    except ConfigError as e:
        fail(PROG, str(e))
    # JAX starts here, after the flags and the work dir's config are checked.
    jax, restore, generate, kv_cache, stored = startup.begin(
        "jax", "experiments.training.restore", "model.generate", "quant.kv_cache", "quant.stored",
        devices=1)
    try:
        model = restore.restore_params(args.workdir, cfg, step=args.step, devices=1,
                                       strategy="dp")
        graphdef, params = model.graphdef, model.params
        if args.quant != "none":
            graphdef, params, _, _ = stored.load_or_quantize(
                args.workdir, args.quant, model.cfg.model, graphdef, params, mesh=model.mesh,
                sharded=False, step=model.step,
                calibration=functools.partial(restore.calibration_rows, model.cfg))
    except (ConfigError, QuantError) as e:
        fail(PROG, str(e))
    make_cache = kv_cache.init_int8_cache if args.kv_int8 else None
    gen = jax.jit(generate.generate, static_argnums=(0, 3, 5, 6, 7, 8))
    out = gen(graphdef, params, prompt, args.max_new_tokens, jax.random.key(args.seed),
              args.temperature, args.top_k, None, make_cache)
    text = run_tokenizer.decode(tokenizer, out[0])
    print(json.dumps({"text": text}) if args.json else text)
    return text


if __name__ == "__main__":
    main()
