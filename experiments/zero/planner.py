"""What fits? The training planner: candidates compiled abstractly, ranked, one recommended.

For a model shape, a device count and a device memory, each candidate (strategy dp / zero1 /
zero2 / zero3 / zero3_prefetch, mesh data x fsdp, remat none / save_dots / full, micro-batch)
is the trainer's own step (parallel.sharded_run) lowered on abstract inputs and compiled for
fake CPU devices: nothing is allocated. From the compiled program come

  model state  parameters and optimizer state from the executable's input shardings, the
               gradient accumulator from the micro-step loop's carry (zero_evidence);
  peak         XLA's per-device peak (argument + output + temp - alias), activations included;
  volume       elements one device sends per step over all collectives, in units of Psi.

JAX must already have its fake devices (`request_cpu_devices(n)` before the backend starts).

Compiling is the cost (seconds per candidate), so the search avoids it where it can:
- a candidate whose model state alone (read from the step's shardings, the same bytes the
  compiled program holds) exceeds the usable memory is pruned, and so is one whose state plus
  the activations its remat policy must save (a lower bound on the peak) does;
- candidates are compiled cheapest first (estimated step time, below), and a candidate that
  needs at least the memory of one that did not fit (same strategy, no more fsdp, no more
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

Ranking: estimated step time = (training FLOPs + recomputed FLOPs) / device FLOP rate + bytes
moved / link bandwidth, both rates stated (defaults DEFAULT_TFLOPS, DEFAULT_LINK_GB_S). Full
remat recomputes each layer's forward, save_dots only the attention's batched products; zero3
with prefetch overlaps its in-loop all-gathers with compute. The recommendation is the
candidate with the lowest estimate whose compiled peak fits within the memory less the
headroom.

The peak is XLA:CPU's: in bf16 that backend widens collectives and matmul outputs to f32, so
for dp/zero1/zero2 (whole-model gradients and parameter gathers) it holds f32 copies an
accelerator backend would not make; zero3's widened buffers are per layer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from experiments.cli.config import ConfigError, TrainConfig
from experiments.training.optim import make_optimizer
from experiments.zero.evidence import gradient_accumulator_bytes
from model.config import DTYPES, MODEL_PRESETS, ModelConfig
from model.flops import param_count, train_flops_per_token
from parallel import hlo, sharded_run
from parallel.rules import spec_for
from parallel.state import abstract_model, init_state, state_specs
from parallel.strategies import from_label

GB = 1e9
STRATEGIES = ("dp", "zero1", "zero2", "zero3", "zero3_prefetch")
REMATS = ("none", "save_dots", "full")  # least recomputation (most memory) first
DEFAULT_HEADROOM = 0.10
DEFAULT_TFLOPS = 400.0  # achieved bf16 matmul rate per device (about 40% of an H100's peak)
DEFAULT_LINK_GB_S = 100.0  # collective bandwidth per device
DEFAULT_BUDGET_S = 60.0
HARD_LIMIT_FACTOR = 4  # an unsettled search stops at this many budgets
CACHE_VERSION = 1
# Code generation only: LLVM at -O0 and XLA:CPU's loop emitters instead of its MLIR fusion
# emitters. The HLO passes and buffer assignment that decide the peak and the collectives are
# unchanged (plan_accuracy records both peaks per configuration); compiling takes a fraction
# of the time.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}

# ---------------------------------------------------------------- input parsing

_BYTE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def _parse_quantity(text: str, units: dict[str, float], field: str, example: str) -> float:
    m = _QUANTITY.fullmatch(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in units or float(m.group(1)) <= 0:
        raise ConfigError(f"{field}={text!r}: expected a positive number with a unit "
                          f"({', '.join(u for u in units if u)}), e.g. {example}")
    return float(m.group(1)) * units[unit]


def parse_bytes(text: str, field: str = "device-memory") -> float:
    """'80GB' -> 80e9, '24GiB' -> 24 * 2**30 (GB = 1e9 bytes, as the ZeRO paper counts)."""
    return _parse_quantity(text, _BYTE_UNITS, field, "80GB")


def parse_count(text: str, field: str = "params") -> float:
    """'70B' -> 70e9, '350M' -> 350e6."""
    return _parse_quantity(text, _COUNT_UNITS, field, "70B")


# ---------------------------------------------------------------- the GPT family

# Our GPT family: the GPT-3-style presets' (width, depth) points, depth interpolated log-linearly
# in width between them (and extended along the end segments), head dim 128, d_ff = 4 d_model,
# byte vocabulary. Every one of these presets is a member.
FAMILY_PRESETS = ("1.3b", "7.5b", "128b", "1t")
HEAD_DIM = 128
WIDTH_STEP = 128  # widths searched are multiples of this (the head dim)


def _family_points() -> list[tuple[int, int]]:
    return [(MODEL_PRESETS[p].d_model, MODEL_PRESETS[p].n_layers) for p in FAMILY_PRESETS]


def family_depth(d_model: int) -> int:
    pts = _family_points()
    logd = math.log(d_model)
    i = 0
    while i < len(pts) - 2 and logd > math.log(pts[i + 1][0]):
        i += 1
    (d0, l0), (d1, l1) = pts[i], pts[i + 1]
    slope = (math.log(l1) - math.log(l0)) / (math.log(d1) - math.log(d0))
    return max(1, round(math.exp(math.log(l0) + slope * (logd - math.log(d0)))))


def family_shape(d_model: int, *, seq_len: int = 2048, dtype: str = "bfloat16",
                 remat: str = "full") -> ModelConfig:
    """The member of width d_model (a multiple of WIDTH_STEP)."""
    return ModelConfig(vocab_size=256, d_model=d_model, n_layers=family_depth(d_model),
                       n_heads=max(1, d_model // HEAD_DIM), d_ff=4 * d_model, max_len=seq_len,
                       param_dtype=dtype, compute_dtype=dtype, remat=remat)


def family_width_for(psi: float, max_width: int = 1 << 17) -> int:
    """The member width (multiple of WIDTH_STEP) whose parameter count is closest to psi."""
    lo, hi = 1, max_width // WIDTH_STEP
    while lo < hi:  # smallest width with at least psi parameters
        mid = (lo + hi) // 2
        if param_count(family_shape(mid * WIDTH_STEP)) >= psi:
            hi = mid
        else:
            lo = mid + 1
    cands = [w for w in (lo - 1, lo) if w >= 1]
    return WIDTH_STEP * min(cands, key=lambda w: abs(param_count(family_shape(w * WIDTH_STEP))
                                                     - psi))


def describe_shape(cfg: ModelConfig) -> str:
    kv = f", n_kv_heads {cfg.n_kv_heads}" if cfg.n_kv_heads else ""
    n = param_count(cfg)
    size = next(f"{n / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K"),
                                                              (1, "")) if n >= scale or scale == 1)
    return (f"d_model {cfg.d_model}, n_layers {cfg.n_layers}, n_heads {cfg.n_heads}{kv}, "
            f"d_ff {cfg.d_ff}, vocab {cfg.vocab_size} ({size} params)")


# ---------------------------------------------------------------- request and candidates


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    model: ModelConfig  # shape and dtypes; remat and max_len are set per candidate / request
    devices: int
    device_memory: float  # bytes
    seq_len: int
    global_batch: int  # sequences per optimizer step
    headroom: float = DEFAULT_HEADROOM
    strategies: tuple[str, ...] = STRATEGIES
    remats: tuple[str, ...] = REMATS
    micro_batches: tuple[int, ...] | None = None  # None: every divisor of the per-device batch
    data_sizes: tuple[int, ...] | None = None  # mesh data axis sizes; None: every divisor
    tflops: float = DEFAULT_TFLOPS
    link_gb_s: float = DEFAULT_LINK_GB_S
    shape_note: str = ""

    @property
    def usable(self) -> float:
        return self.device_memory * (1 - self.headroom)

    @property
    def per_device_batch(self) -> int:
        return self.global_batch // self.devices

    def validate(self) -> None:
        """ConfigError naming the field and what is allowed."""
        if self.devices < 1:
            raise ConfigError(f"devices={self.devices}: must be a positive integer")
        if self.seq_len < 1:
            raise ConfigError(f"seq={self.seq_len}: must be a positive integer")
        if self.global_batch < 1 or self.global_batch % self.devices:
            raise ConfigError(f"global-batch={self.global_batch}: must be a positive multiple "
                              f"of devices={self.devices} (every device gets whole sequences)")
        if not 0 <= self.headroom < 1:
            raise ConfigError(f"headroom={self.headroom}: must be in [0, 1)")
        if not self.device_memory > 0:
            raise ConfigError(f"device-memory={self.device_memory}: must be positive")
        for name in ("tflops", "link_gb_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"{name.replace('_', '-')}={getattr(self, name)}: must be a "
                                  f"positive number")
        for s in self.strategies:
            if s not in STRATEGIES:
                raise ConfigError(f"strategies: {s!r} not allowed; allowed "
                                  f"{', '.join(STRATEGIES)}")
        for r in self.remats:
            if r not in REMATS:
                raise ConfigError(f"remats: {r!r} not allowed; allowed {', '.join(REMATS)}")
        for m in self.micro_batches or ():
            if m < 1 or self.per_device_batch % m:
                raise ConfigError(f"micro-batches: {m} must divide the per-device batch "
                                  f"{self.per_device_batch} (global-batch / devices)")
        for a in self.data_sizes or ():
            if a < 1 or self.devices % a:
                raise ConfigError(f"data-sizes: {a} must divide devices={self.devices}")
        if self.model.param_dtype not in DTYPES:
            raise ConfigError(f"dtype={self.model.param_dtype!r}: allowed {', '.join(DTYPES)}")
        try:
            dataclasses.replace(self.model, max_len=self.seq_len).validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Candidate:
    strategy: str
    data: int
    fsdp: int
    remat: str
    micro_batch: int  # sequences per device per micro-step

    @property
    def mesh(self) -> str:
        return f"data={self.data},fsdp={self.fsdp}"

    @property
    def remat_rank(self) -> int:
        return REMATS.index(self.remat)  # 0 = no recomputation

    def needs_at_least_as_much_as(self, other: Candidate) -> bool:
        """self's peak cannot be below other's: same strategy, no more fsdp sharding, no more
        recomputation, no smaller micro-batch (more data replication only adds state)."""
        return (self.strategy == other.strategy and self.fsdp <= other.fsdp
                and self.remat_rank <= other.remat_rank and self.micro_batch >= other.micro_batch)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(req: PlanRequest) -> list[Candidate]:
    """The grid. dp holds and moves the same on every mesh, so it is listed on fsdp=N only;
    meshes whose fsdp size does not divide d_model (every parameter is split along it) are left
    out for the strategies that shard; zero3_prefetch always recomputes (remat full only)."""
    out = []
    micro = req.micro_batches or tuple(_divisors(req.per_device_batch))
    datas = req.data_sizes or tuple(_divisors(req.devices))
    for s in req.strategies:
        for a in datas:
            fsdp = req.devices // a
            if s == "dp" and a != 1:
                continue
            if s != "dp" and req.model.d_model % fsdp:
                continue
            # zero3 with prefetch writes its own layer loop that saves only each layer's input
            # and recomputes the layer: remat=full whatever the setting says.
            remats = req.remats if s != "zero3_prefetch" else \
                tuple(r for r in req.remats if r == "full")
            for r in remats:
                for m in micro:
                    out.append(Candidate(s, a, fsdp, r, m))
    return out


# ---------------------------------------------------------------- model state from the layout


@functools.cache
def _abstract(model: ModelConfig):
    """(logical axes, abstract state) of a shape, with the trainer's optimizer."""
    tx = make_optimizer(TrainConfig())
    _, axes, _ = abstract_model(model)
    return axes, jax.eval_shape(lambda: init_state(model, tx, 0)), tx


