"""What one planner candidate costs: its memory from the step's layout or its compiled program,
its estimated step time, and a cache of compiled results.

  model state  parameters and optimizer state from the executable's input shardings, the
               gradient accumulator from the micro-step loop's carry (zero.evidence);
  peak         XLA's per-device peak (argument + output + temp - alias), activations included;
  volume       elements one device sends per step over all collectives, in units of Psi.

Without compiling: `layout_state` reads the same state bytes from the step's shardings, and
`saved_activation_bytes` is a lower bound on what the backward pass keeps; the search prunes
with both. JAX must already have its fake devices (`request_cpu_devices(n)` before the backend
starts).

Step time = (training FLOPs + recomputed FLOPs) / device FLOP rate + bytes moved / link
bandwidth. Full remat recomputes each layer's forward, save_dots only the attention's batched
products; zero3 with prefetch overlaps its in-loop all-gathers with compute.

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
import time
from numbers import Real
from pathlib import Path

import jax
import numpy as np

from experiments.training.config import TrainConfig
from experiments.training.optim import make_optimizer
from experiments.zero.evidence import gradient_accumulator_bytes
from experiments.zero.plan_request import Candidate, PlanRequest
from model.config import ModelConfig
from model.flops import param_count, train_flops_per_token
from parallel import hlo, sharded_run
from parallel.rules import spec_for
from parallel.state import abstract_model, init_state, state_specs
from parallel.strategies import from_label

CACHE_VERSION = 1
# Code generation only: LLVM at -O0 and XLA:CPU's loop emitters in place of its MLIR fusion
# emitters. The HLO passes and buffer assignment that decide the peak and the collectives are
# unchanged (plan_accuracy records both peaks per configuration); compiling is much cheaper.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
# What `compile_candidate` returns: a cached entry without these is not used.
RESULT_NUMBERS = ("params_bytes", "optimizer_bytes", "grads_bytes", "peak_bytes",
                  "argument_bytes", "temp_bytes", "volume_psi", "layer_gather_psi", "compile_s")

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


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


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


# ---------------------------------------------------------------- the cache


def cache_key(req: PlanRequest, cand: Candidate) -> str:
    model = dataclasses.replace(req.model, remat=cand.remat, max_len=req.seq_len)
    blob = json.dumps({"v": CACHE_VERSION, "jax": jax.__version__, "model": dataclasses.asdict(
        model), "cand": dataclasses.asdict(cand), "devices": req.devices, "seq": req.seq_len,
        "micro_steps": req.per_device_batch // cand.micro_batch}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def is_result(entry) -> bool:
    """Whether `entry` has the shape `compile_candidate` returns (a cache may hold anything)."""
    return (isinstance(entry, dict) and isinstance(entry.get("grads_from"), str)
            and all(isinstance(entry.get(k), Real) and not isinstance(entry.get(k), bool)
                    for k in RESULT_NUMBERS))


class CompileCache:
    """Per-candidate results in memory and, given a folder, on disk (one small JSON each)."""

    def __init__(self, folder: str | Path | None):
        self.folder = Path(folder) if folder else None
        self.memory: dict[str, dict] = {}

    def get(self, key: str) -> dict | None:
        """The stored result, or None (a miss) when there is none or it is damaged: unreadable,
        not JSON, or JSON of another shape. A miss is compiled again and rewritten."""
        if key in self.memory:
            return self.memory[key]
        if self.folder is None or not (self.folder / f"{key}.json").exists():
            return None
        try:
            entry = json.loads((self.folder / f"{key}.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not is_result(entry):
            return None
        self.memory[key] = entry
        return entry

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


def expected_layer_gather_psi(model: ModelConfig, cand: Candidate, micro_steps: int) -> float:
    """zero3's all-gathers inside the layer loop (forward and backward), in units of Psi."""
    if not cand.strategy.startswith("zero3"):
        return 0.0
    return 2.0 * micro_steps * layer_params(model) / param_count(model)


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
