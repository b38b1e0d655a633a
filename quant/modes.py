"""The int8 modes by name and the one quantisation error: no JAX here, so a launcher can check
its flags (and refuse them) before JAX starts."""

from __future__ import annotations

# mode -> (activation quantisation, SmoothQuant folding, LLM.int8() outliers, auto precision)
MODES: dict[str, tuple[str, bool, bool, bool]] = {
    "w8": ("none", False, False, False),
    "w8a8-tensor": ("tensor", False, False, False),
    "w8a8": ("token", False, False, False),
    "w8a8-static": ("static", False, False, False),
    "smoothquant": ("token", True, False, False),
    "w8a8-outlier": ("token", False, True, False),
    "auto": ("token", True, False, True),
}
ALL_MODES = ("none",) + tuple(MODES)


class QuantError(ValueError):
    """Bad input for quantisation: launchers print it on one line and exit 2."""