def _shard_bytes(leaf, spec, fsdp: int) -> int:
    shape = list(leaf.shape)
    for i, axis in enumerate(spec):
        names = axis if isinstance(axis, tuple) else (axis,)
        if "fsdp" in names:
            shape[i] //= fsdp
    return math.prod(shape) * np.dtype(leaf.dtype).itemsize


@functools.cache
def layout_state(model: ModelConfig, strategy: str, fsdp: int) -> dict[str, int]:
    """Per-device params / grads / optimizer bytes from the step's shardings, without compiling:
    what the compiled program's inputs and gradient accumulator hold (tests compare them)."""
    model = dataclasses.replace(model, remat="none")  # no layout depends on it
    axes, state, tx = _abstract(model)
    strat = from_label(strategy)
    specs = state_specs(state, axes, strat, tx)
    total = lambda tree, spec_tree: sum(  # noqa: E731
        _shard_bytes(leaf, spec, fsdp) for leaf, spec in
        zip(jax.tree.leaves(tree), jax.tree.leaves(spec_tree, is_leaf=_is_spec), strict=True))
    grad_specs = jax.tree.map(lambda a: spec_for(a, strat.shards_grads), axes, is_leaf=_is_spec)
    return {"params": total(state["params"], specs["params"]),
            "grads": total(state["params"], grad_specs),
            "optimizer": total(state["opt"], specs["opt"])}


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def saved_activation_bytes(model: ModelConfig, remat: str, micro_batch: int, seq_len: int) -> int:
    """A lower bound on what one micro-step's backward pass keeps per device: the layer inputs
    under full remat, plus the outputs of every weight matmul otherwise (save_dots keeps them;
    none keeps them and more)."""
    item = np.dtype(model.compute_dtype).itemsize
    per_token = model.d_model  # the layer input the scan saves
    if remat != "full":
        kv = model.kv_heads * model.head_dim
        mlp_out = (2 if model.mlp == "swiglu" else 1) * model.d_ff
        per_token = 2 * model.d_model + 2 * kv + mlp_out + model.d_model  # q, o, k, v, mlp
    return model.n_layers * micro_batch * seq_len * per_token * item


