"""Transparent huge pages as a decoding lever (experiments/speed/huge_page_runs.py): the child
environments, that the tunable they differ in takes effect, the alternating rows, and the
table.

References: the kernel's own count of a process's memory in huge pages (/proc/self/smaps_rollup)
with the tunable and without; handmade environments and child results.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from experiments.reporting.tables import speed
from experiments.speed import huge_page_runs

H = huge_page_runs.HUGETLB


def test_children_differ_only_in_the_hugetlb_tunable():
    envs = huge_page_runs.child_environments({"A": "1"})
    assert envs == {True: {"A": "1", "GLIBC_TUNABLES": H}, False: {"A": "1"}}
    # other tunables are kept in both; a hugetlb setting of the caller's is replaced
    envs = huge_page_runs.child_environments(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"})
    assert envs[True] == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{H}"}
    assert envs[False] == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert huge_page_runs.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert huge_page_runs.thp_mode(f) == "always"
    assert huge_page_runs.thp_mode(tmp_path / "absent") is None


PROBE = textwrap.dedent("""
    import ctypes
    from experiments.speed import huge_page_runs
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    n = 64 << 20
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)  # touched: the pages exist now
    print(huge_page_runs.huge_page_bytes())
""")


@pytest.mark.skipif(huge_page_runs.thp_mode() != "madvise",
                    reason="the kernel gives huge pages to all memory or to none here")
def test_the_tunable_puts_a_large_allocation_in_huge_pages(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    envs = huge_page_runs.child_environments()

    def huge_bytes(on: bool) -> int:
        out = subprocess.run([sys.executable, str(script)], env=envs[on], capture_output=True,
                             text=True, check=True, cwd=os.getcwd())
        return int(out.stdout.split()[-1])

    assert huge_bytes(True) >= 32 << 20  # most of the 64 MiB, whatever its alignment
    assert huge_bytes(False) < 4 << 20  # the control: 4 KiB pages where nothing asks


def test_child_rows_alternate_and_take_medians(monkeypatch):
    calls = []
    speeds = {True: [(10.0, 30.0), (14.0, 34.0)], False: [(8.0, 28.0), (9.0, 30.0)]}

    def fake_child(argv, env, what):
        on = H in env.get("GLIBC_TUNABLES", "")
        calls.append(on)
        f, w = speeds[on][sum(1 for c in calls if c == on) - 1]
        return {"float": f, "w8a8": w}, 100 if on else 0

    monkeypatch.setattr(huge_page_runs, "child_speeds", fake_child)
    rows = huge_page_runs.huge_page_rows(["--variants", "float,w8a8"], rounds=2)
    assert calls == [True, False, False, True]  # neither always first
    f, w = rows
    assert (f["variant"], f["tokens_per_s"], f["without_tokens_per_s"]) == ("float", 12.0, 8.5)
    assert w["speedup"] == 32.0 / 29.0
    assert f["huge_page_bytes"] == [100, 100] and f["without_huge_page_bytes"] == [0, 0]


def test_the_speed_table_shows_the_rows_and_what_the_run_held():
    d = {"huge_pages": {"thp": "madvise", "asked": False, "bytes": 30e6, "rows": [
        {"variant": "float", "tokens_per_s": 90.0, "without_tokens_per_s": 72.0,
         "speedup": 1.25, "huge_page_bytes": [590e6, 610e6],
         "without_huge_page_bytes": [0, 0]}]}}
    lines = speed._bench_decode_levers(d)
    assert "| float | 90.0 | 72.0 | 1.25× | 590–610 | 0 |" in lines
    assert speed._pages(d) == ("no huge pages asked of malloc (kernel mode madvise), 30 MB in "
                               "them at the end, ")
    assert speed._pages({}) == ""
