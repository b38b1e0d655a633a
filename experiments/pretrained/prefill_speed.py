"""How fast a pretrained LM reads a prompt: batch-1 tokens per second of one forward over a
window, as scoring runs it (`scoring.make_score_fn`: the logits of every position, their
log-softmax, the picked log-probabilities and the argmax), and as generation's prefill runs it
(`model.generate.prefill` through the layer scan: the window written into a fresh KV cache, the
last position's logits and its greedy token; rows named `NAME-last`).

Each model's program is compiled once; `time_round` times every model in turn (A, B, C, A, B,
C, ...), so a caller can interleave rounds with other measurements (the llama.cpp peer of
`experiments.bench_decode`) and a change in the machine's load hits them all alike.
"""

from __future__ import annotations

import statistics

import jax
import numpy as np
from flax import nnx

from experiments.cli.config import ConfigError
from experiments.pretrained.loading import Pretrained
from experiments.pretrained.scoring import make_score_fn
from experiments.speed.gc_pause import timed_call
from model.generate import prefill, sample_token
from parallel.inference import mesh_of

LAST = "-last"  # the suffix of a row timed as generation's prefill


def generation_prefill_fn(graphdef):
    """A jitted (params, tokens [1, T]) -> the first generated token (greedy), as
    `model.generate.generate` computes it: the prompt into a fresh cache, the last logits. The
    layer scan reads the prompt (splitting the weights per layer, which `generate` does once
    for a whole reply, would be timed here with every call)."""

    @jax.jit
    def fn(params, tokens):
        logits, _, _ = prefill(nnx.merge(graphdef, params), tokens, 1, per_layer=False)
        return sample_token(logits, None, 0.0, 0)

    return fn


def window_of(ids: list[int], n: int) -> list[int]:
    """The first `n` tokens of `ids`, repeated from the start when `ids` is shorter."""
    if not ids:
        raise ConfigError("prefill window: the text has no tokens")
    return (ids * (n // len(ids) + 1))[:n]


class PrefillBench:
    """The named models' prefill of one window, compiled once, timed in rounds."""

    def __init__(self, models: dict[str, Pretrained], window: list[int]):
        longest = min(m.cfg.max_len for m in models.values())
        if not window or len(window) > longest:
            raise ConfigError(f"prefill_tokens={len(window)}: must be in 1..{longest} (the "
                              f"model's context)")
        tokens = jax.device_put(np.asarray([window], np.int32))  # on the device once
        self.window = len(window)
        self.models = {**models, **{name + LAST: m for name, m in models.items()}}
        self.programs = {name: (make_score_fn(m.graphdef, mesh_of(m.params)), m.params)
                         for name, m in models.items()}
        self.programs |= {name + LAST: (generation_prefill_fn(m.graphdef), m.params)
                          for name, m in models.items()}
        for fn, params in self.programs.values():  # compile and warm up, untimed
            jax.block_until_ready(fn(params, tokens))
        self.tokens = tokens
        self.times: dict[str, list[list[float]]] = {name: [] for name in self.programs}

    def time_round(self, repeats: int) -> None:
        """`repeats` timed forwards of every model, interleaved."""
        runs: dict[str, list[float]] = {name: [] for name in self.programs}
        for _ in range(repeats):
            for name, (fn, params) in self.programs.items():
                runs[name].append(timed_call(fn, params, self.tokens)[1])
        for name, t in runs.items():
            self.times[name].append(t)

    def rows(self) -> list[dict]:
        """Per model: tokens/s of the median forward over every round, and of each round."""
        rows = []
        for name, rounds in self.times.items():
            sec = statistics.median(x for r in rounds for x in r)
            rows.append({"variant": name, "quant": self.models[name].quant,
                         "logits": "last" if name.endswith(LAST) else "every position",
                         "window_tokens": self.window, "tokens_per_s": self.window / sec,
                         "ms_per_window": 1e3 * sec,
                         "rounds_tokens_per_s": [self.window / statistics.median(r)
                                                 for r in rounds],
                         "runs_s": [[round(x, 5) for x in r] for r in rounds]})
        return rows
