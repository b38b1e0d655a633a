"""Read what a compiled XLA program does: its collectives, its per-device inputs, its peak memory.

The ZeRO claims are about the program that actually runs, so the experiments and tests read them
from the compiled executable instead of trusting the Python that built it:

- `collectives(text)`: every all-gather / reduce-scatter / all-reduce (and the async `-start`
  forms) in an HLO module's text, with element counts, operand dtypes, replica-group size, the
  while loops around it and how many times it runs per step (product of the loops' trip counts).
- `input_bytes_per_device(compiled, args)`: bytes each input occupies on one device.
- `memory_peak(compiled)`: the compiler's own per-device memory accounting.
- `loop_updated_carry(text, loop)`: the parts of a while loop's carry that its body changes (a
  gradient accumulator, as opposed to loop-invariant values that only ride along).

Works on the text of `compiled.as_text()` (optimised HLO, `%` names, trip counts in
backend_config) and of `lowered.as_text(dialect="hlo")` (before XLA's passes, no trip counts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import numpy as np

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)="
                     r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[^}]*\})")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")


# ---------------------------------------------------------------- parsing the module text


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    result: str  # the result type as printed, e.g. "bf16[4,32]{1,0}" or "(f32[], s32[])"
    opcode: str
    operands: tuple[str, ...]  # operand instruction names
    operand_text: str  # operands as printed (may carry inline types in older printers)
    attributes: str  # everything after the operand list
    is_root: bool


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions.values() if i.is_root)


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str
    n_partitions: int  # devices in the SPMD program: the group when replica_groups={} (all)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket that closes the one opening at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, closing = 0, pairs[text[start]]
    for i in range(start, len(text)):
        if text[i] == text[start]:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {text[start]!r} in HLO line: {text[:120]}")


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTRUCTION.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    if rest.startswith("("):  # tuple-typed result
        end = _balanced(rest, 0)
        result, rest = rest[:end], rest[end:].lstrip()
    else:
        result, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _balanced(rest, op.end() - 1)
    operand_text = rest[op.end():close - 1]
    operands = tuple(re.findall(r"%([\w.\-]+)", operand_text)) or tuple(
        t.strip().split(" ")[-1] for t in operand_text.split(",") if t.strip())
    return Instruction(name, result, op.group(1), operands, operand_text, rest[close:], is_root)


@functools.lru_cache(maxsize=4)  # the helpers below re-read the same (large) module text
def parse_module(text: str) -> Module:
    computations: dict[str, Computation] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith("HloModule"):
                current = Computation(header.group(2), {})
                if header.group(1):
                    entry = current.name
            continue
        if line.strip() == "}":
            computations[current.name] = current
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            current.instructions[instruction.name] = instruction
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    partitions = re.search(r"num_partitions=(\d+)", text)
    return Module(computations, entry, int(partitions.group(1)) if partitions else 1)


def array_shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """[(dtype, dims), ...] of every array in a (possibly tuple) HLO type."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(type_text) if dt in _DTYPE_BYTES]


def type_bytes(type_text: str) -> int:
    return sum(_DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in array_shapes(type_text))


# ---------------------------------------------------------------- who runs how often


@dataclasses.dataclass(frozen=True)
class Context:
    """How a computation is reached from ENTRY: the while loops around it and its run count."""

    loops: tuple[tuple[str, int | None], ...]  # (while instruction, known trip count), outer first
    executions: int  # per program run; loops with an unknown trip count count once


def _callees(instruction: Instruction) -> list[tuple[str, str]]:
    found = _CALLEE.findall(instruction.attributes)
    for branch_list in _BRANCHES.findall(instruction.attributes):
        found += [("branch", b.strip().lstrip("%")) for b in branch_list.split(",")]
    return found


