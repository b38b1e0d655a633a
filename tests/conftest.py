"""Test session set-up: 8 fake CPU devices for the whole pytest process, strict numerics, a
compilation cache shared by the session's processes.

The device count must be set before JAX's backend starts, which is why this runs at import
time of conftest. Single-device references run on a 1-device mesh inside the same process.
"""

import atexit
import json
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Most of the suite's time is XLA compiling the same few small programs again and again (the
# tiny preset's step and evaluation, in one test after another and in every launcher a test
# starts). JAX's persistent compilation cache, in one folder per session that the xdist
# workers and the subprocesses inherit through the environment, compiles each once. A cached
# executable computes exactly what a fresh compile does; only its HLO's source-line metadata
# may name the call site that compiled it first.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="shardq-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# One XLA setting for every process of the session (tests/xla_flags.py says which and why).
from tests.xla_flags import with_test_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import pytest  # noqa: E402

from model.native_build import cache_dir  # noqa: E402
from parallel.devices import request_cpu_devices  # noqa: E402

# The native kernels are built once, into the cache a user's runs use: fixed here, before a
# test points XDG_CACHE_HOME at a folder of its own (test_chat.py's layout probe), so that the
# launchers such a test starts do not compile them again.
os.environ.setdefault("SHARDQ_CACHE_DIR", str(cache_dir().parent))

request_cpu_devices(8)

from tests.helpers import cli  # noqa: E402  (after the device count: it imports JAX code)

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def n_devices() -> int:
    assert len(jax.devices()) == 8, "tests expect 8 fake CPU devices"
    return 8


@pytest.fixture(scope="session")
def tiny_byte_run(tmp_path_factory):
    """A finished run of the tiny byte-level preset, trained by `experiments.train` as a user
    runs it: 2 steps on a text file, evaluated and checkpointed at step 2. (workdir, the summary
    it printed). For the modules that read a finished run (test_run_journeys.py,
    test_quant_cli.py, one xdist group): they may add to the folder (quant/), never change
    what the run wrote."""
    root = tmp_path_factory.mktemp("tiny_byte_run")
    corpus = root / "corpus.txt"
    corpus.write_text(open(json.__file__).read() * 4)
    workdir = root / "run"
    proc = cli("train", "--workdir", str(workdir), "--preset", "tiny", "--steps", "2",
               "--eval-every", "2", "--ckpt-every", "2", "--data", str(corpus), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return workdir, json.loads(proc.stdout.strip().splitlines()[-1])
