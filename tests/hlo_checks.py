"""What a compiled program's HLO text says about its products, for tests that must show an int8
product really runs in integers.

Finding `s8[` and `s32[` somewhere in the text proves nothing: a program can read int8
parameters, convert them to float and multiply in float, and an s32 can be any index. A real
int8 product is a `dot` instruction whose two operands are themselves s8 values and whose result
is s32; an operand converted from s8 has the converted type, so it does not count.
"""

from __future__ import annotations

import re

# `%name = type[dims]{layout} opcode(operands), attributes` (the layout is optional)
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(\w+)\[([^\]]*)\]\S*\s+(\w[\w\-]*)\((.*)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_OPERAND = re.compile(r"(?:(\w+)\[[^\]]*\]\S*\s+)?(%[\w.\-]+)")


def _operands(rest: str) -> list[tuple[str | None, str]]:
    """(type written beside it or None, name) of each operand in `rest`, the text after the
    opening parenthesis; operands end at the matching closing one."""
    depth, end = 0, len(rest)
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                end = i
                break
            depth -= 1
    return _OPERAND.findall(rest[:end])


def _instructions(hlo: str) -> tuple[dict, list]:
    """({name: (type, dims)} of every instruction, [(line, type, operands, rest)] of its dots).
    Instruction names are unique in a module, so an operand's type and shape are those of the
    instruction (or parameter) that defines it."""
    shapes, dots = {}, []
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, dtype, dims, opcode, rest = m.groups()
        shapes[name] = (dtype, [int(d) for d in dims.split(",") if d])
        if opcode == "dot":
            dots.append((line.strip(), dtype, _operands(rest), rest))
    return shapes, dots


def int8_dots(hlo: str) -> list[str]:
    """The `dot` instructions of a compiled HLO text that multiply two s8 operands into an s32
    result, one stripped line each."""
    shapes, dots = _instructions(hlo)
    found = []
    for line, dtype, operands, _ in dots:
        kinds = [written or shapes.get(name, (None,))[0] for written, name in operands]
        if dtype == "s32" and kinds == ["s8", "s8"]:
            found.append(line)
    return found


def float_dot_widths(hlo: str) -> list[int]:
    """The contracted length of every f32 `dot` of a compiled HLO text: which float products a
    program still has (attention's, say) once its Dense products run in int8."""
    shapes, dots = _instructions(hlo)
    widths = []
    for _, dtype, operands, rest in dots:
        m = _LHS_CONTRACTING.search(rest)
        if dtype != "f32" or not operands or not m:
            continue
        lhs = shapes[operands[0][1]][1]
        width = 1
        for d in m.group(1).split(","):
            width *= lhs[int(d)]
        widths.append(width)
    return widths
