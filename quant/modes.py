"""The int8 modes by name, the quantisation config and the one quantisation error: no JAX here,
so a launcher can check its flags (and refuse them) before JAX starts."""

from __future__ import annotations

import dataclasses

# mode -> (activation quantisation, SmoothQuant folding, LLM.int8() outliers, auto precision,
#          rotated inputs)
MODES: dict[str, tuple[str, bool, bool, bool, bool]] = {
    "w8": ("none", False, False, False, False),
    "w8a8-tensor": ("tensor", False, False, False, False),
    "w8a8": ("token", False, False, False, False),
    "w8a8-static": ("static", False, False, False, False),
    "smoothquant": ("token", True, False, False, False),
    "w8a8-outlier": ("token", False, True, False, False),
    "auto": ("token", True, False, True, False),
    "w8a8-rotated": ("token", False, False, False, True),
}
ALL_MODES = ("none",) + tuple(MODES)
SMOOTHING_MODES = tuple(m for m, spec in MODES.items() if spec[1])  # SmoothQuant's folds


class QuantError(ValueError):
    """Bad input for quantisation: launchers print it on one line and exit 2."""


# Every Dense of the blocks, and the embedding (a tied model's head): in int8 blocks the table
# stays within the project's perplexity rule at about a quarter of its float bytes, where one
# scale per row does not (docs/smollm2_int8.md measures both, and the exception).
DEFAULT_RULES = ("blocks/*", "embed")
# What a config written before "rules" existed selected.
LEGACY_RULES = ("blocks/*",)
EMBED_BLOCK = 32  # values per scale of an int8 embedding table: GGUF Q8_0's block
PAPER_ALPHA = 0.5  # SmoothQuant's one migration strength for every site (most of its models)
ROTATION_SEED_LIMIT = 2**32  # numpy's seed range, as the training seed's
# Calibration runs the model eagerly, a batch at a time: beyond this it runs for hours and the
# absmax statistics have long stopped moving.
MAX_CALIB_BATCHES = 1024


def _field(default, help_text: str):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How a float model becomes int8; each field's `help` is also its command-line help."""
    mode: str = _field("w8a8", f"one of {', '.join(MODES)}")
    weights: str = _field("channel", "weight scales: channel | tensor")
    clip_search: bool = _field(False, "search the weight clipping ratio that minimises the "
                                      "squared error")
    # None (the default): chosen per layer and site, because a Llama-family model's sites differ
    # and the paper's one 0.5 for every site does not fit them all (docs/smollm2.md compares).
    alpha: float | None = _field(None, "smoothquant, auto: SmoothQuant's migration strength at "
                                       "every site, e.g. the paper's 0.5 (default: chosen per "
                                       "layer and site from 0.3..0.8 by the int8 product's "
                                       "error on the calibration data, quant/alpha_search.py)")
    outlier_threshold: float = _field(6.0, "w8a8-outlier: |x| at or above which an input "
                                           "column is multiplied in float")
    outlier_capacity: float = _field(0.0625, "w8a8-outlier: largest share of a layer's input "
                                             "columns that may take the float path (static "
                                             "shapes need a cap)")
    error_budget: float = _field(0.02, "auto: relative RMS output error above which a layer "
                                       "stays float")
    rules: tuple[str, ...] = _field(DEFAULT_RULES, "comma-separated path rules of the modules to "
                                                   "quantise, e.g. 'blocks/*,head,embed'")
    calib_batches: int = _field(8, "calibration batches")
    embed_block: int = _field(EMBED_BLOCK, "values per scale of an int8 embedding table (and "
                                           "tied head), where they divide its width; 0: one "
                                           "scale per row")
    rotation_seed: int = _field(0, "w8a8-rotated: seed of the random signs applied before the "
                                   "Hadamard rotation (0: none, the plain Hadamard matrix)")

    def validate(self) -> None:
        if self.mode not in MODES:
            raise QuantError(f"mode={self.mode!r}: allowed {', '.join(ALL_MODES)}")
        if self.weights not in ("channel", "tensor"):
            raise QuantError(f"weights={self.weights!r}: allowed channel, tensor")
        if self.alpha is not None and self.mode not in SMOOTHING_MODES:
            raise QuantError(f"alpha={self.alpha}: only for the modes that smooth "
                             f"({', '.join(SMOOTHING_MODES)}), not {self.mode}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise QuantError(f"alpha={self.alpha}: must be in [0, 1] (or unset: searched)")
        if not self.outlier_threshold > 0:
            raise QuantError(f"outlier_threshold={self.outlier_threshold}: must be positive")
        if not 0.0 < self.outlier_capacity <= 1.0:
            raise QuantError(f"outlier_capacity={self.outlier_capacity}: must be in (0, 1]")
        if not self.error_budget > 0:
            raise QuantError(f"error_budget={self.error_budget}: must be positive")
        if not 0 <= self.rotation_seed < ROTATION_SEED_LIMIT:
            raise QuantError(f"rotation_seed={self.rotation_seed}: must be in [0, "
                             f"{ROTATION_SEED_LIMIT})")
        if self.embed_block < 0:
            raise QuantError(f"embed_block={self.embed_block}: must be 0 (one scale per row) or "
                             f"a positive block size")
        if not 1 <= self.calib_batches <= MAX_CALIB_BATCHES:
            raise QuantError(f"calib_batches={self.calib_batches}: must be in "
                             f"1..{MAX_CALIB_BATCHES}")

    @property
    def alpha_search(self) -> bool:
        """SmoothQuant's alpha is chosen per layer and site (no one `alpha` given)."""
        return self.alpha is None

    @property
    def act(self) -> str:
        return MODES[self.mode][0]

    @property
    def smooth(self) -> bool:
        return MODES[self.mode][1]

    @property
    def outliers(self) -> bool:
        return MODES[self.mode][2]

    @property
    def auto(self) -> bool:
        return MODES[self.mode][3]

    @property
    def rotate(self) -> bool:
        return MODES[self.mode][4]

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "rules": list(self.rules)}

    @staticmethod
    def from_json(d: dict) -> QuantConfig:
        if "alpha_search" in d:  # an older config: alpha a number, the search a separate flag
            d = {**d, "alpha": None if d["alpha_search"] else d.get("alpha", PAPER_ALPHA)}
            del d["alpha_search"]
        if d.get("mode") in MODES and d["mode"] not in SMOOTHING_MODES:
            d = {**d, "alpha": None}  # older configs store 0.5 for modes that do not smooth
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(QuantConfig)})
        if unknown:
            raise QuantError(f"quant_config: unknown field(s) {', '.join(unknown)}; written by a "
                             f"newer version of shardq?")
        return QuantConfig(**{**d, "rules": tuple(d.get("rules", LEGACY_RULES))})
