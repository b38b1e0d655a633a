"""How fast a pretrained LM decodes: batch-1 greedy tokens per second from the KV cache.

Each `DecodeVariant` is a model (float or int8) with its cache kind and layer layout; the
variants' timed runs interleave so that a change in the machine's load hits them alike.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import resource
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.cli.config import ConfigError
from experiments.pretrained.loading import Pretrained, for_decoding
from experiments.speed.gc_pause import gc_paused, timed_call
from experiments.speed.interleaving import round_order
from model.flops import param_bytes
from model.generate import decode_steps, default_per_layer, prefill, sample_token, stream
from parallel.decode_split import split_params
from quant import native_int8
from quant.dense import use_grouped, use_native
from quant.kv_cache import init_int8_cache


@dataclasses.dataclass(frozen=True)
class DecodeVariant:
    """One way to decode: a (possibly int8) model, its KV cache kind and its layer layout."""
    name: str
    model: Pretrained
    kv_int8: bool = False
    per_layer: bool | None = None  # False: the layer scan; None: model.generate's default
    devices: int = 1  # >1: each step split over that many devices (parallel/decode_split.py)
    # False: XLA's operations instead of shardq's kernels (quant.native_int8, model.native_float,
    # model.native_attention, model.native_argmax)
    kernels: bool = True
    # True: as experiments.chat decodes (model.generate.stream: short loops whose tokens reach
    # the host loop by loop), instead of one lax.scan over the tokens
    streamed: bool = False
    # False: each int8 kernel in its own call, where those that read one input (q/k/v,
    # gate/up) share one by default (quant.dense.QuantDense.shared_call)
    grouped: bool = True
    # False: XLA's attention over the cache instead of shardq's kernel (the rest unchanged)
    attention_kernel: bool = True


def decoding_model(v: DecodeVariant, kernels: bool, made: dict | None = None) -> Pretrained:
    """`for_decoding` of `v`'s model, its weights made once per model and `kernels` switch in
    `made` where given: variants of one float model (the attention switch changes the graph
    only) then share one copy of its kernels stored for decoding ([out, in]), not one each."""
    if made is None:
        return for_decoding(v.model, kernels, v.attention_kernel)
    key = (id(v.model), kernels)
    if key not in made:  # the model is kept with its copy, so its id is not reused meanwhile
        made[key] = (v.model, for_decoding(v.model, kernels))
    base = made[key][1]
    # switched already: the same arrays, with attention in XLA's operations where asked
    return base if v.attention_kernel else for_decoding(base, kernels, attention=False)


def streamed_program(v: DecodeVariant, prompt: list[int], new_tokens: int,
                     made: dict | None = None):
    """(timed, args) for a streamed variant: `timed(params)` runs `model.generate.stream` as
    chat does and returns ([1, new_tokens] tokens, seconds from the first token to the last):
    `new_tokens - 1` streamed steps, the prefill and its compile excluded as chat excludes
    them."""
    pre, ids = decoding_model(v, v.kernels, made), np.asarray([prompt], np.int32)
    make_cache = init_int8_cache if v.kv_int8 else None

    def timed(params):
        tokens = stream(pre.graphdef, params, ids, new_tokens, jax.random.key(0),
                        make_cache=make_cache, per_layer=v.per_layer)
        out = [next(tokens)]
        with gc_paused():
            t0 = time.perf_counter()
            out += list(tokens)
            sec = time.perf_counter() - t0
        return np.asarray([out]), sec

    return timed, (pre.params,)


def decode_programs(v: DecodeVariant, prompt: list[int], new_tokens: int,
                    made: dict | None = None):
    """(timed, args): a jitted call that decodes `new_tokens` greedy tokens after the prompt's
    prefill (run here, once, untimed), and its arguments. The call takes its cache (args[2])
    donated and writes it in place, as chat's loops do, returning (tokens, cache); `fresh_args`
    gives each call a copy of the prefilled cache, so repeated calls do identical work. A
    streamed variant's call returns (tokens, seconds) itself."""
    if v.streamed:
        return streamed_program(v, prompt, new_tokens, made)
    # A split step's kernels are sharded: XLA's products split with them, a custom call would
    # gather them whole.
    own = v.kernels and v.devices == 1
    pre, ids = decoding_model(v, own, made), jnp.asarray([prompt], jnp.int32)
    make_cache = init_int8_cache if v.kv_int8 else None
    model = nnx.merge(pre.graphdef, pre.params)
    graphdef = pre.graphdef
    if not own:
        graphdef = nnx.split(use_native(model, False))[0]
    if not v.grouped:
        graphdef = nnx.split(use_grouped(model, False))[0]
    per_layer = default_per_layer(model) if v.per_layer is None else v.per_layer
    params = split_params(graphdef, pre.params, v.devices) if v.devices > 1 else pre.params

    @jax.jit
    def run_prompt(params, ids):
        model = nnx.merge(graphdef, params)
        logits, cache, layers = prefill(model, ids, new_tokens, make_cache=make_cache,
                                        per_layer=per_layer)
        return sample_token(logits, None, 0.0, 0), cache, layers

    @functools.partial(jax.jit, donate_argnums=2)
    def steps(params, first, cache, layers):  # -> (tokens, the cache written in place)
        return decode_steps(nnx.merge(graphdef, params), first, cache, layers, len(prompt),
                            new_tokens, jax.random.key(0), return_cache=True)

    first, cache, layers = run_prompt(params, ids)
    return steps, (params, first, cache, layers)


