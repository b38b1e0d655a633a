"""Transparent huge pages for the buffers XLA:CPU allocates, asked of glibc's malloc at start-up.

A decoding step reads every weight once, front to back; with 4 KiB pages that stream crosses a
page, and the hardware prefetchers stop, every 4 KiB. Where the kernel hands out huge pages only
to memory that asks for them (`madvise` in /sys/kernel/mm/transparent_hugepage/enabled, the
common default), glibc's malloc (2.35 and later) asks for them when the process starts with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`; XLA's CPU buffers come from that malloc. The tunable
is read once, when the process starts, so a decoding launcher calls `restart_with_huge_pages()`
first thing, and the process starts again with it set (the same command line).
`SHARDQ_HUGE_PAGES=0` keeps the process as it is; experiments.bench_decode times both.
JAX-free: it runs before anything is imported.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

SWITCH = "SHARDQ_HUGE_PAGES"  # "0": leave the process's pages alone
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


def _glibc_knows_hugetlb() -> bool:
    lib, version = platform.libc_ver()
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return lib == "glibc" and (major, minor) >= (2, 35)


def environment_with_huge_pages(environ: Mapping[str, str], mode: str | None,
                                glibc_ok: bool) -> dict[str, str] | None:
    """The environment to start again with, or None where nothing would change: switched off,
    already set, a kernel that gives huge pages to all memory or to none, or a libc without
    the tunable."""
    tunables = environ.get(TUNABLES, "")
    if (environ.get(SWITCH) == "0" or "glibc.malloc.hugetlb" in tunables
            or mode != "madvise" or not glibc_ok):
        return None
    return {**environ, TUNABLES: f"{tunables}:{HUGETLB}" if tunables else HUGETLB,
            SWITCH: "1"}


def restart_with_huge_pages() -> None:
    """Start this process again, the same command line, with huge pages asked of malloc, where
    that changes anything (`environment_with_huge_pages`); otherwise return. Call it before
    anything is printed or written: the process is replaced."""
    env = environment_with_huge_pages(os.environ, thp_mode(), _glibc_knows_hugetlb())
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def without_ours(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the tunable this module added (for a peer program, which runs as its
    users start it)."""
    env = dict(environ)
    if env.pop(SWITCH, None) == "1":
        rest = [t for t in env.get(TUNABLES, "").split(":") if t and t != HUGETLB]
        if rest:
            env[TUNABLES] = ":".join(rest)
        else:
            env.pop(TUNABLES, None)
    return env


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
