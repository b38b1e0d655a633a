"""Where a decoding step's time goes: one traced call of a jitted token loop, its executed
operations grouped by kind, per token.

The groups say what limits batch-1 decoding on a CPU: the int8 and float products (reading the
weights; a call of shardq's int8 kernel, which also quantises its row and dequantises, counts
as an int8 product, one of its float kernel as a float product), the copies a layer scan
makes of each layer's weights, the KV-cache writes, attention over the cache, the small
operations between the products (norms, activation quantisation, residual adds), and the time
the program spends between operations (the runtime's dispatch of each one). Operations of one
program may run concurrently on the CPU's threads, so the groups are summed busy time;
`between_ops` is the call's wall time minus the union of the spans.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import jax

from experiments.speed.gc_pause import timed_call
from experiments.speed.step_profile import op_times, parse_hlo, read_trace, union_length
from model import native_float
from model.transformer import ATTENTION_SCOPE
from quant import native_int8

GROUPS = ("int8_products", "float_products", "weight_slices", "cache_writes", "attention",
          "collectives", "small_ops")
_COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all")


def group_of(instr: dict) -> str:
    """The GROUPS entry of one compiled operation."""
    op_name, shape = instr["op_name"], instr["shape"]
    if _COLLECTIVE.match(instr["opcode"]):
        return "collectives"
    if re.search(rf"(?:^|[/(]){ATTENTION_SCOPE}(?:[/)]|$)", op_name):
        return "attention"
    if instr["has_dot"]:
        return "int8_products" if shape.startswith("s32") else "float_products"
    if instr.get("target") in native_int8.TARGETS:  # shardq's kernels
        return "int8_products"
    if instr.get("target") in native_float.TARGETS:
        return "float_products"
    if "dynamic_index_in_dim" in op_name or "dynamic_slice" in op_name:
        return "weight_slices"
    if "dynamic_update" in op_name:
        return "cache_writes"
    return "small_ops"


def decode_breakdown(fn, args: tuple, new_tokens: int) -> dict:
    """Per-token figures of one traced call `fn(*args)` that decodes `new_tokens` tokens (`fn`
    jitted): `ops_per_token` (operations executed), `wall_ms_per_token`, `ms_per_token` by
    GROUPS entry, `between_ops_ms_per_token`, and `top_ops` (the longest operations with their
    group and shape)."""
    compiled = fn.lower(*args).compile()  # its text names the operations the trace times
    instrs = parse_hlo(compiled.as_text())
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        try:
            wall = timed_call(compiled, *args)[1]
        finally:
            jax.profiler.stop_trace()
        events = read_trace(Path(tmp))
    busy, per_op, spans = op_times(events, instrs, group_of)
    per_token = lambda us: us / 1e3 / new_tokens  # noqa: E731 -- microseconds -> ms per token
    return {"traced_tokens": new_tokens, "ops_per_token": len(spans) / new_tokens,
            "wall_ms_per_token": 1e3 * wall / new_tokens,
            "ms_per_token": {g: per_token(busy.get(g, 0.0)) for g in GROUPS},
            "between_ops_ms_per_token": max(0.0, 1e3 * wall / new_tokens
                                            - per_token(union_length(spans))),
            "top_ops": [{"op": name, "group": group_of(instrs[name]),
                         "shape": instrs[name]["shape"], "ms_per_token": per_token(t)}
                        for name, t in per_op.most_common(8)]}
