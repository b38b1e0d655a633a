"""The pretrained LLM's int8 checkpoint measured: its size on disk against float32, and its
scores after a zero3 reload against the in-memory int8 model's (the library of
`experiments.llm_int8_checkpoint`, whose docstring says what each comparison shows).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from experiments.pretrained import loading, scoring
from experiments.pretrained.loading import Pretrained
from experiments.reporting.results_io import project_relative
from model.flops import param_bytes
from parallel.mesh import make_mesh
from parallel.state import place_model_params
from parallel.strategies import get_strategy
from quant import checkpoint as qckpt
from quant.convert import QuantConfig
from quant.stored import quantize_with_meta, save_atomic

TEXTS = ("The capital of France is Paris, and the capital of Italy is Rome.",
         "def add(a, b):\n    return a + b\n",
         "In 1969, Apollo 11 landed 2 astronauts on the Moon.",
         "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def measure(name: str, qcfg: QuantConfig, devices: int, out: str | None = None) -> dict:
    """Quantise model `name` under `qcfg`, write its int8 checkpoint (into `out`, replaced, or a
    temporary folder), reload it sharded over `devices` in the zero3 layout and compare sizes
    and scores (see experiments.llm_int8_checkpoint)."""
    pre = loading.load(name)
    rows = loading.calibration_rows(pre.tokenizer, qcfg.calib_batches)
    qdef, qparams, plan, report, meta = quantize_with_meta(
        pre.graphdef, pre.params, qcfg, rows, pre.cfg,
        {"source": "pydoc_data train topics", "rows": len(rows)})
    work = Path(tempfile.mkdtemp(prefix="shardq-int8-"))
    try:
        target = Path(out) if out else work / qcfg.mode
        save_atomic(target, qparams, meta, report)
        int8_bytes = qckpt.disk_bytes(target / "ckpt")
        float_bytes = qckpt.save_float_reference(work / "float", jax.device_get(pre.params))
        mesh = make_mesh(devices)
        gdef, sharded, _ = qckpt.load(target, pre.cfg, mesh, sharded=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the float copy, and the int8 one unless --out
    texts = list(TEXTS)
    identical = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
        jax.tree.leaves(jax.device_get(sharded)), jax.tree.leaves(jax.device_get(qparams)),
        strict=True))
    local = Pretrained(pre.name, pre.cfg, qdef, qparams, pre.tokenizer, qcfg.mode)
    remote = Pretrained(pre.name, pre.cfg, gdef, sharded, pre.tokenizer, qcfg.mode)
    # The in-memory int8 parameters put in the reloaded ones' zero3 shards: the same program
    # as the reload, so any difference would be the checkpoint's.
    placed = jax.tree.map(lambda x, ref: jax.device_put(x, ref.sharding), qparams, sharded)
    in_layout = Pretrained(pre.name, pre.cfg, gdef, placed, pre.tokenizer,
                                         qcfg.mode)
    # ... and replicated on every device of the mesh: the 8-device program without shards.
    replicated = Pretrained(
        pre.name, pre.cfg, gdef, place_model_params(gdef, qparams, mesh, get_strategy("dp")),
        pre.tokenizer, qcfg.mode)
    a, b, c, r = (scoring.score_texts(m, texts)
                  for m in (local, remote, in_layout, replicated))
    # The float model through the same two programs (one device; zero3 over the mesh): how much
    # the layout alone moves a score when no rounding to int8 follows.
    float_sharded = place_model_params(pre.graphdef, pre.params, mesh, get_strategy("zero3"))
    f1 = scoring.score_texts(pre, texts)
    f8 = scoring.score_texts(Pretrained(
        pre.name, pre.cfg, pre.graphdef, float_sharded, pre.tokenizer, "none"), texts)
    float_params = param_bytes(pre.params)
    one_device = _compare(a, b)
    result = {"model": pre.name, "mode": qcfg.mode, "rules": list(qcfg.rules),
              "int8_disk_bytes": int8_bytes, "float32_param_bytes": float_params,
              "disk_ratio": float_params / int8_bytes, "float32_disk_bytes": float_bytes,
              "disk_ratio_vs_float_checkpoint": float_bytes / int8_bytes, "devices": devices,
              "strategy": "zero3", "texts": len(TEXTS),
              "params_bit_identical": identical,
              "reload_vs_in_memory_same_layout": _compare(c, b),
              "zero3_vs_one_device": one_device,
              "replicated_vs_one_device": _compare(a, r),
              "float_zero3_vs_one_device": _compare(f1, f8),
              **one_device,  # also at the top level, where the tables read it
              "checkpoint": project_relative(target) if out else None}
    return result


def _compare(a: list[dict], b: list[dict]) -> dict:
    return {"max_abs_nll_diff": max(abs(x["mean_nll"] - y["mean_nll"])
                                    for x, y in zip(a, b, strict=True)),
            "next_tokens_identical": all(x["next_token"] == y["next_token"]
                                         for x, y in zip(a, b, strict=True))}
