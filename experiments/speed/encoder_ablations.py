"""Each speed change of the MiniLM encode path against what it replaced, paired in one process.

Library of `experiments.bench_encoder --ablations`: length buckets, the padded lengths, the GELU
polynomial, one CPU device per core and the dp batch split, each timed before/after with warm
passes interleaved (`_paired`) so that both sides see the same machine load; and the embed CLI's
marginal speed as a user runs it.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import jax
import numpy as np
from flax import nnx

import model.bert as bert
from experiments.pretrained.minilm import (
    BATCH,
    BUCKETS,
    batch_rows,
    encode,
    load_encoder,
    make_encode_fn,
    place,
    plan_batches,
    quantize_encoder,
)
from experiments.speed.encoder import load_1min, pass_seconds
from experiments.speed.machine import describe
from model.bert import sentence_embeddings


def _unbucketed_pass(fn, params, tok, texts, batch: int) -> float:
    """The encode loop before bucketing: texts in their given order, each batch padded to a
    multiple of 8 of its longest text, and its result read back before the next is sent."""
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        tokens, mask = tok.encode(texts[i:i + batch])
        np.asarray(fn(params, tokens, mask))
    return time.perf_counter() - start


def _paired(fns: dict, rounds: int) -> dict:
    """{name: median seconds} of callables run round-robin `rounds` times."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def ablation_bucketing(graphdef, params, tok, texts, batch: int, rounds: int) -> dict:
    """Length buckets (sorted, BUCKETS lengths, async dispatch) vs the old in-order batches:
    the first pass of a fresh jit (compiles included, what a new process pays), then warm
    passes interleaved."""
    before_fn = make_encode_fn.__wrapped__(graphdef)
    after_fn = make_encode_fn.__wrapped__(graphdef)
    first_before = _unbucketed_pass(before_fn, params, tok, texts, batch)
    first_after = pass_seconds(after_fn, params, tok, texts, batch)
    warm = _paired({"before": lambda: _unbucketed_pass(before_fn, params, tok, texts, batch),
                    "after": lambda: pass_seconds(after_fn, params, tok, texts, batch)}, rounds)
    ids = tok.ids(texts)
    old_shapes = {tok.encode(texts[i:i + batch])[0].shape for i in range(0, len(texts), batch)}
    new_shapes = {(batch_rows(len(idx), batch), length)
                  for idx, length in plan_batches([len(r) for r in ids], batch)}
    return {"change": "length buckets", "n_sentences": len(texts),
            "before": {"first_pass_s": first_before, "warm_pass_s": warm["before"],
                       "compiled_shapes": len(old_shapes)},
            "after": {"first_pass_s": first_after, "warm_pass_s": warm["after"],
                      "compiled_shapes": len(new_shapes)},
            "speedup_first": first_before / first_after,
            "speedup_warm": warm["before"] / warm["after"]}


# The padded lengths before the multiples of 8 (minilm.BUCKETS): about 1.5x apart.
PREVIOUS_BUCKETS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def ablation_bucket_set(variants: dict, tok, texts, batch: int, rounds: int) -> list[dict]:
    """Padded lengths every 8 tokens (minilm.BUCKETS) vs about 1.5x apart, per variant: warm
    passes interleaved, with the padded share and the number of compiled lengths of each."""
    lengths = [len(r) for r in tok.ids(texts)]
    real = sum(lengths)

    def shape_stats(buckets):
        plan = plan_batches(lengths, batch, buckets)
        padded = sum(batch_rows(len(idx), batch) * length for idx, length in plan)
        return {"padding_fraction": 1 - real / padded,
                "compiled_shapes": len({(batch_rows(len(idx), batch), length)
                                        for idx, length in plan})}

    rows = []
    for name, (gd, p) in variants.items():
        fn = make_encode_fn(gd)
        for buckets in (PREVIOUS_BUCKETS, BUCKETS):
            encode(fn, p, tok, texts, batch, buckets=buckets)  # compile every shape first
        t = _paired({"before": lambda fn=fn, p=p: encode(fn, p, tok, texts, batch,
                                                         buckets=PREVIOUS_BUCKETS),
                     "after": lambda fn=fn, p=p: encode(fn, p, tok, texts, batch)}, rounds)
        rows.append({"change": "padded lengths every 8 tokens", "variant": name,
                     "n_sentences": len(texts),
                     "before": {"warm_pass_s": t["before"], **shape_stats(PREVIOUS_BUCKETS)},
                     "after": {"warm_pass_s": t["after"], **shape_stats(BUCKETS)},
                     "speedup_warm": t["before"] / t["after"]})
    return rows


def ablation_devices(variants_host: dict, tok, texts, batch: int, rounds: int,
                     devices: int) -> list[dict]:
    """One CPU device vs `devices` (one per core, embed's default), each batch split over
    them, per variant: warm passes interleaved."""
    rows = []
    for name, (gd, params) in variants_host.items():
        fn = make_encode_fn(gd)
        one, one_mesh = place(params, gd, 1, "dp")
        many, many_mesh = place(params, gd, devices, "dp")
        encode(fn, one, tok, texts, batch, one_mesh)
        encode(fn, many, tok, texts, batch, many_mesh)
        t = _paired({"before": lambda fn=fn, p=one, m=one_mesh: encode(fn, p, tok, texts,
                                                                      batch, m),
                     "after": lambda fn=fn, p=many, m=many_mesh: encode(fn, p, tok, texts,
                                                                       batch, m)}, rounds)
        rows.append({"change": "one device per core", "variant": name, "devices": devices,
                     "n_sentences": len(texts), "before": {"warm_pass_s": t["before"]},
                     "after": {"warm_pass_s": t["after"]},
                     "speedup_warm": t["before"] / t["after"]})
    return rows