def computation_contexts(module: Module) -> dict[str, list[Context]]:
    """Every path from ENTRY to each computation (a computation may be called from several)."""
    contexts: dict[str, list[Context]] = {}

    def visit(name: str, context: Context) -> None:
        contexts.setdefault(name, []).append(context)
        for instruction in module.computations[name].instructions.values():
            if instruction.opcode.endswith("-done") or instruction.opcode == "async-update":
                continue  # the matching -start already led into the same computation
            for role, callee in _callees(instruction):
                if callee not in module.computations:
                    continue
                if role == "body" and instruction.opcode == "while":
                    trip = _TRIP_COUNT.search(instruction.attributes)
                    trips = int(trip.group(1)) if trip else None
                    visit(callee, Context(context.loops + ((instruction.name, trips),),
                                          context.executions * (trips or 1)))
                elif role != "condition":  # a loop condition holds no collectives worth counting
                    visit(callee, context)

    visit(module.entry, Context((), 1))
    return contexts


# ---------------------------------------------------------------- collectives


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of COLLECTIVE_KINDS (an async "-start" is folded into its kind)
    name: str
    operands: tuple[str, ...]  # operand instruction names (in `computation`)
    asynchronous: bool
    dtypes: tuple[str, ...]  # operand element types (a combined collective has several)
    operand_elements: int  # per device, summed over operands
    group_size: int
    computation: str
    loops: tuple[tuple[str, int | None], ...]  # enclosing while loops, outermost first
    executions: int  # per step: product of the enclosing loops' known trip counts

    @property
    def in_loop(self) -> bool:
        return bool(self.loops)

    @property
    def result_elements(self) -> int:
        if self.kind == "all-gather":
            return self.operand_elements * self.group_size
        if self.kind == "reduce-scatter":
            return self.operand_elements // self.group_size
        return self.operand_elements

    @property
    def volume_elements(self) -> int:
        """Elements one device moves per execution, ring convention (see VOLUME_CONVENTION)."""
        if self.kind == "all-reduce":
            return 2 * self.operand_elements
        if self.kind == "all-gather":
            return self.result_elements
        return self.operand_elements  # reduce-scatter


VOLUME_CONVENTION = ("ring: all-reduce of M elements = 2M, all-gather = output elements, "
                     "reduce-scatter = input elements (the (N-1)/N factor is left out)")


def _group_size(attributes: str, n_partitions: int) -> int:
    listed = _GROUPS_LIST.search(attributes)
    if listed:
        return len([d for d in listed.group(1).strip("{}").split(",") if d.strip()])
    iota = _GROUPS_IOTA.search(attributes)
    if iota:
        return int(iota.group(2))
    return n_partitions  # replica_groups={} (or absent): one group of every device


def _operand_types(instruction: Instruction, computation: Computation) -> list[str]:
    if _ARRAY.search(instruction.operand_text):  # printers that write operand types inline
        return [instruction.operand_text]
    return [computation.instructions[name].result for name in instruction.operands
            if name in computation.instructions]


def _collective_kind(opcode: str) -> tuple[str, bool] | None:
    for kind in COLLECTIVE_KINDS:
        if opcode == kind:
            return kind, False
        if opcode == kind + "-start":
            return kind, True
    return None


def collectives(text: str, include_trivial: bool = False) -> list[Collective]:
    """All collectives of the module, each once per path from ENTRY.

    Groups of size 1 (a psum over a mesh axis of size 1) move nothing and are left out unless
    `include_trivial`.
    """
    module = parse_module(text)
    found = []
    for comp_name, contexts in computation_contexts(module).items():
        computation = module.computations[comp_name]
        for instruction in computation.instructions.values():
            kind = _collective_kind(instruction.opcode)
            if kind is None:
                continue
            group = _group_size(instruction.attributes, module.n_partitions)
            if group == 1 and not include_trivial:
                continue
            shapes = [s for t in _operand_types(instruction, computation) for s in array_shapes(t)]
            for context in contexts:
                found.append(Collective(
                    kind=kind[0], name=instruction.name, operands=instruction.operands,
                    asynchronous=kind[1],
                    dtypes=tuple(dt for dt, _ in shapes),
                    operand_elements=sum(math.prod(dims) for _, dims in shapes),
                    group_size=group, computation=comp_name, loops=context.loops,
                    executions=context.executions))
    return found


