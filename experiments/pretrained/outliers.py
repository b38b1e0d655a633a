"""Where a pretrained LM's Dense inputs have outlier channels, and which tokens carry them.

The int8 modes differ in how they meet these channels (per-token scales, SmoothQuant's
migration, mixed precision); `activation_outliers` is what the quantisation table and its plot
read to show where they are.
"""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np

from experiments.pretrained.loading import Pretrained
from model.tokenizer import BPETokenizer
from quant.calibrate import calibrate


def activation_outliers(pre: Pretrained, rows: list, top: int = 10) -> dict:
    """Where the float model's Dense inputs have outlier channels, on calibration rows: per
    module the largest channel absmax and its ratio to the median channel's (per layer), and
    the `top` (module, layer, channel) entries overall; `per_layer` keeps each layer's largest
    channel and that ratio for the plot, `peak` the module's largest entry.

    Each entry also says which tokens carry it (`carriers`): the tokens whose largest
    input is in that channel and reaches a tenth of its peak, how many of them are the first
    token of their row, and their text. Beside it, `median_token_absmax`, the median over
    tokens of a token's largest input in that layer: what a per-token int8 scale is set by
    on an ordinary token, against the carriers' peak."""
    stats = calibrate(pre.graphdef, jax.device_get(pre.params), rows)
    ids = np.concatenate([np.asarray(r)[0, :-1] for r in rows])
    row_len = int(rows[0].shape[1] - 1)
    per_module, entries = {}, []
    for path, a in sorted(stats["absmax"].items()):
        a = np.asarray(a).reshape(-1, a.shape[-1])  # [layers, in]
        tok_max = np.asarray(stats["token_absmax"][path]).reshape(a.shape[0], -1)
        tok_arg = np.asarray(stats["token_argmax"][path]).reshape(a.shape[0], -1)
        med = np.median(a, axis=-1)
        worst = int(np.argmax(a.max(-1) / med))
        per_module[path] = {"max": float(a.max()), "worst_layer": worst,
                            "worst_ratio_to_median": float(a[worst].max() / med[worst]),
                            "median_ratio": float(np.median(a.max(-1) / med)),
                            "per_layer": {"max": a.max(-1).tolist(),
                                          "ratio_to_median": (a.max(-1) / med).tolist()}}
        mine = []
        for layer in range(a.shape[0]):
            ch = int(np.argmax(a[layer]))
            mine.append({"module": path, "layer": layer, "channel": ch,
                         "absmax": float(a[layer, ch]),
                         "ratio_to_median": float(a[layer, ch] / med[layer]),
                         "median_token_absmax": float(np.median(tok_max[layer])),
                         "carriers": _carriers(tok_max[layer], tok_arg[layer], ch,
                                               float(a[layer, ch]), ids, row_len,
                                               pre.tokenizer)})
        per_module[path]["peak"] = max(mine, key=lambda e: e["absmax"])
        entries += mine
    entries.sort(key=lambda e: -e["absmax"])
    return {"per_module": per_module, "top": entries[:top],
            "calibration": {"rows": len(rows), "tokens_per_row": row_len}}


def _carriers(tok_max: np.ndarray, tok_arg: np.ndarray, channel: int, peak: float,
              ids: np.ndarray, row_len: int, tokenizer: BPETokenizer) -> dict:
    """The tokens whose largest input is `channel` at a tenth of `peak` or more."""
    where = np.flatnonzero((tok_arg == channel) & (tok_max >= peak / 10))
    texts = Counter(tokenizer.decode([int(ids[i])]) for i in where)
    return {"tokens": int(where.size), "of": int(tok_max.size),
            "first_of_row": int(np.sum(where % row_len == 0)),
            "texts": [{"text": t, "count": c} for t, c in texts.most_common(5)]}
