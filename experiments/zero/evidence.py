"""ZeRO's claims read from compiled training steps: model-state bytes (Table 1), communication
volume, and the release of gathered layers. Library code of the compile-only experiments
(zero_memory, comm_volume, zero_release) and their tests; JAX must already have its fake devices.

Every step is the trainer's own (parallel.sharded_run), lowered on abstract inputs: nothing is
allocated.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from experiments.training.config import PRESETS, TrainConfig
from experiments.training.optim import make_optimizer
from experiments.zero.settings import KEEP_GATHERED, PAPER_PSI, STAGES, ReleaseSetup
from model.config import MODEL_PRESETS
from model.flops import param_count
from parallel import hlo, sharded_run
from parallel.mesh import make_mesh
from parallel.state import abstract_model, check_divisible, init_state
from parallel.strategies import get_strategy
from parallel.train_step import StepConfig, make_train_step

K = 12  # fp32 master + momentum + variance, bytes per parameter


GB = 1e9


def paper_bytes(stage: str, psi: float, n_devices: int) -> float:
    """Per-device model-state bytes of the ZeRO paper (2 bytes params + 2 bytes grads + K)."""
    if stage == "dp":
        return (2 + 2 + K) * psi
    if stage == "zero1":
        return 4 * psi + K * psi / n_devices
    if stage == "zero2":
        return 2 * psi + (2 + K) * psi / n_devices
    if stage == "zero3":
        return (2 + 2 + K) * psi / n_devices
    raise ValueError(f"stage={stage!r}: allowed {', '.join(STAGES)}")


def gradient_accumulator_bytes(hlo_text: str, micro_steps: int) -> int:
    """Per-device bytes of the micro-step loop's gradient accumulator, read from the HLO.

    The micro-step loop is the ENTRY-level while loop with trip count `micro_steps` (the layer
    loops are nested inside it); its updated non-scalar carry is the accumulator (the scalar
    parts are the loop counter and the loss sum).
    """

    loops = [w for w in hlo.while_loops(hlo_text) if hlo.trip_count(w) == micro_steps]
    if len(loops) != 1:
        raise ValueError(f"expected one ENTRY while loop with trip count {micro_steps} (the "
                         f"micro-steps), found {len(loops)}; use --micro-steps >= 2")
    return sum(e.bytes for e in hlo.loop_updated_carry(hlo_text, loops[0]) if not e.is_scalar)


def model_state(compiled, args, micro_steps: int) -> dict[str, int]:
    """Per-device params / grads / optimizer bytes of a compiled step (see module doc)."""

    state_bytes = hlo.input_bytes_per_device(compiled, args)[0]
    return {"params": sum(jax.tree.leaves(state_bytes["params"])),
            "grads": gradient_accumulator_bytes(compiled.as_text(), micro_steps),
            "optimizer": sum(jax.tree.leaves(state_bytes["opt"]))}


def measure_cell(preset: str, n_devices: int, stage: str, *, seq_len: int,
                 micro_steps: int) -> dict:
    cfg = dataclasses.replace(MODEL_PRESETS[preset], param_dtype="bfloat16",
                              compute_dtype="bfloat16")
    start = time.perf_counter()
    compiled, args = compile_step(cfg, stage, n_devices, seq_len=seq_len, micro_steps=micro_steps)
    compile_s = time.perf_counter() - start
    parts = model_state(compiled, args, micro_steps)
    total = sum(parts.values())
    psi = param_count(cfg)
    paper_psi = PAPER_PSI.get(preset, psi)
    paper = paper_bytes(stage, paper_psi, n_devices)
    memory = hlo.memory_peak(compiled)
    return {
        "params": preset, "n_devices": n_devices, "stage": stage,
        "model_state_gb": total / GB, "paper_gb": paper / GB, "ratio": total / paper,
        "within_2pct": abs(total / paper - 1) <= 0.02,
        "formula_at_our_psi_gb": paper_bytes(stage, psi, n_devices) / GB,
        "ratio_at_our_psi": total / paper_bytes(stage, psi, n_devices),
        "params_gb": parts["params"] / GB, "grads_gb": parts["grads"] / GB,
        "optimizer_gb": parts["optimizer"] / GB,
        "peak_gb": memory.peak / GB, "argument_gb": memory.argument / GB,
        "temp_gb": memory.temp / GB, "psi": psi, "paper_psi": PAPER_PSI.get(preset),
        "compile_s": round(compile_s, 2),
    }


EXPECTED_PSI = {"dp": 2.0, "zero1": 2.0, "zero2": 2.0, "zero3": 3.0, "zero3_prefetch": 3.0,
                "zero3_auto": 3.0}


TOLERANCE = 0.05


N_DEVICES = 8


def model_config(preset: str, remat: str, dtype: str = "float32", n_layers: int | None = None):
    # scan_unroll=1: the layers must run inside a while loop for the loop placement to be seen.
    cfg = MODEL_PRESETS[preset]
    return dataclasses.replace(cfg, scan_unroll=1, remat=remat, param_dtype=dtype,
                               compute_dtype=dtype, n_layers=n_layers or cfg.n_layers)


def layer_param_count(cfg) -> int:
    """Parameters of the stacked layers (everything but embedding, final norm and head)."""

    return param_count(cfg) - param_count(dataclasses.replace(cfg, n_layers=0))


def volume_report(hlo_text: str, cfg) -> dict:
    """Volume of one compiled step in units of Psi, split by kind and by place (see module doc).

    A while loop whose trip count is the layer count is a layer loop (with one micro-step there
    is no micro-step loop to confuse it with). zero3_prefetch peels the last layer of each pass
    out of its loops (trip counts L-1 forward, L-2 backward), so those count as layer loops too;
    its peeled gathers sit outside and layer_param_gathers counts only the in-loop ones.
    """

    psi = param_count(cfg)
    psi_layers = layer_param_count(cfg)
    found = hlo.collectives(hlo_text)
    layer_trips = {cfg.n_layers, cfg.n_layers - 1, cfg.n_layers - 2} - {0, 1}
    in_layer_loop = [c for c in found if any(trips in layer_trips for _, trips in c.loops)]
    by_kind = {kind: hlo.volume_per_step([c for c in found if c.kind == kind]) / psi
               for kind in hlo.COLLECTIVE_KINDS}
    layer_gathers = [c for c in in_layer_loop if c.kind == "all-gather"]
    gathered = sum(c.result_elements * c.executions for c in layer_gathers)
    return {
        "volume_psi": hlo.volume_per_step(found) / psi,
        "all_gather_psi": by_kind["all-gather"],
        "reduce_scatter_psi": by_kind["reduce-scatter"],
        "all_reduce_psi": by_kind["all-reduce"],
        "in_layer_loop_psi": hlo.volume_per_step(in_layer_loop) / psi,
        # The same in units of the layers' own parameters: zero3's 3 (gather, re-gather,
        # reduce-scatter) for the layers, whatever share of Psi the embedding takes.
        "in_layer_loop_psi_layers": hlo.volume_per_step(in_layer_loop) / psi_layers,
        # How many times per step the stacked layer parameters are all-gathered inside the
        # layer loops: 2 = forward gather + backward re-gather (gather-then-release).
        "layer_param_gathers": gathered / psi_layers,
        "all_gathers_in_layer_loop": gathered >= psi_layers,
        "collectives": len(found),
        "gather_dtypes": sorted({dt for c in found if c.kind == "all-gather" for dt in c.dtypes}),
    }


def expected_volume_psi(strategy: str, cfg) -> float:
    """The paper's volume made exact for our layout: zero3 gathers, re-gathers and
    reduce-scatters the stacked layers (3 Psi_layers) but gathers the embedding, final norm and
    head once per step and keeps them for the backward pass (2 Psi for those). The paper's 3 Psi
    assumes every parameter is layer-like; with a large (tied) vocabulary the difference shows."""
    if strategy not in ("zero3", "zero3_prefetch"):
        return EXPECTED_PSI[strategy]
    psi, psi_layers = param_count(cfg), layer_param_count(cfg)
    return (3 * psi_layers + 2 * (psi - psi_layers)) / psi


def measure(strategy: str, cfg) -> dict:
    compiled, _ = compile_step(cfg, strategy, N_DEVICES, seq_len=cfg.max_len, micro_steps=1)
    row = {"strategy": strategy, "remat": cfg.remat, **volume_report(compiled.as_text(), cfg)}
    row["paper_psi"] = EXPECTED_PSI[strategy]
    row["expected_psi"] = expected_volume_psi(strategy, cfg)
    row["within_5pct"] = abs(row["volume_psi"] / row["expected_psi"] - 1) <= TOLERANCE
    return row


STATE_BYTES_PER_PARAM = 2 + 2 + 12  # bf16 params + bf16 grads + fp32 master/mu/nu


# Released if what grows per layer independently of N_d, beyond the carry, is less than this
# fraction of one layer's gathered weights (keeping them makes it 1.0 or more).
RELEASE_TOLERANCE = 0.5


def release_layer_params(setup: ReleaseSetup) -> int:
    return param_count(setup.model(1)) - param_count(setup.model(0))


def gathered_layer_bytes(setup: ReleaseSetup) -> int:
    return release_layer_params(setup) * 2  # one layer's weights, gathered, in bf16


def fit_growth(growth: dict[int, float]) -> tuple[float, float]:
    """(u, s) >= 0 that fit g(N) = u + s / N to the per-layer growth at each device count, by
    non-negative least squares: the part that does not shrink with N_d and the sharded part.
    A memory model whose parts could go negative could explain any measurement."""
    ns = sorted(growth)
    xs, gs = [1.0 / n for n in ns], [float(growth[n]) for n in ns]
    k = len(ns)
    mx, mg = sum(xs) / k, sum(gs) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    s = sum((x - mx) * (g - mg) for x, g in zip(xs, gs, strict=True)) / sxx
    u = mg - s * mx
    if u < 0:  # the best fit through the origin in u
        u, s = 0.0, sum(x * g for x, g in zip(xs, gs, strict=True)) / sum(x * x for x in xs)
    if s < 0:  # the best constant
        u, s = mg, 0.0
    return max(u, 0.0), max(s, 0.0)


def measure_depth(setup: ReleaseSetup, strategy: str, n_layers: int, n_devices: int) -> dict:
    """Peak bytes and the per-step elements moved inside the layer loops, by collective kind."""

    compiled, _ = compile_step(setup.model(n_layers), strategy, n_devices,
                               seq_len=setup.seq_len, micro_steps=1,
                               seqs_per_device=setup.seqs_per_device)
    layer_trips = {n_layers, n_layers - 1, n_layers - 2}  # zero3_prefetch peels a layer per pass
    in_loops = [c for c in hlo.collectives(compiled.as_text())
                if any(trips in layer_trips for _, trips in c.loops)]
    return {"peak": hlo.memory_peak(compiled).peak,
            "layer_loop_elements": {kind: hlo.volume_per_step([c for c in in_loops
                                                               if c.kind == kind])
                                    for kind in hlo.COLLECTIVE_KINDS}}


def release_report(setup: ReleaseSetup, strategy: str, peaks: dict[tuple[int, int], int]) -> dict:
    """Growth per added layer at each device count, its split into a part that shrinks with N_d
    (shards) and one that does not (`fit_growth`), and how many gathered layers the latter
    holds beyond the saved carry."""
    setup.validate()
    (l1, l2), (n1, n2) = setup.depths, setup.devices
    growth = {n: (peaks[(l2, n)] - peaks[(l1, n)]) / (l2 - l1) for n in (n1, n2)}
    unsharded, sharded = fit_growth(growth)
    layer_params, gathered = release_layer_params(setup), gathered_layer_bytes(setup)
    expected_n2 = setup.carry_bytes + STATE_BYTES_PER_PARAM * layer_params / n2
    kept = max(0.0, unsharded - setup.carry_bytes) / gathered
    return {
        "strategy": strategy,
        "peak_bytes": {f"L{layers}_N{n}": peak for (layers, n), peak in sorted(peaks.items())},
        "growth_per_layer_bytes": {f"N{n}": g for n, g in growth.items()},
        "unsharded_growth_per_layer_bytes": unsharded,
        "unsharded_growth_in_carries": unsharded / setup.carry_bytes,
        "sharded_growth_bytes_per_param": sharded / layer_params,
        "carry_bytes": setup.carry_bytes,
        "gathered_layer_bytes": gathered,
        "kept_gathered_layers": kept,
        "released": kept < RELEASE_TOLERANCE,
        f"growth_vs_carry_plus_state_shards_N{n2}": growth[n2] / expected_n2,
    }


def _gathered_layers(compiled, cfg) -> float:
    """All-gathered elements per step beyond one gather of the non-layer parameters, in units
    of the layers' parameters: 2 when each layer is gathered in the forward pass and again in
    the backward pass, 1 when the backward pass reuses the forward pass's gathered weights.
    Counted wherever the gathers sit, so a program without a layer loop is read too."""
    psi, psi_layers = param_count(cfg), layer_param_count(cfg)
    gathered = sum(c.result_elements * c.executions for c in hlo.collectives(compiled.as_text())
                   if c.kind == "all-gather")
    return (gathered - (psi - psi_layers)) / psi_layers


def shipped_release(preset: str, n_devices: int) -> dict:
    """The zero3 step of a runnable preset as shipped (its scan_unroll, remat, dtypes, depth,
    context and batch), beside the control built on the same config: released when the
    backward pass gathers every layer again and the peak stays below the control's.

    A preset with an unrolled layer scan is also compiled with scan_unroll=1, the loop that
    releases, so the row shows what forcing it would cost or save in peak bytes."""
    run = PRESETS[preset]
    cfg = run.model
    seqs = max(1, run.train.batch_size // n_devices)
    variants = {"zero3": cfg, KEEP_GATHERED: cfg}
    if cfg.scan_unroll > 1:
        variants["zero3_unroll1"] = dataclasses.replace(cfg, scan_unroll=1)
    rows = {}
    for variant, variant_cfg in variants.items():
        strategy = KEEP_GATHERED if variant == KEEP_GATHERED else "zero3"
        compiled, _ = compile_step(variant_cfg, strategy, n_devices, seq_len=cfg.max_len,
                                   micro_steps=1, seqs_per_device=seqs)
        rows[variant] = (hlo.memory_peak(compiled).peak, _gathered_layers(compiled, cfg),
                         hlo.volume_per_step(hlo.collectives(compiled.as_text())))
    (peak, gathers, volume), (control_peak, control_gathers, _) = (rows["zero3"],
                                                                   rows[KEEP_GATHERED])
    regathers = gathers > 1.5  # halfway between regathering (2) and keeping (1)
    row = {"preset": preset, "model": dataclasses.asdict(cfg), "n_devices": n_devices,
           "seqs_per_device": seqs, "seq_len": cfg.max_len, "micro_steps": 1,
           "peak_bytes": peak, "control_peak_bytes": control_peak,
           "layer_param_gathers": gathers, "control_layer_param_gathers": control_gathers,
           "regathers_in_backward": regathers, "peak_below_control": peak < control_peak,
           "released": regathers and peak < control_peak,
           # The collectives of the step as shipped, beside comm_volume's expectation for a
           # step that gathers each layer twice.
           "volume_psi": volume / param_count(cfg),
           "expected_volume_psi": expected_volume_psi("zero3", cfg)}
    if "zero3_unroll1" in rows:
        row["unroll1_peak_bytes"], row["unroll1_layer_param_gathers"], _ = rows["zero3_unroll1"]
    return row


def compile_step(model_cfg, strategy: str, n_devices: int, **kwargs):
    """The trainer's step for `strategy` (a label, zero3_prefetch included; or the release
    check's control KEEP_GATHERED) compiled on abstract inputs, with the trainer's default
    optimizer: (compiled, (state, batch) args)."""
    if strategy == KEEP_GATHERED:
        return _compile_keep_gathered(model_cfg, n_devices, **kwargs)
    return sharded_run.compile_step(model_cfg, strategy, n_devices,
                                    tx=make_optimizer(TrainConfig()), **kwargs)


def _compile_keep_gathered(model_cfg, n_devices: int, *, seq_len: int, micro_steps: int,
                           seqs_per_device: int = 1):
    """The control: the zero3 step built as `sharded_run.build` builds it, except that the
    backward pass keeps every gathered layer (never a training step, so built here)."""
    tx, strategy = make_optimizer(TrainConfig()), get_strategy("zero3")
    mesh = make_mesh(n_devices, f"fsdp={n_devices}")
    graphdef, axes, abstract_params = abstract_model(model_cfg)
    check_divisible(abstract_params, axes, mesh, strategy)
    abstract_state = jax.eval_shape(lambda: init_state(model_cfg, tx, 0))
    step_cfg = StepConfig(global_batch=seqs_per_device * n_devices, seq_len=seq_len,
                          micro_steps=micro_steps)
    step, shardings, batch_sharding = make_train_step(
        graphdef, axes, abstract_state, model_cfg, strategy, mesh, tx, step_cfg,
        keep_gathered=True)
    run = sharded_run.ShardedRun(model_cfg, strategy, mesh, tx, step_cfg, graphdef, axes,
                                 abstract_state, shardings, batch_sharding, step)
    args = run.abstract_args()
    return step.lower(*args).compile(), args
