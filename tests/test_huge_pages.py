"""Transparent huge pages for XLA:CPU's buffers (experiments/cli/huge_pages.py): when a decoding
launcher starts again with glibc's tunable, what a peer program is given, and the benchmark's
alternating child rows (experiments/speed/huge_page_runs.py).

References: the kernel's own count of a process's memory in huge pages (/proc/self/smaps_rollup)
with the switch on and off; handmade environments and child results.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from experiments.cli import huge_pages
from experiments.speed import huge_page_runs

H = huge_pages.HUGETLB


def test_the_tunable_is_added_only_where_it_changes_something():
    add = lambda env, mode="madvise", ok=True: huge_pages.environment_with_huge_pages(
        env, mode, ok)
    assert add({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": H, "SHARDQ_HUGE_PAGES": "1"}
    # other tunables are kept, ours goes after them
    assert add({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        f"glibc.malloc.arena_max=2:{H}"
    assert add({"SHARDQ_HUGE_PAGES": "0"}) is None  # switched off
    assert add({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=2"}) is None  # the user chose already
    assert add({}, "always") is None and add({}, "never") is None and add({}, None) is None
    assert add({}, ok=False) is None  # a libc without the tunable


def test_a_peer_gets_the_environment_without_what_we_added():
    ours = huge_pages.environment_with_huge_pages(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "B": "x"}, "madvise", True)
    assert huge_pages.without_ours(ours) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2",
                                             "B": "x"}
    alone = huge_pages.environment_with_huge_pages({}, "madvise", True)
    assert huge_pages.without_ours(alone) == {}
    # a tunable the user set is theirs: left as it is
    users = {"GLIBC_TUNABLES": H}
    assert huge_pages.without_ours(users) == users


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert huge_pages.thp_mode(f) == "always"
    assert huge_pages.thp_mode(tmp_path / "absent") is None


PROBE = textwrap.dedent("""
    import ctypes, os, sys
    sys.path.insert(0, os.getcwd())
    from experiments.cli import huge_pages
    huge_pages.restart_with_huge_pages()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    n = 64 << 20
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)  # touched: the pages exist now
    print(huge_pages.huge_page_bytes())
""")


@pytest.mark.skipif(huge_pages.environment_with_huge_pages({}, huge_pages.thp_mode(),
                                                           huge_pages._glibc_knows_hugetlb())
                    is None, reason="huge pages are not asked of malloc on this host "
                    "(kernel mode or libc)")
def test_the_restarted_process_holds_its_large_allocation_in_huge_pages(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)

    def huge_bytes(switch: str) -> int:
        env = {**huge_pages.without_ours(os.environ), "SHARDQ_HUGE_PAGES": switch}
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                             text=True, check=True, cwd=os.getcwd())
        return int(out.stdout.split()[-1])

    assert huge_bytes("1") >= 32 << 20  # most of the 64 MiB, whatever its alignment
    assert huge_bytes("0") < 4 << 20  # the control: 4 KiB pages where nothing asks


def test_child_rows_alternate_and_take_medians(monkeypatch):
    calls = []
    speeds = {True: [(10.0, 30.0), (14.0, 34.0)], False: [(8.0, 28.0), (9.0, 30.0)]}

    def fake_child(argv, env, what):
        on = env.get("SHARDQ_HUGE_PAGES") != "0"
        calls.append(on)
        f, w = speeds[on][sum(1 for c in calls if c == on) - 1]
        return {"float": f, "w8a8": w, "huge_page_bytes": 100 if on else 0}

    monkeypatch.setattr(huge_page_runs, "child_speeds", fake_child)
    monkeypatch.setenv("GLIBC_TUNABLES", H)
    monkeypatch.setenv("SHARDQ_HUGE_PAGES", "1")  # this process added it: children start clean
    rows = huge_page_runs.huge_page_rows(["--variants", "float,w8a8"], rounds=2)
    assert calls == [True, False, True, False]
    f, w = rows
    assert (f["variant"], f["tokens_per_s"], f["without_tokens_per_s"]) == ("float", 12.0, 8.5)
    assert w["speedup"] == 32.0 / 29.0
    assert f["huge_page_bytes"] == [100, 100] and f["without_huge_page_bytes"] == [0, 0]
    envs = huge_page_runs.child_environments()
    assert "GLIBC_TUNABLES" not in envs[True] and "SHARDQ_HUGE_PAGES" not in envs[True]
    assert envs[False]["SHARDQ_HUGE_PAGES"] == "0"


def test_the_speed_table_shows_the_rows_and_what_the_run_held():
    from experiments.reporting.tables import speed

    d = {"huge_pages": {"thp": "madvise", "asked": True, "bytes": 600e6, "rows": [
        {"variant": "float", "tokens_per_s": 90.0, "without_tokens_per_s": 72.0,
         "speedup": 1.25, "huge_page_bytes": [590e6, 610e6],
         "without_huge_page_bytes": [0, 0]}]}}
    lines = speed._bench_decode_levers({**d, "layout_probe": {}})
    assert "| float | 90.0 | 72.0 | 1.25× | 590–610 | 0–0 |" in lines
    assert speed._pages(d) == ("huge pages asked of malloc (kernel mode madvise), 600 MB in "
                               "them at the end, ")
    assert speed._pages({}) == ""