# ---------------------------------------------------------------- compiling one candidate


def _layer_loop_collectives(found, n_layers: int, micro_steps: int):
    """Collectives inside a layer loop (trip count L, or L-1 / L-2 where prefetch peels a
    layer), the ENTRY-level micro-step loop excepted."""
    trips = {n_layers, n_layers - 1, n_layers - 2} - {0, 1}
    out = []
    for c in found:
        loops = c.loops[1:] if micro_steps >= 2 and c.loops and c.loops[0][1] == micro_steps \
            else c.loops
        if any(t in trips for _, t in loops):
            out.append(c)
    return out


def compile_candidate(req: PlanRequest, cand: Candidate) -> dict:
    """Compile one candidate's step abstractly and read state, peak and volume from it."""
    model = dataclasses.replace(req.model, remat=cand.remat, max_len=req.seq_len)
    micro_steps = req.per_device_batch // cand.micro_batch
    _, _, tx = _abstract(dataclasses.replace(model, remat="none"))
    start = time.perf_counter()
    lowered, args = sharded_run.lower_step(
        model, cand.strategy, req.devices, tx=tx, seq_len=req.seq_len, micro_steps=micro_steps,
        seqs_per_device=cand.micro_batch, mesh_spec=cand.mesh)
    compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    inputs = hlo.input_bytes_per_device(compiled, args)[0]
    layout = layout_state(req.model, cand.strategy, cand.fsdp)
    if micro_steps >= 2:
        grads, grads_from = gradient_accumulator_bytes(text, micro_steps), "compiled loop carry"
    else:  # one micro-step: XLA removes the loop and fuses the gradients into the update
        grads, grads_from = layout["grads"], "step layout (one micro-step: no accumulator)"
    peak = hlo.memory_peak(compiled)
    psi = param_count(model)
    found = hlo.collectives(text)
    in_loop_gathers = [c for c in _layer_loop_collectives(found, model.n_layers, micro_steps)
                       if c.kind == "all-gather"]
    return {
        "params_bytes": sum(jax.tree.leaves(inputs["params"])),
        "optimizer_bytes": sum(jax.tree.leaves(inputs["opt"])),
        "grads_bytes": grads, "grads_from": grads_from,
        "peak_bytes": peak.peak, "argument_bytes": peak.argument, "temp_bytes": peak.temp,
        "volume_psi": hlo.volume_per_step(found) / psi,
        "layer_gather_psi": hlo.volume_per_step(in_loop_gathers) / psi,
        "compile_s": round(compile_s, 2),
    }


