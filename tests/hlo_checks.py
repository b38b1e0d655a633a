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
    r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(\w+)\[[^\]]*\]\S*\s+(\w[\w\-]*)\((.*)")
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


def int8_dots(hlo: str) -> list[str]:
    """The `dot` instructions of a compiled HLO text that multiply two s8 operands into an s32
    result, one stripped line each. Instruction names are unique in a module, so an operand's
    type is the type of the instruction (or parameter) that defines it."""
    types, dots = {}, []
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, dtype, opcode, rest = m.groups()
        types[name] = dtype
        if opcode == "dot":
            dots.append((line.strip(), dtype, _operands(rest)))
    found = []
    for line, dtype, operands in dots:
        kinds = [written or types.get(name) for written, name in operands]
        if dtype == "s32" and len(kinds) == 2 and kinds == ["s8", "s8"]:
            found.append(line)
    return found
