"""Generate text from a trained checkpoint with a KV cache.

  python -m experiments.sample --workdir runs/small --prompt "def " --max-new-tokens 100
  python -m experiments.sample --workdir runs/small --prompt "import " --temperature 0.8 --top-k 40

--temperature 0 (default) is greedy decoding. --quant MODE generates with the int8 model (the
checkpoint `experiments.quantize` wrote under WORKDIR/quant/MODE, else quantised in memory).
"""

from __future__ import annotations

import argparse
import json

from experiments import runtime
from experiments.config import fail

PROG = "experiments.sample"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
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
                   help="generate with the int8 model: none (default), w8, w8a8-tensor, w8a8, "
                        "w8a8-static, smoothquant, w8a8-outlier, auto")
    p.add_argument("--kv-int8", action="store_true",
                   help="keep the KV cache in int8 (per token and head scales)")
    return p


def main(argv: list[str] | None = None) -> str:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        fail(PROG, f"max_new_tokens={args.max_new_tokens}: must be a positive integer")
    if args.temperature < 0:
        fail(PROG, f"temperature={args.temperature}: must be >= 0 (0 = greedy)")
    if not args.prompt:
        fail(PROG, "prompt: must not be empty")
    from experiments.quantize import MODES

    if args.quant != "none" and args.quant not in MODES:
        fail(PROG, f"quant={args.quant!r}: allowed none, {', '.join(MODES)}")
    runtime.start(1)
    import jax
    import numpy as np

    from experiments.restore import load_config, restore_params
    from experiments.trainer import ConfigError
    from model.generate import generate

    try:
        cfg = load_config(args.workdir)
        run, params, step = restore_params(args.workdir, cfg, args.step, devices=1, mesh=None,
                                           strategy="dp")
        if args.quant != "none":
            from experiments.quantize import load_or_quantize

            run, params, _, _ = load_or_quantize(args.workdir, run, params, args.quant, step)
        prompt = np.frombuffer(args.prompt.encode(), np.uint8).astype(np.int32)[None]
        if prompt.shape[1] + args.max_new_tokens > cfg.model.max_len:
            raise ConfigError(f"max_new_tokens={args.max_new_tokens}: prompt ({prompt.shape[1]} "
                              f"bytes) + new tokens must fit the context of {cfg.model.max_len}")
    except ConfigError as e:
        fail(PROG, str(e))
    make_cache = None
    if args.kv_int8:
        from quant.kv_cache import init_int8_cache as make_cache
    gen = jax.jit(generate, static_argnums=(0, 3, 5, 6, 7, 8))
    out = gen(run.graphdef, params, prompt, args.max_new_tokens, jax.random.key(args.seed),
              args.temperature, args.top_k, None, make_cache)
    text = bytes(np.asarray(out[0]).astype(np.uint8).tolist()).decode("utf-8", errors="replace")
    print(json.dumps({"text": text}) if args.json else text)
    return text


if __name__ == "__main__":
    main()
