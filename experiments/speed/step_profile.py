"""Where a jitted step's time goes: step timing, this machine's matmul peak, and a per-operation
breakdown of one step from a `jax.profiler` trace.

The trace names each executed operation of the compiled program (an HLO instruction, usually a
fusion); the compiled program's text gives each one its opcode, whether it contains a dot, and
its JAX name stack. The model and the train step label their parts with name scopes
(model.transformer.ATTENTION_SCOPE, model.layers.EMBED_SCOPE, model.loss.LOSS_SCOPE,
parallel.train_step.UPDATE_SCOPE), so every operation falls in one category of CATEGORIES;
the backward pass keeps its forward's scopes (autodiff transposes inside the same name stack).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from model.layers import EMBED_SCOPE
from model.loss import LOSS_SCOPE
from model.transformer import ATTENTION_SCOPE
from parallel.train_step import UPDATE_SCOPE

# The breakdown's groups; "host" is step wall time minus the time the device program ran.
CATEGORIES = ("matmul", "attention", "norms_rope_elementwise", "embedding", "loss", "optimizer",
              "collectives", "host")
# First matching scope wins: the update scope holds elementwise work only, the attention scope
# holds dots that are not projections.
_SCOPES = ((UPDATE_SCOPE, "optimizer"), (LOSS_SCOPE, "loss"), (EMBED_SCOPE, "embedding"),
           (ATTENTION_SCOPE, "attention"))
_COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
                "all-reduce-start", "all-reduce-done", "all-gather-start", "all-gather-done"}
# Operations that only run others (their trace events contain their body's events).
_CONTROL = {"while", "conditional", "call", "async-start", "async-done"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
EXECUTE_EVENT = "ThunkExecutor::Execute"


def parse_hlo(text: str) -> dict[str, dict]:
    """{instruction name: {opcode, shape, op_name, has_dot, target}} of a compiled program's
    text (`target`: a custom call's target name, else "")."""
    bodies: dict[str, str] = {}
    current, lines = None, []
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current, lines = m.group(1), []
        elif line.startswith("}") and current is not None:
            bodies[current], current = "\n".join(lines), None
        elif current is not None:
            lines.append(line)
    out = {}
    for body in bodies.values():
        for line in body.splitlines():
            m = _INSTR.match(line)
            if not m:
                continue
            name, shape, opcode, rest = m.groups()
            called = re.search(r"calls=%([\w.-]+)", rest)
            inner = bodies.get(called.group(1), "") if called else ""
            op_name = re.search(r'op_name="([^"]*)"', rest)
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            out[name] = {"opcode": opcode, "shape": shape,
                         "op_name": op_name.group(1) if op_name else "",
                         "target": target.group(1) if target else "",
                         "has_dot": opcode in ("dot", "convolution")
                         or bool(re.search(r" (dot|convolution)\(", inner))}
    return out


def categorize(instr: dict) -> str:
    """The breakdown group of one compiled operation (see CATEGORIES)."""
    if instr["opcode"] in _COLLECTIVES:
        return "collectives"
    for scope, category in _SCOPES:
        # A scope appears as a name-stack component, or wrapped by autodiff: jvp(scope),
        # transpose(jvp(scope)).
        if re.search(rf"(?:^|[/(]){re.escape(scope)}(?:[/)]|$)", instr["op_name"]):
            return category
    return "matmul" if instr["has_dot"] else "norms_rope_elementwise"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def read_trace(folder: Path) -> list[dict]:
    """The complete ("X") events of the perfetto trace `jax.profiler` wrote under `folder`."""
    path = next(folder.rglob("perfetto_trace.json.gz"))
    data = json.loads(gzip.decompress(path.read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def op_times(events: list[dict], instrs: dict[str, dict], group_of) -> tuple:
    """(busy time per group, busy time per operation, [(start, end)] of each executed operation)
    of a trace's events, in microseconds; operations that only run others are left out."""
    busy: collections.Counter = collections.Counter()
    per_op: collections.Counter = collections.Counter()
    spans = []
    for e in events:
        instr = instrs.get(e["name"])
        if instr is None or instr["opcode"] in _CONTROL:
            continue
        busy[group_of(instr)] += e["dur"]
        per_op[e["name"]] += e["dur"]
        spans.append((e["ts"], e["ts"] + e["dur"]))
    return busy, per_op, spans


def step_breakdown(step, state, batch, *, steps: int = 2) -> tuple[object, dict]:
    """(state after, breakdown) of `steps` traced calls of the jitted `step(state, batch)` (the
    state is donated, so the caller continues with the returned one).

    Breakdown: `fractions` of the step's wall time per CATEGORIES entry (summing to 1); the
    device share is split in proportion to each category's summed operation time (operations
    of one program run concurrently on the CPU's threads, so summed time exceeds wall time);
    `top_ops`: the longest operations with their category and name stack.
    """
    instrs = parse_hlo(step.lower(state, batch).compile().as_text())
    walls = []
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        try:
            for _ in range(steps):
                t = time.perf_counter()
                state, metrics = step(state, batch)
                jax.block_until_ready(metrics["loss"])
                walls.append(time.perf_counter() - t)
        finally:
            jax.profiler.stop_trace()
        events = read_trace(Path(tmp))
    busy, per_op, op_spans = op_times(events, instrs, categorize)
    execute = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == EXECUTE_EVENT]
    device_s = union_length(execute or op_spans) / 1e6 / steps
    wall_s = sum(walls) / steps
    host = min(1.0, max(0.0, 1 - device_s / wall_s))
    total = sum(busy.values()) or 1.0
    fractions = {c: (1 - host) * busy.get(c, 0.0) / total for c in CATEGORIES if c != "host"}
    fractions["host"] = host
    top = [{"op": name, "category": categorize(instrs[name]), "shape": instrs[name]["shape"],
            "op_name": instrs[name]["op_name"], "share_of_device": t / total}
           for name, t in per_op.most_common(12)]
    return state, {"traced_steps": steps, "traced_wall_s": wall_s, "device_s": device_s,
                   "fractions": fractions, "top_ops": top}


def time_steps(step, state, batch, n: int, warmup: int = 0) -> tuple[object, list[float]]:
    """(state after, wall seconds of each of the n timed calls after `warmup` untimed ones); each
    call waits for its loss, as a training loop that logs every step does."""
    times = []
    for i in range(warmup + n):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return state, times


def host_costs(step, state, batch, n: int) -> tuple[object, dict]:
    """(state after, what the host adds to a step): the median time `step(...)` takes to return
    (tracing is cached, so this is jit dispatch: argument handling and enqueueing) and the
    mean step time when n steps are enqueued back to back with one wait at the end, against
    which a loop that waits for every step's loss (time_steps) can be compared."""
    dispatch = []
    for _ in range(n):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        dispatch.append(time.perf_counter() - t)
        jax.block_until_ready(metrics["loss"])
    t = time.perf_counter()
    for _ in range(n):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
    return state, {"dispatch_s": statistics.median(dispatch),
                   "pipelined_step_s": (time.perf_counter() - t) / n}


def median_call_s(fn, *args, calls: int) -> float:
    """Median wall seconds of `calls` waited-for calls of a jitted fn, after one warm-up call
    (compilation excluded)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of a large fp32 matmul (n^3) on this backend: the roof a model step's FLOP/s is
    compared with (median of `reps` timed calls after one warm-up)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    return 2.0 * n**3 / median_call_s(jax.jit(jnp.dot), a, a, calls=reps)
