"""What fits? The training planner: candidates compiled abstractly, ranked, one recommended.

For a model shape, a device count and a device memory (`plan_request.PlanRequest`), each
candidate (strategy dp / zero1 / zero2 / zero3 / zero3_prefetch, mesh data x fsdp, remat none /
save_dots / full, micro-batch) is the trainer's own step (parallel.sharded_run) lowered on
abstract inputs and compiled for fake CPU devices: nothing is allocated. `plan_estimate` says
what is read from the compiled program and how a step's time is estimated.

Compiling is the cost, so the search avoids it where it can:
- a candidate whose model state alone (read from the step's shardings, the same bytes the
  compiled program holds) exceeds the usable memory is pruned, and so is one whose state plus
  the activations its remat policy must save (a lower bound on the peak) does;
- candidates are compiled cheapest first (estimated step time), and a candidate that needs at
  least the memory of one that did not fit (same strategy, no more fsdp, no more
  recomputation, no smaller micro-batch) is not compiled: it cannot fit either;
- within one (strategy, mesh, remat), the peak grows at least linearly with the micro-batch
  above the model state: after a compile at micro-batch m, a smaller m' whose scaled-down
  prediction state + (peak - state) * m'/m is still over budget is skipped (that prediction
  is low, never high, when the peak is state + fixed + linear activations);
- results are cached per candidate on disk (key: shape, candidate, batch, JAX version).
Once the recommendation is settled (every candidate estimated cheaper is compiled or ruled
out), compiling goes on down the list until the time budget is spent; the rest are listed as
not compiled. An unsettled search stops at HARD_LIMIT_FACTOR budgets and says so
("complete": false).

Ranking: the estimated step time, both rates stated (defaults DEFAULT_TFLOPS,
DEFAULT_LINK_GB_S). The recommendation is the candidate with the lowest estimate whose compiled
peak fits within the memory less the headroom.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from experiments.zero.plan_estimate import (
    CompileCache,
    cache_key,
    compile_candidate,
    estimate_step,
    expected_layer_gather_psi,
    expected_volume_psi,
    layout_state,
    saved_activation_bytes,
)
from experiments.zero.plan_family import describe_shape
from experiments.zero.plan_request import GB, Candidate, PlanRequest, candidates
from model.flops import param_count

DEFAULT_BUDGET_S = 60.0
HARD_LIMIT_FACTOR = 4  # an unsettled search stops at this many budgets
STATUSES = ("compiled", "cached", "pruned", "implied", "predicted", "not compiled")

Measure = Callable[[PlanRequest, Candidate], dict]


@dataclasses.dataclass
class Row:
    cand: Candidate
    micro_steps: int
    state: dict  # layout state parts (bytes)
    status: str = "not compiled"  # one of STATUSES
    reason: str = ""
    measured: dict | None = None
    est: dict | None = None

    @property
    def model_state_bytes(self) -> int:
        if self.measured:
            m = self.measured
            return m["params_bytes"] + m["optimizer_bytes"] + m["grads_bytes"]
        return sum(self.state.values())

    @property
    def fits(self) -> bool | None:
        if self.measured is not None:
            return self.measured["fits"]
        return False if self.status in ("pruned", "implied", "predicted") else None

    def to_json(self) -> dict:
        c, m = self.cand, self.measured
        return {
            "strategy": c.strategy, "mesh": c.mesh, "remat": c.remat,
            "micro_batch": c.micro_batch, "micro_steps": self.micro_steps,
            "model_state_gb": self.model_state_bytes / GB,
            "peak_gb": m["peak_bytes"] / GB if m else None,
            "comm_volume_psi": m["volume_psi"] if m else None,
            "fits": self.fits,
            "est_step_s": self.est["step_s"] if self.est else None,
            "status": self.status, "reason": self.reason,
            **({"compile_s": m["compile_s"], "grads_from": m["grads_from"]} if m else {}),
        }


@dataclasses.dataclass
class _Search:
    """The compiling part of a plan: what has been compiled, what failed, the best so far."""

    req: PlanRequest
    cache: CompileCache
    measure: Measure
    say: Callable[[str], None]
    start: float
    failed: list[Row] = dataclasses.field(default_factory=list)
    compiled: list[Row] = dataclasses.field(default_factory=list)
    best: Row | None = None
    compiles: int = 0
    complete: bool = True

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def run(self, order: list[Row], budget_s: float) -> None:
        """Settle each row in `order` until the budget is spent (see the module doc)."""
        for row in order:
            elapsed = self.elapsed()
            settled = self.best is not None and row.est["step_s"] > self.best.est["step_s"]
            if settled and elapsed > budget_s:
                return
            if elapsed > HARD_LIMIT_FACTOR * budget_s:  # the answer may not be the best
                self.complete = False
                return
            if not self._ruled_out(row):
                self._compile(row)

    def _ruled_out(self, row: Row) -> bool:
        """Mark `row` implied or predicted (without compiling) when it cannot fit."""
        blocker = next((f for f in self.failed if row.cand.needs_at_least_as_much_as(f.cand)),
                       None)
        if blocker is not None:
            row.status, row.reason = "implied", (f"needs at least the memory of "
                                                 f"{blocker.cand.name}, which does not fit")
            return True
        prediction = _predicted_peak(row, self.compiled)
        if prediction is not None and prediction[0] > self.req.usable:
            row.status, row.reason = "predicted", (
                f"peak at least {prediction[0] / GB:.3g} GB (scaled from "
                f"{prediction[1].cand.name})")
            return True
        return False

    def _compile(self, row: Row) -> None:
        """Measure `row` (from the cache if it holds it) and update the best and the failures."""
        key = cache_key(self.req, row.cand)
        result = self.cache.get(key)
        if result is None:
            self.say(f"compiling {row.cand.name} ({self.elapsed():.0f} s)")
            result = self.measure(self.req, row.cand)
            self.cache.put(key, result)
            row.status = "compiled"
            self.compiles += 1
        else:
            row.status = "cached"
        row.measured = {**result, "fits": result["peak_bytes"] <= self.req.usable}
        row.est = estimate_step(self.req, row.cand, result["volume_psi"],
                                result["layer_gather_psi"])
        self.compiled.append(row)
        if not row.measured["fits"]:
            self.failed.append(row)
        elif self.best is None or row.est["step_s"] < self.best.est["step_s"]:
            self.best = row


def _first_row(req: PlanRequest, cand: Candidate) -> Row:
    """A candidate before compiling: pruned if its state (or state plus the activations its
    remat must save) exceeds the usable memory, and estimated from the paper's volumes."""
    micro_steps = req.per_device_batch // cand.micro_batch
    row = Row(cand, micro_steps, layout_state(req.model, cand.strategy, cand.fsdp))
    state = sum(row.state.values())
    floor = state + saved_activation_bytes(req.model, cand.remat, cand.micro_batch, req.seq_len)
    usable = f"usable {req.usable / GB:.3g} GB"
    if state > req.usable:
        row.status, row.reason = "pruned", f"model state {state / GB:.3g} GB > {usable}"
    elif floor > req.usable:
        row.status, row.reason = "pruned", (f"model state + saved activations "
                                            f"{floor / GB:.3g} GB > {usable}")
    row.est = estimate_step(req, cand, expected_volume_psi(req.model, cand, micro_steps),
                            expected_layer_gather_psi(req.model, cand, micro_steps))
    return row


