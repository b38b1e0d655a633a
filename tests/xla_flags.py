"""The XLA flags every process of a test session compiles with: pytest's own (set in conftest.py
before JAX starts) and the launchers the tests start (`helpers.child_env`).

Compiling is most of the suite's time, and both flags shorten XLA:CPU's code generation only:
the optimised HLO, its buffer assignment (the compiled memory peaks) and its collectives are
the same as under XLA's defaults, which is what the compiled-program tests read.
- `--xla_cpu_use_fusion_emitters=false`: loop fusions written with XLA:CPU's older LLVM
  emitters.
- `--xla_backend_optimization_level=0`: LLVM does not optimise the generated code. The tiny
  programs the tests run spend far longer compiling than running.
Elementwise functions come out as other instructions, so a result may differ from the default
setting's in the last bit: every process of a session must use the same flags, which is why the
test launchers get them too. SHARDQ_TEST_XLA_DEFAULTS=1 runs the suite with XLA's defaults,
which users and the experiments run.
"""

import os

_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0")
TEST_XLA_FLAGS = "" if os.environ.get("SHARDQ_TEST_XLA_DEFAULTS") == "1" else " ".join(_FLAGS)


def with_test_flags(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) with each of the session's flags it does not set added."""
    missing = [f for f in TEST_XLA_FLAGS.split() if f.split("=")[0] not in flags]
    return " ".join([*flags.split(), *missing])