def ablation_gelu(variants: dict, tok, texts, batch: int, rounds: int) -> list[dict]:
    """The one-polynomial GELU vs jax.nn.gelu(approximate=False) (lax.erf), per variant:
    warm passes interleaved, and the largest embedding difference between the two."""
    def exact(x):
        return jax.nn.gelu(x, approximate=False)

    rows = []
    for name, (gd, p) in variants.items():
        before_fn = jax.jit(lambda p, t, m, gd=gd: sentence_embeddings(nnx.merge(gd, p), t, m))
        with mock.patch.object(bert, "gelu", exact):  # traced (compiled) with the lax.erf GELU
            emb_before = encode(before_fn, p, tok, texts, batch)
        after_fn = make_encode_fn(gd)
        emb_after = encode(after_fn, p, tok, texts, batch)
        t = _paired({"before": lambda f=before_fn, p=p: encode(f, p, tok, texts, batch),
                     "after": lambda f=after_fn, p=p: encode(f, p, tok, texts, batch)}, rounds)
        rows.append({"change": "GELU erf polynomial", "variant": name, "n_sentences": len(texts),
                     "before": {"warm_pass_s": t["before"]}, "after": {"warm_pass_s": t["after"]},
                     "speedup_warm": t["before"] / t["after"],
                     "max_abs_embedding_diff": float(np.max(np.abs(emb_before - emb_after)))})
    return rows


def ablation_mesh_split(graphdef, params, tok, texts, batch: int, rounds: int,
                        devices: int) -> dict:
    """embed's dp strategy on `devices` CPU devices: params replicated on the mesh and the batch
    left whole (before: every device computes every batch) vs the batch split over the mesh."""
    placed, mesh = place(params, graphdef, devices, "dp")
    fn = make_encode_fn(graphdef)
    encode(fn, placed, tok, texts, batch)
    encode(fn, placed, tok, texts, batch, mesh=mesh)
    t = _paired({"before": lambda: encode(fn, placed, tok, texts, batch),
                 "after": lambda: encode(fn, placed, tok, texts, batch, mesh=mesh)}, rounds)
    return {"change": "dp: split each batch over the mesh", "devices": devices,
            "n_sentences": len(texts), "before": {"warm_pass_s": t["before"]},
            "after": {"warm_pass_s": t["after"]}, "speedup_warm": t["before"] / t["after"]}


def cli_marginal(modes: tuple[str, ...], base: list[str], extra: list[str],
                 devices: int | None = None) -> list[dict]:
    """`python -m experiments.embed --json` as a user runs it: wall time with `base` texts and
    with base + extra, per mode; sentences/s of the extra texts (start-up and loading cancel)."""
    rows = []
    for mode in modes:
        walls = []
        for texts in (base, base + extra):
            cmd = [sys.executable, "-m", "experiments.embed", "--json", "--quant", mode]
            if devices:
                cmd += ["--devices", str(devices)]
            for t in texts:
                cmd += ["--text", t]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True,
                           cwd=Path(__file__).resolve().parents[2])
            walls.append(time.perf_counter() - t0)
        rows.append({"mode": mode, "base_texts": len(base), "extra_texts": len(extra),
                     "wall_s": walls,
                     "marginal_sentences_per_s": len(extra) / max(walls[1] - walls[0], 1e-9)})
    return rows


def ablations(texts: list[str], batch: int = BATCH, rounds: int = 3, devices: int = 8,
              dp_texts: int = 64, cli: bool = True, cores: int = 2,
              log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """Every speed change before/after (see the ablation_* functions), one results dict."""
    load_start = load_1min()
    graphdef, params, tok = load_encoder()
    single = jax.device_put(params, jax.devices()[0])
    qdef, qparams, _ = quantize_encoder(graphdef, params, tok, "w8a8")
    variants = {"float": (graphdef, single),
                "w8a8": (qdef, jax.device_put(qparams, jax.devices()[0]))}
    log("length buckets")
    rows = [ablation_bucketing(graphdef, single, tok, texts, batch, rounds)]
    log("bucket lengths")
    rows += ablation_bucket_set(variants, tok, texts, batch, rounds)
    log("GELU")
    rows += ablation_gelu(variants, tok, texts, batch, rounds)
    if len(jax.devices()) >= cores > 1:
        log(f"one device per core ({cores})")
        rows += ablation_devices({"float": (graphdef, params), "w8a8": (qdef, qparams)}, tok,
                                 texts, batch, rounds, cores)
    if len(jax.devices()) >= devices > 1:
        log(f"dp over {devices} devices")
        rows.append(ablation_mesh_split(graphdef, params, tok, texts[:dp_texts], batch,
                                        rounds, devices))
    out = {"machine": describe(), "load_1min": {"start": load_start}, "batch": batch,
           "rounds": rounds, "results": rows}
    if cli:
        log("embed CLI as a user runs it")
        out["cli"] = cli_marginal(("none", "w8a8"), texts[:32], texts[32:])
    out["load_1min"]["end"] = load_1min()
    return out