def _compile_order(rows: list[Row]) -> list[Row]:
    """Cheapest first; among equals the larger micro-batch (whose failure rules out the rest)."""
    return sorted((r for r in rows if r.status != "pruned"),
                  key=lambda r: (round(r.est["step_s"], 9), -r.cand.micro_batch,
                                 r.cand.remat_rank, r.cand.data, r.cand.strategy))


def _predicted_peak(row: Row, compiled: list[Row]) -> tuple[float, Row] | None:
    """The lowest peak row's candidate can have given a compiled larger micro-batch of the same
    (strategy, mesh, remat): state + (peak - state) * m / m_compiled."""
    best = None
    for other in compiled:
        o = other.cand
        if (o.strategy, o.data, o.remat) != (row.cand.strategy, row.cand.data, row.cand.remat) \
                or o.micro_batch <= row.cand.micro_batch:
            continue
        state = other.model_state_bytes
        guess = state + (other.measured["peak_bytes"] - state) * row.cand.micro_batch / \
            o.micro_batch
        if best is None or guess > best[0]:
            best = (guess, other)
    return best


def plan(req: PlanRequest, *, cache: CompileCache | None = None,
         budget_s: float = DEFAULT_BUDGET_S,
         progress: Callable[[str], None] | None = None,
         measure: Measure = compile_candidate) -> dict:
    """Search the grid (see module doc): {"candidates": [...], "recommended": row or None,
    plus how the search went}. `budget_s` bounds the compiling done after the recommendation
    is settled."""
    req.validate()
    search = _Search(req, cache or CompileCache(None), measure, progress or (lambda _: None),
                     time.perf_counter())
    rows = [_first_row(req, c) for c in candidates(req)]
    search.run(_compile_order(rows), budget_s)
    for row in rows:
        if row.status == "not compiled":
            row.reason = "time budget spent"
    ranked = sorted(rows, key=lambda r: (r.fits is not True, r.fits is None,
                                         r.est["step_s"] if r.est else math.inf))
    return {
        "candidates": [r.to_json() for r in ranked],
        "recommended": search.best.to_json() if search.best else None,
        "request": request_json(req),
        "compiles": search.compiles,
        # False when the time limit stopped the search before every candidate estimated cheaper
        # than the recommendation was compiled or ruled out.
        "complete": search.complete,
        "wall_s": round(search.elapsed(), 1),
        "counts": {s: sum(r.status == s for r in rows) for s in STATUSES},
    }