def cache_key(req: PlanRequest, cand: Candidate) -> str:
    model = dataclasses.replace(req.model, remat=cand.remat, max_len=req.seq_len)
    blob = json.dumps({"v": CACHE_VERSION, "jax": jax.__version__, "model": dataclasses.asdict(
        model), "cand": dataclasses.asdict(cand), "devices": req.devices, "seq": req.seq_len,
        "micro_steps": req.per_device_batch // cand.micro_batch}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class CompileCache:
    """Per-candidate results in memory and, given a folder, on disk (one small JSON each)."""

    def __init__(self, folder: str | Path | None):
        self.folder = Path(folder) if folder else None
        self.memory: dict[str, dict] = {}

    def get(self, key: str) -> dict | None:
        if key in self.memory:
            return self.memory[key]
        if self.folder and (self.folder / f"{key}.json").exists():
            try:
                self.memory[key] = json.loads((self.folder / f"{key}.json").read_text())
            except (OSError, json.JSONDecodeError):
                return None  # a damaged entry is recompiled and rewritten
            return self.memory[key]
        return None

    def put(self, key: str, value: dict) -> None:
        self.memory[key] = value
        if self.folder:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f"{key}.json.tmp"
            tmp.write_text(json.dumps(value))
            tmp.replace(self.folder / f"{key}.json")


# ---------------------------------------------------------------- estimated step time


def layer_params(model: ModelConfig) -> int:
    """Parameters of the stacked layers (everything but embedding, final norm and head)."""
    return param_count(model) - param_count(dataclasses.replace(model, n_layers=0))


def expected_volume_psi(model: ModelConfig, cand: Candidate, micro_steps: int) -> float:
    """The ZeRO paper's volumes with our step's placement (orders the compiles; the ranking
    uses the compiled volume): dp 2, zero1 2, zero2 one reduce-scatter per micro-step plus the
    parameter gather, zero3 3 per micro-step for the layers and 2 for the rest; shards
    replicated over `data` add their all-reduce there."""
    psi, layers = param_count(model), layer_params(model)
    over_data = 2.0 / cand.fsdp if cand.data > 1 else 0.0
    base = cand.strategy.removesuffix("_prefetch")
    if base in ("dp", "zero1"):
        return 2.0 + (over_data if base == "zero1" else 0.0)
    if base == "zero2":
        return micro_steps + 1.0 + over_data
    return micro_steps * (3 * layers + 2 * (psi - layers)) / psi + over_data * micro_steps


def recompute_flops_per_token(model: ModelConfig, remat: str, seq_len: int) -> float:
    """Forward FLOPs the backward pass redoes: every layer's forward (full) or the attention's
    batched products, which save_dots does not keep (causal half, as model.flops counts)."""
    attention = 2.0 * model.n_layers * seq_len * model.d_model
    if remat == "full":
        return 2.0 * layer_params(model) + attention
    return attention if remat == "save_dots" else 0.0


def estimate_step(req: PlanRequest, cand: Candidate, volume_psi: float,
                  layer_gather_psi: float) -> dict:
    model = req.model
    tokens = req.per_device_batch * req.seq_len
    rate = req.tflops * 1e12
    compute = train_flops_per_token(model, req.seq_len) * tokens / rate
    recompute = recompute_flops_per_token(model, cand.remat, req.seq_len) * tokens / rate
    elem = np.dtype(model.param_dtype).itemsize
    bw = req.link_gb_s * 1e9
    comm = volume_psi * param_count(model) * elem / bw
    hidden = 0.0
    if cand.strategy == "zero3_prefetch":  # its in-loop gathers run under the layers' compute
        hidden = min(layer_gather_psi * param_count(model) * elem / bw, compute + recompute)
    return {"compute_s": compute, "recompute_s": recompute, "comm_s": comm,
            "step_s": compute + recompute + comm - hidden}


def _expected_layer_gather_psi(model: ModelConfig, cand: Candidate, micro_steps: int) -> float:
    if not cand.strategy.startswith("zero3"):
        return 0.0
    return 2.0 * micro_steps * layer_params(model) / param_count(model)


# ---------------------------------------------------------------- the search


@dataclasses.dataclass
class Row:
    cand: Candidate
    micro_steps: int
    state: dict  # layout state parts (bytes)
    status: str = "not compiled"  # compiled | cached | pruned | implied | predicted | not compiled
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


def plan(req: PlanRequest, *, cache: CompileCache | None = None,
         budget_s: float = DEFAULT_BUDGET_S,
         progress: Callable[[str], None] | None = None,
         measure: Callable[[PlanRequest, Candidate], dict] = compile_candidate) -> dict:
    """Search the grid (see module doc): {"candidates": [...], "recommended": row or None,
    plus how the search went}. `budget_s` bounds the compiling done after the recommendation
    is settled."""
    req.validate()
    cache = cache or CompileCache(None)
    say = progress or (lambda _: None)
    start = time.perf_counter()
    rows = []
    for c in candidates(req):
        ms = req.per_device_batch // c.micro_batch
        row = Row(c, ms, layout_state(req.model, c.strategy, c.fsdp))
        state = sum(row.state.values())
        floor = state + saved_activation_bytes(req.model, c.remat, c.micro_batch, req.seq_len)
        if state > req.usable:
            row.status, row.reason = "pruned", (f"model state {state / GB:.3g} GB > usable "
                                                f"{req.usable / GB:.3g} GB")
        elif floor > req.usable:
            row.status, row.reason = "pruned", (f"model state + saved activations "
                                                f"{floor / GB:.3g} GB > usable "
                                                f"{req.usable / GB:.3g} GB")
        row.est = estimate_step(req, c, expected_volume_psi(req.model, c, ms),
                                _expected_layer_gather_psi(req.model, c, ms))
        rows.append(row)

    # Cheapest first; among equals the larger micro-batch (whose failure rules out the rest).
    order = sorted((r for r in rows if r.status != "pruned"),
                   key=lambda r: (round(r.est["step_s"], 9), -r.cand.micro_batch,
                                  r.cand.remat_rank, r.cand.data, r.cand.strategy))
    failed: list[Row] = []
    compiled: list[Row] = []
    best: Row | None = None
    n_compiles = 0
    complete = True
    for row in order:
        elapsed = time.perf_counter() - start
        settled = best is not None and row.est["step_s"] > best.est["step_s"]
        if settled and elapsed > budget_s:
            break
        if elapsed > HARD_LIMIT_FACTOR * budget_s:  # unsettled: say the answer may not be best
            complete = False
            break
        c = row.cand
        blocker = next((f for f in failed if c.needs_at_least_as_much_as(f.cand)), None)
        if blocker is not None:
            row.status, row.reason = "implied", (f"needs at least the memory of {_name(blocker)}"
                                                 f", which does not fit")
            continue
        prediction = _predicted_peak(row, compiled)
        if prediction is not None and prediction[0] > req.usable:
            row.status, row.reason = "predicted", (
                f"peak at least {prediction[0] / GB:.3g} GB (scaled from "
                f"{_name(prediction[1])})")
            continue
        key = cache_key(req, c)
        result = cache.get(key)
        if result is None:
            say(f"compiling {_name(row)} ({time.perf_counter() - start:.0f} s)")
            result = measure(req, c)
            cache.put(key, result)
            row.status = "compiled"
            n_compiles += 1
        else:
            row.status = "cached"
        row.measured = {**result, "fits": result["peak_bytes"] <= req.usable}
        row.est = estimate_step(req, c, result["volume_psi"], result["layer_gather_psi"])
        compiled.append(row)
        if row.measured["fits"]:
            if best is None or row.est["step_s"] < best.est["step_s"]:
                best = row
        else:
            failed.append(row)
    for row in rows:
        if row.status == "not compiled":
            row.reason = "time budget spent"

    ranked = sorted(rows, key=lambda r: (r.fits is not True, r.fits is None,
                                         r.est["step_s"] if r.est else math.inf))
    return {
        "candidates": [r.to_json() for r in ranked],
        "recommended": best.to_json() if best else None,
        "request": request_json(req),
        "compiles": n_compiles,
        # False when the time limit stopped the search before every candidate estimated cheaper
        # than the recommendation was compiled or ruled out.
        "complete": complete,
        "wall_s": round(time.perf_counter() - start, 1),
        "counts": {s: sum(r.status == s for r in rows) for s in
                   ("compiled", "cached", "pruned", "implied", "predicted", "not compiled")},
    }


def _name(row_or_cand) -> str:
    c = row_or_cand.cand if isinstance(row_or_cand, Row) else row_or_cand
    return f"{c.strategy} {c.mesh} remat={c.remat} micro_batch={c.micro_batch}"


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