def fresh_args(args: tuple) -> tuple:
    """A scan program's arguments with a copy of its cache, made and written before the clock
    starts: the call consumes the cache it is given (donated), and a cache copied inside the
    timed call would add a whole-cache copy, into freshly mapped memory, that no chat step
    makes."""
    params, first, cache, layers = args
    return params, first, jax.block_until_ready(jax.tree.map(lambda a: a.copy(), cache)), layers


def timed_speed(v: DecodeVariant, prompt: list[int], new_tokens: int) -> Callable[[], float]:
    """A run of variant `v` (a scan variant) that returns its tokens/s: one timed call of its
    program, as `decode_benchmark` times each; compiled here, by one untimed call."""
    if v.streamed:
        raise ValueError(f"{v.name}: a streamed variant times itself (decode_benchmark)")
    fn, args = decode_programs(v, prompt, new_tokens)
    jax.block_until_ready(fn(*fresh_args(args)))

    def run() -> float:
        return new_tokens / timed_call(fn, *fresh_args(args))[1]

    return run


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def decode_benchmark(variants: list[DecodeVariant], prompt: list[int], new_tokens: int,
                     repeats: int = 5, rounds: int = 1,
                     between: Callable[[], None] | None = None) -> list[dict]:
    """Batch-1 greedy decoding speed of each variant: `repeats` timed calls of `new_tokens`
    cached steps each (one jitted `lax.scan`, the prefill excluded), the variants interleaved
    (A, B, C, C, B, A, A, B, C ...) so that a change in the machine's load hits them alike, in
    `rounds` rounds with `between()` run after each (another program timed in turn with these:
    a peer); the median of every timed call is reported, and each round's. Every variant
    writes the same tokens' worth of work; `tokens` lets a caller check they agree
    (`tokens_agree`: the same in every call)."""
    if not prompt or len(prompt) + new_tokens > variants[0].model.cfg.max_len:
        raise ConfigError(f"prompt ({len(prompt)} tokens) + new_tokens={new_tokens}: must fit "
                          f"the context of {variants[0].model.cfg.max_len}")
    made: dict = {}
    progs = [decode_programs(v, prompt, new_tokens, made) for v in variants]

    def own_args(v, args):  # a scan call consumes its cache: each gets a copy, made untimed
        return args if v.streamed else fresh_args(args)

    def call(v, fn, args):  # (tokens, seconds): a streamed call times itself (no prefill)
        if v.streamed:  # times itself, its collector paused
            return jax.block_until_ready(fn(*args))
        out, sec = timed_call(fn, *args)
        return out[0], sec

    tokens = [np.asarray(call(v, fn, own_args(v, args))[0])[0]
              for v, (fn, args) in zip(variants, progs, strict=True)]
    times: list[list[list[float]]] = [[] for _ in variants]
    cpu, agree = [0.0] * len(variants), [True] * len(variants)
    for r in range(rounds):
        for t in times:
            t.append([])
        for turn in range(r * repeats, (r + 1) * repeats):
            # A, B, C, then C, B, A: no variant always runs first, after the last one's turn
            for i in round_order(list(range(len(progs))), turn):
                fn, args = progs[i]
                args = own_args(variants[i], args)
                c0 = _cpu_seconds()
                out, sec = call(variants[i], fn, args)
                times[i][-1].append(sec)
                cpu[i] += _cpu_seconds() - c0
                agree[i] &= bool((np.asarray(out)[0] == tokens[i]).all())
        if between is not None:
            between()
    rows = []
    for v, t, c, ok, toks, (_, args) in zip(variants, times, cpu, agree, tokens, progs,
                                           strict=True):
        runs = [x for r in t for x in r]
        # a streamed call times the steps after its first token
        timed = new_tokens - 1 if v.streamed else new_tokens
        sec = float(np.median(runs))
        if v.streamed:
            model = nnx.merge(v.model.graphdef, v.model.params)
            per_layer = default_per_layer(model) if v.per_layer is None else v.per_layer
            # the cache stream allocates, by shape only: its bytes are all the row reads
            length = len(prompt) + new_tokens
            cache = jax.eval_shape(functools.partial(init_int8_cache, model.cfg, 1, length)
                                   if v.kv_int8 else functools.partial(model.init_cache, 1, length))
        else:
            cache, per_layer = args[2], args[3] is not None
        rows.append({"variant": v.name, "quant": v.model.quant, "kv_int8": v.kv_int8,
                     "layout": "per_layer" if per_layer else "layer_scan",
                     "path": "stream" if v.streamed else "scan",
                     "devices": v.devices,
                     "prompt_tokens": len(prompt), "new_tokens": new_tokens,
                     "tokens_per_s": timed / sec, "ms_per_token": 1e3 * sec / timed,
                     "runs_s": [round(x, 5) for x in runs],
                     "rounds_tokens_per_s": [timed / float(np.median(r)) for r in t],
                     # CPU time of this process over wall time while the variant ran: how
                     # many cores the step kept busy (a streamed call's CPU time holds its
                     # prefill too: none)
                     **({} if v.streamed else {"cores_busy": c / sum(runs)}),
                     # A step multiplies by every block weight and (tied) the whole embedding
                     # table, so each token reads all the parameters once; the cache on top.
                     "weight_bytes_per_token": param_bytes(v.model.params),
                     "kv_cache_bytes": param_bytes(cache),
                     "tokens": toks.tolist(), "tokens_agree": ok})
    return rows