def request_json(req: PlanRequest) -> dict:
    return {"shape": describe_shape(req.model), "shape_note": req.shape_note,
            "params": param_count(req.model), "devices": req.devices,
            "device_memory_gb": req.device_memory / GB, "headroom": req.headroom,
            "usable_gb": req.usable / GB, "seq": req.seq_len, "global_batch": req.global_batch,
            "dtype": req.model.param_dtype, "tflops": req.tflops, "link_gb_s": req.link_gb_s,
            "ranking": "estimated step time = (training + recomputed FLOPs) / tflops + bytes "
                       "moved / link bandwidth; zero3_prefetch hides its in-loop all-gathers",
            "peak": "XLA:CPU compiled peak per device (argument + output + temp - alias)"}


def format_table(result: dict, show_all: bool = False) -> str:
    """The ranked table: every candidate that fits, then (with show_all) the rest."""
    rows = [r for r in result["candidates"] if show_all or r["fits"]]
    head = (f"{'#':>3} {'strategy':<14} {'mesh':<16} {'remat':<9} {'mb':>3} {'ms':>3} "
            f"{'state GB':>9} {'peak GB':>9} {'vol Ψ':>7} {'est s':>7} {'fits':>5}  source")
    lines = [head]
    for i, r in enumerate(rows, 1):
        peak = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "—"
        vol = f"{r['comm_volume_psi']:.2f}" if r["comm_volume_psi"] is not None else "—"
        est = f"{r['est_step_s']:.2f}" if r["est_step_s"] is not None else "—"
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        src = r["status"] + (f": {r['reason']}" if r["reason"] and r["status"] not in
                             ("compiled", "cached") else "")
        lines.append(f"{i:>3} {r['strategy']:<14} {r['mesh']:<16} {r['remat']:<9} "
                     f"{r['micro_batch']:>3} {r['micro_steps']:>3} {r['model_state_gb']:>9.2f} "
                     f"{peak:>9} {vol:>7} {est:>7} {fits:>5}  {src}")
    return "\n".join(lines)
