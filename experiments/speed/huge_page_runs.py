"""Transparent huge pages as a decoding lever: the decoding launchers start with them asked of
glibc's malloc (experiments/cli/huge_pages.py); here float and the default int8 mode are timed
in child processes that start that way and in children that keep 4 KiB pages
(`SHARDQ_HUGE_PAGES=0`), alternating round by round so that a change in the machine's load hits
both. Each child records how much of its memory the kernel put in huge pages.
"""

from __future__ import annotations

import os
import statistics

from experiments.cli import huge_pages
from experiments.speed.xla_flag_runs import child_speeds


def child_environments(environ=os.environ) -> dict[bool, dict[str, str]]:
    """{True: a child that asks for huge pages as a launcher does by default, False: one that
    keeps 4 KiB pages}, both from `environ` without what this process itself added."""
    base = huge_pages.without_ours(environ)
    base.pop(huge_pages.SWITCH, None)
    return {True: base, False: {**base, huge_pages.SWITCH: "0"}}


def huge_page_rows(argv: list[str], rounds: int) -> list[dict]:
    """One row per variant `argv` names: tokens/s with huge pages and without (medians over
    `rounds` alternating rounds), the speed-up, and the children's bytes in huge pages."""
    envs = child_environments()
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(rounds):
        for on, env in envs.items():
            runs[on].append(child_speeds(argv, env, f"{huge_pages.SWITCH}={int(on)}"))
    variants = [k for k in runs[True][0] if k != "huge_page_bytes"]
    rows = []
    for v in variants:
        on, off = ([r[v] for r in runs[flag]] for flag in (True, False))
        rows.append({"variant": v, "tokens_per_s": statistics.median(on),
                     "without_tokens_per_s": statistics.median(off),
                     "speedup": statistics.median(on) / statistics.median(off),
                     "runs_tokens_per_s": on, "without_runs_tokens_per_s": off})
    return [{**r, "huge_page_bytes": [c["huge_page_bytes"] for c in runs[True]],
             "without_huge_page_bytes": [c["huge_page_bytes"] for c in runs[False]]}
            for r in rows]