def producer_dtypes(text: str, collective: Collective) -> set[str]:
    """Element types computed on the way to a collective's operands.

    The operands' own types, plus, when an operand is a fusion, every type inside the fused
    computation: e.g. a bf16 rounding (f32 -> bf16 -> f32) that a backend without bf16
    collectives (XLA:CPU) leaves in front of an all-gather it widened to f32.
    """
    module = parse_module(text)
    computation = module.computations[collective.computation]
    found: set[str] = set()
    for name in collective.operands:
        producer = computation.instructions[name]
        found |= {dt for dt, _ in array_shapes(producer.result)}
        fused = re.search(r"calls=%?([\w.\-]+)", producer.attributes)
        if producer.opcode == "fusion" and fused:
            for inner in module.computations[fused.group(1)].instructions.values():
                found |= {dt for dt, _ in array_shapes(inner.result)}
    return found


def volume_per_step(found: list[Collective]) -> int:
    """Elements one device sends per step over all collectives (each times its executions)."""
    return sum(c.volume_elements * c.executions for c in found)


# ---------------------------------------------------------------- loop carries


@dataclasses.dataclass(frozen=True)
class CarryElement:
    index: int
    type_text: str
    bytes: int

    @property
    def is_scalar(self) -> bool:
        return all(not dims for _, dims in array_shapes(self.type_text))


def while_loops(text: str, computation: str | None = None) -> list[Instruction]:
    """The while instructions of one computation (default: ENTRY)."""
    module = parse_module(text)
    comp = module.computations[computation or module.entry]
    return [i for i in comp.instructions.values() if i.opcode == "while"]


def trip_count(loop: Instruction) -> int | None:
    trip = _TRIP_COUNT.search(loop.attributes)
    return int(trip.group(1)) if trip else None


def loop_updated_carry(text: str, loop: Instruction) -> list[CarryElement]:
    """Carry elements the loop body replaces, i.e. everything but pass-through invariants.

    An element passes through when the body's ROOT tuple returns, at index i, a
    get-tuple-element of the body parameter with the same index i.
    """
    module = parse_module(text)
    body = module.computations[re.search(r"body=%?([\w.\-]+)", loop.attributes).group(1)]
    parameter = next(i.name for i in body.instructions.values() if i.opcode == "parameter")
    root = body.root
    if root.opcode != "tuple":
        raise ValueError(f"while body {body.name} does not end in a tuple")
    updated = []
    for index, name in enumerate(root.operands):
        source = body.instructions[name]
        passes_through = (source.opcode == "get-tuple-element"
                          and source.operands == (parameter,)
                          and int(_TUPLE_INDEX.search(source.attributes).group(1)) == index)
        if not passes_through:
            updated.append(CarryElement(index, source.result, type_bytes(source.result)))
    return updated


# ---------------------------------------------------------------- bytes and memory


def input_bytes_per_device(compiled, args):
    """Bytes one device holds of every input leaf, as a pytree shaped like `args`.

    `args` are the (abstract) arguments the program was lowered with: they give the global
    shapes; the executable's input shardings give how much of each one device holds.
    """
    leaves, treedef = jax.tree.flatten(tuple(args))
    shardings = jax.tree.leaves(compiled.input_shardings[0])
    if len(leaves) != len(shardings):
        raise ValueError(f"{len(leaves)} argument leaves but {len(shardings)} input shardings")
    per_device = [math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
                  for leaf, sharding in zip(leaves, shardings, strict=True)]
    return jax.tree.unflatten(treedef, per_device)


@dataclasses.dataclass(frozen=True)
class MemoryPeak:
    """Per-device bytes from `compiled.memory_analysis()`.

    peak = argument + output + temp - alias: inputs, outputs and the temporaries buffer
    assignment needs, with donated inputs that the outputs reuse (alias) counted once. Host-side
    and generated-code sizes are not included.
    """

    argument: int
    output: int
    temp: int
    alias: int

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias


def memory_peak(compiled) -> MemoryPeak:
    stats = compiled.memory_analysis()
    return MemoryPeak(stats.argument_size_in_bytes, stats.output_size_in_bytes,
                      stats.temp_size_in_bytes, stats.alias_size_in_bytes)
