"""The int8 tables' largest-activation rows (experiments.reporting.tables.pretrained): one row
per activation, even where several Dense layers read it (q, k and v read one input).

References: handmade outlier records whose distinct activations are known by construction.
"""

from __future__ import annotations

from experiments.reporting.tables import pretrained


def _peak(module: str, layer: int, channel: int, absmax: float) -> dict:
    return {"module": module, "layer": layer, "channel": channel, "absmax": absmax,
            "ratio_to_median": 10.0, "median_token_absmax": 1.0,
            "carriers": {"tokens": 3, "of": 8, "first_of_row": 0,
                         "texts": [{"text": "x", "count": 3}]}}


def _outliers() -> dict:
    qkv = {"max": [300.0, 200.0]}  # q, k and v see the same input: the same profile
    modules = {f"blocks/attn/{n}": {"max": 300.0, "per_layer": qkv,
                                    "peak": _peak(f"blocks/attn/{n}", 0, 7, 300.0)}
               for n in ("q", "k", "v")}
    modules["blocks/mlp/down"] = {"max": 250.0, "per_layer": {"max": [250.0, 1.0]},
                                  "peak": _peak("blocks/mlp/down", 0, 3, 250.0)}
    top = [_peak(f"blocks/attn/{n}", 0, 7, 300.0) for n in ("k", "q", "v")]
    top += [_peak("blocks/mlp/down", 0, 3, 250.0)]
    top += [_peak(f"blocks/attn/{n}", 1, 9, 200.0) for n in ("k", "q", "v")]
    return {"calibration": {"rows": 2, "tokens_per_row": 4}, "top": top,
            "per_module": modules}


def _table(d: dict) -> list[str]:
    return [r for r in pretrained._outlier_rows(d) if r.startswith("| ") and "layer" not in r]


def test_an_activation_read_by_q_k_and_v_is_one_row():
    rows = _table({"outliers": _outliers()})
    assert [r.split(" | ")[:3] for r in rows] == [["| q/k/v", "0", "7"], ["| down", "0", "3"],
                                                  ["| q/k/v", "1", "9"]]


def test_without_the_shared_input_each_layer_is_its_own_row():
    d = _outliers()
    for n, scale in (("q", 1.0), ("k", 2.0), ("v", 3.0)):  # three different inputs now
        d["per_module"][f"blocks/attn/{n}"]["per_layer"] = {"max": [300.0 * scale, 1.0]}
    rows = _table({"outliers": d})
    assert [r.split(" | ")[0] for r in rows[:3]] == ["| k", "| q", "| v"]