def decode_speeds(models: list[Pretrained], prompt: list[int], new_tokens: int,
                  repeats: int = 5) -> list[dict]:
    """Batch-1 greedy decoding speed of each model with a float and an int8 KV cache, all in
    one interleaved `decode_benchmark`: timed one after another instead, each would meet a
    different load of the machine."""
    variants = [DecodeVariant(f"{m.quant}{'+kv8' if kv else ''}", m, kv)
                for m in models for kv in (False, True)]
    return [{"quant": r["quant"], "kv_int8": r["kv_int8"], "prompt_tokens": r["prompt_tokens"],
             "new_tokens": new_tokens, "seconds": r["ms_per_token"] * new_tokens / 1e3,
             "tokens_per_s": r["tokens_per_s"], "runs_s": r["runs_s"]}
            for r in decode_benchmark(variants, prompt, new_tokens, repeats)]


def probe_layout(pre: Pretrained, prompt: list[int], new_tokens: int = 16,
                 repeats: int = 3) -> dict:
    """Which layer layout decodes `pre` faster on this host, by a short timed run of each
    (`decode_benchmark`, interleaved): {"per_layer": the choice, "tokens_per_s": per layout}.
    `model.generate.default_per_layer` is a fixed rule; which layout wins depends on the
    host's CPU and the weights' dtype."""
    rows = decode_benchmark([DecodeVariant("per_layer", pre, per_layer=True),
                             DecodeVariant("layer_scan", pre, per_layer=False)],
                            prompt, new_tokens, repeats)
    speeds = {r["layout"]: r["tokens_per_s"] for r in rows}
    return {"per_layer": speeds["per_layer"] > speeds["layer_scan"], "tokens_per_s": speeds,
            "probe_tokens": new_tokens, "probe_repeats": repeats}


def remembered_layout(pre: Pretrained, cache_file: Path, host: str) -> dict:
    """`probe_layout`'s choice for this model on this host, probed once and remembered in
    `cache_file` (keyed by the host, the model, its depth and int8 mode, the JAX version and
    which int8 kernel runs the products):
    {"per_layer", "tokens_per_s", ..., "remembered": whether it came from the file}."""
    kernel = native_int8.status().get("isa", "xla") if pre.quant != "none" else "-"
    key = (f"{host}|{pre.name}|{pre.cfg.n_layers}|{pre.quant}|jax {jax.__version__}"
           f"|int8 {kernel}")
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), dict) and isinstance(known[key].get("per_layer"), bool):
        return {**known[key], "remembered": True}
    # a short context (`--context`) gets a probe that fits it
    prompt = list(range(1, 1 + max(1, min(32, pre.cfg.max_len // 4))))
    choice = probe_layout(pre, prompt, new_tokens=max(1, min(16, pre.cfg.max_len - len(prompt))))
    known[key] = choice
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(cache_file.name + ".tmp")
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(cache_file)  # whole or not at all: a reader never sees half a file
    return {**choice, "remembered": False}
