"""Transparent huge pages as a decoding lever, tried and recorded: float and the default int8
mode timed in child processes that start with glibc's malloc asking the kernel for huge pages
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`; XLA:CPU's buffers come from that malloc) and in
children that do not, in rounds whose order reverses every other round (with, without; without,
with ...) so that a change in the machine's load hits both and neither always runs first. The
tunable is read once, when a process starts, hence the children. Each child records how much
of its memory the kernel put in huge pages: the control that the setting took.

Where the kernel gives huge pages to every allocation (`always` in
/sys/kernel/mm/transparent_hugepage/enabled) or to none (`never`), or glibc predates the
tunable (2.35), the two kinds of child are alike, and their bytes in huge pages say so.
JAX-free.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping
from pathlib import Path

from experiments.speed.interleaving import round_order
from experiments.speed.xla_flag_runs import child_speeds

TUNABLES = "GLIBC_TUNABLES"
HUGETLB = "glibc.malloc.hugetlb=1"
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(sysfs: Path = THP) -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never); None off Linux."""
    try:
        text = sysfs.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory in transparent huge pages (Linux), None where
    the kernel does not say."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def page_state() -> dict:
    """The kernel's mode, whether this process started with malloc asking for huge pages, and
    the bytes of its memory in huge pages now."""
    return {"thp": thp_mode(), "asked": "glibc.malloc.hugetlb" in os.environ.get(TUNABLES, ""),
            "bytes": huge_page_bytes()}


def child_environments(environ: Mapping[str, str] = os.environ) -> dict[bool, dict[str, str]]:
    """{True: `environ` with malloc asking for huge pages, False: `environ` without any hugetlb
    tunable}; the other tunables kept in both."""
    rest = [t for t in environ.get(TUNABLES, "").split(":")
            if t and not t.startswith("glibc.malloc.hugetlb")]
    off = {k: v for k, v in environ.items() if k != TUNABLES}
    if rest:
        off[TUNABLES] = ":".join(rest)
    return {True: {**off, TUNABLES: ":".join([*rest, HUGETLB])}, False: off}


def huge_page_rows(argv: list[str], rounds: int) -> list[dict]:
    """One row per variant `argv` names: tokens/s with huge pages and without (medians over
    `rounds` rounds), the speed-up, and each child's bytes in huge pages."""
    envs = child_environments()
    runs: dict[bool, list[tuple[dict[str, float], int | None]]] = {True: [], False: []}
    for i in range(rounds):
        for on in round_order([True, False], i):
            runs[on].append(child_speeds(argv, envs[on], f"huge pages {'on' if on else 'off'}"))
    rows = []
    for v in runs[True][0][0]:
        on, off = ([speeds[v] for speeds, _ in runs[flag]] for flag in (True, False))
        rows.append({"variant": v, "tokens_per_s": statistics.median(on),
                     "without_tokens_per_s": statistics.median(off),
                     "speedup": statistics.median(on) / statistics.median(off),
                     "runs_tokens_per_s": on, "without_runs_tokens_per_s": off,
                     "huge_page_bytes": [b for _, b in runs[True]],
                     "without_huge_page_bytes": [b for _, b in runs[False]]})
    return rows
