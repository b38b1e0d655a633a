"""The XLA flags every process of a test session compiles with: pytest's own (set in conftest.py
before JAX starts) and the launchers the tests start (`helpers.child_env`).

XLA:CPU writes its loop fusions with its older LLVM emitters here. Compiling is about half of
the suite's time, and this compiles the tiny training step in 1.5 s instead of 2.4 s (zero3 on 8
devices, measured). Elementwise functions come out as other instructions, so a result may differ
from the default emitters' in the last bit: every process of a session must use the same
setting, which is why the test launchers get it too. SHARDQ_TEST_XLA_DEFAULTS=1 runs the suite
with XLA's default emitters, which users and the experiments run.
"""

import os

TEST_XLA_FLAGS = ("" if os.environ.get("SHARDQ_TEST_XLA_DEFAULTS") == "1"
                  else "--xla_cpu_use_fusion_emitters=false")


def with_test_flags(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) with the session's flags added, once."""
    if not TEST_XLA_FLAGS or TEST_XLA_FLAGS.split("=")[0] in flags:
        return flags
    return f"{flags} {TEST_XLA_FLAGS}".strip()
