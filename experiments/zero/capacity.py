"""The ZeRO paper's Table 2 by search: the largest member of our GPT family that fits a device.

Two answers per (stage, device count, device memory):
- model state only: the largest width whose model state (the ZeRO paper's formula at the
  member's exact Psi, 2 + 2 + 12 bytes per parameter split as the stage splits them; equal to
  the compiled program's state as experiments.zero_memory checks) fits the memory. The
  paper's Table 2 is this count at its round Psi.
- with activations: bisection over widths, each step the real training step compiled for fake
  CPU devices (experiments.zero.plan_estimate.compile_candidate): the largest width whose
  compiled peak (XLA:CPU's, activations and temporaries included) fits, at a pinned activation
  setting (ActivationSetting). Members are widths in multiples of 128 (plan_family.family_shape).

JAX must already have as many fake devices as the largest device count compiled.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from experiments.zero.evidence import paper_bytes
from experiments.zero.plan_estimate import CompileCache, cache_key, compile_candidate
from experiments.zero.plan_family import WIDTH_STEP, family_depth, family_shape
from experiments.zero.plan_request import GB, Candidate, PlanRequest
from model.flops import param_count

# The ZeRO paper's Table 2 at 64 devices of 32 GB, model state only (as printed).
PAPER_TABLE2_64X32GB = {"dp": 2e9, "zero1": 7.6e9, "zero2": 14.4e9, "zero3": 128e9}
MAX_WIDTH_STEPS = 1 << 10  # widths up to 128 * 1024 (quadrillion-parameter members)


@dataclasses.dataclass(frozen=True)
class ActivationSetting:
    """What the compiled search trains: one sequence per device per micro-step, two micro-steps
    (so the gradient accumulator is a real buffer), full remat, bf16 mixed precision."""

    seq_len: int = 1024
    micro_batch: int = 1
    micro_steps: int = 2
    remat: str = "full"
    dtype: str = "bfloat16"


def paper_largest(stage: str, n_devices: int, memory: float) -> float:
    """The paper's answer: Psi with paper_bytes(stage, Psi, N) = memory."""
    return memory / paper_bytes(stage, 1.0, n_devices)


def _width(k: int) -> int:
    return k * WIDTH_STEP


def largest_by_state(stage: str, n_devices: int, memory: float) -> int:
    """Largest width (a multiple of WIDTH_STEP) whose model state fits; 0 if none does."""
    fits = lambda k: paper_bytes(stage, param_count(family_shape(_width(k))),  # noqa: E731
                                 n_devices) <= memory
    return _width(_bisect(fits, 0, MAX_WIDTH_STEPS))


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest k in [lo, hi] with fits(k), given fits(lo) (or lo == 0) and fits monotone
    decreasing; hi is returned if it fits."""
    if hi > lo and fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclasses.dataclass
class CompiledSearch:
    """Bisection over compiled peaks, its compiles cached (plan_estimate.CompileCache)."""

    setting: ActivationSetting = ActivationSetting()
    cache: CompileCache | None = None
    progress: Callable[[str], None] | None = None
    compiles: int = 0
    peaks: dict = dataclasses.field(default_factory=dict)  # (stage, N, width) -> measured row

    def measure(self, stage: str, n_devices: int, width: int) -> dict:
        key = (stage, n_devices, width)
        if key in self.peaks:
            return self.peaks[key]
        s = self.setting
        model = family_shape(width, seq_len=s.seq_len, dtype=s.dtype, remat=s.remat)
        req = PlanRequest(model=model, devices=n_devices, device_memory=1.0, seq_len=s.seq_len,
                          global_batch=s.micro_batch * s.micro_steps * n_devices)
        cand = Candidate(stage, 1, n_devices, s.remat, s.micro_batch)
        stored = cache_key(req, cand)
        row = self.cache.get(stored) if self.cache else None
        if row is None:
            if self.progress:
                self.progress(f"compiling {stage} N={n_devices} d_model={width} "
                              f"({param_count(model) / 1e9:.3g}B)")
            row = compile_candidate(req, cand)
            self.compiles += 1
            if self.cache:
                self.cache.put(stored, row)
        self.peaks[key] = {**row, "psi": param_count(model), "width": width}
        return self.peaks[key]

    def largest(self, stage: str, n_devices: int, memory: float, *, lo: int = 0,
                hi: int | None = None) -> dict | None:
        """The largest member whose compiled peak fits `memory`, searched between widths lo and
        hi (hi: the state-only answer, which nothing with activations can beat). Widths must
        split over the devices (d_model % N == 0). None if even the smallest does not fit."""
        # Sharded stages split every parameter along d_model over the devices; dp splits none.
        step = WIDTH_STEP if stage == "dp" else math.lcm(WIDTH_STEP, n_devices)
        hi_k = (hi if hi is not None else largest_by_state(stage, n_devices, memory)) // step
        lo_k = max(lo // step, 0)
        fits = lambda k: self.measure(stage, n_devices, k * step)["peak_bytes"] <= memory  # noqa: E731
        if lo_k == 0 and not fits(1):
            return None
        k = _bisect(fits, max(lo_k, 1), hi_k)
        if k < 1:
            return None
        return self.measure(stage, n_devices, k * step)


def table2_row(stage: str, n_devices: int, memory: float, search: CompiledSearch | None,
               lo: int = 0) -> dict:
    """One cell: the paper's formula, our state-only search, and (with `search`) the compiled
    search with activations."""
    width = largest_by_state(stage, n_devices, memory)
    model = family_shape(width)
    row = {"stage": stage, "devices": n_devices, "memory_gb": memory / GB,
           "paper_psi": paper_largest(stage, n_devices, memory),
           "state_psi": param_count(model), "state_width": width,
           "state_layers": model.n_layers,
           "state_gb": paper_bytes(stage, param_count(model), n_devices) / GB,
           "compiled": search is not None}
    if search is not None:
        start = time.perf_counter()
        found = search.largest(stage, n_devices, memory, lo=lo, hi=width)
        row["search_s"] = round(time.perf_counter() - start, 1)
        if found is None:
            row.update(compiled_psi=None, compiled_width=None)
        else:
            row.update(compiled_psi=found["psi"], compiled_width=found["width"],
                       compiled_layers=family_depth(found["width"]),
                       compiled_peak_gb=found["peak_bytes"] / GB,
                       compiled_state_gb=(found["params_bytes"] + found["optimizer_bytes"]
                                          + found["grads_bytes"]) / GB)
    return row
