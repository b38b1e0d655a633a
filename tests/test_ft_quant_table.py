"""The fine-tuned SmolLM2's int8 table (smollm2_ft_quant): its renderer beside the packaged
model's file, and the registry claim that judges it.

References: handmade results files whose figures and orderings are known by construction.
"""

from __future__ import annotations

import json
import math

from experiments.reporting.registry import catalog
from experiments.reporting.tables import pretrained

MACHINE = {"host_cpu": {"model": "Test CPU"}, "cpus": 2, "jax_version": "0.0"}


def _row(quant: str, ppl: float, kl: float | None, top1: float = 0.9) -> dict:
    row = {"quant": quant, "perplexity": ppl, "vs_float_pct": 100 * (ppl / 10.0 - 1),
           "tokens": 512, "window": 128}
    return row if kl is None else {**row, "divergence": {"kl_mean": kl, "top1_agree": top1}}


def _file(model: str, kls: dict[str, float], ppls: dict[str, float] | None = None) -> dict:
    ppls = ppls or {m: 10.0 + 10 * k for m, k in kls.items()}
    return {"model": model, "layers": 2, "machine": MACHINE,
            "rows": [_row("none", 10.0, None)]
            + [_row(m, ppls[m], k) for m, k in kls.items()]}


def _write(folder, ft: dict, packaged: dict | None = None):
    (folder / pretrained.FT_QUANT).write_text(json.dumps(ft))
    if packaged is not None:
        (folder / pretrained.FT_PACKAGED).write_text(json.dumps(packaged))
    return folder


def test_table_sets_each_mode_beside_the_packaged_one_and_says_if_the_order_holds(tmp_path):
    ft = _file("runs/finetune-smollm2", {"w8": 0.01, "w8a8": 0.05})
    text = pretrained.smollm2_ft_quant(_write(tmp_path, ft, _file("smollm2",
                                                                  {"w8": 0.002, "w8a8": 0.03})))
    assert "| w8 | 10.100 | +1.00% | 0.0100 | 90.0% | 10.020 | +0.20% | 0.0020 | 90.0% |" \
        in text.splitlines()
    assert "| none | 10.000 | +0.00% | – | – | 10.000 | +0.00% | – | – |" in text.splitlines()
    assert "fine-tuned: w8 < w8a8; packaged, the same modes: w8 < w8a8 (the same order)" in text
    # The packaged model ranks them the other way round: the table says so.
    swapped = pretrained.smollm2_ft_quant(_write(tmp_path, ft, _file(
        "smollm2", {"w8": 0.05, "w8a8": 0.03})))
    assert "packaged, the same modes: w8a8 < w8 (a different order)" in swapped


def test_table_without_the_packaged_file_shows_dashes(tmp_path):
    text = pretrained.smollm2_ft_quant(_write(tmp_path, _file("runs/ft", {"w8": 0.01})))
    assert "| w8 | 10.100 | +1.00% | 0.0100 | 90.0% | – | – | – | – |" in text.splitlines()
    assert "packaged:" not in text.split("Hosts:")[1] and "the same modes" not in text
    assert "yet" in pretrained.smollm2_ft_quant(tmp_path / "empty")


def test_claim_holds_on_a_measured_run_and_fails_on_a_wrong_file(tmp_path):
    claim = next(e for e in catalog.EXPERIMENTS if e.name == "smollm2_ft_quant").claim
    good = _file("runs/reproduce/finetune-smollm2", {"w8": 0.01})
    assert claim(_write(tmp_path, good), True) is None
    # Not every mode: the full run's claim fails where the quick one passes.
    assert "every int8 mode" in claim(tmp_path, False)
    assert "not true" in claim(_write(tmp_path, {**good, "model": "smollm2"}), True)
    bad = _file("runs/finetune-smollm2", {"w8": 0.01}, {"w8": math.inf})
    assert "not true" in claim(_write(tmp_path, bad), True)
